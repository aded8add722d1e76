#include "client/cli/seq_file.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvq::client {
namespace {

const char* DTypeName(v1::DType t) {
  switch (t) {
    case v1::DTYPE_F32:
      return "F32";
    case v1::DTYPE_F16:
      return "F16";
    case v1::DTYPE_BF16:
      return "BF16";
    default:
      return "?";
  }
}

size_t DTypeBytes(v1::DType t) { return t == v1::DTYPE_F32 ? 4 : 2; }

}  // namespace

absl::Status WriteSeqFile(const std::string& path, const SeqFile& file) {
  nlohmann::json header = nlohmann::json::object();
  nlohmann::json meta = nlohmann::json::object();
  meta["format"] = "kvq-sequence";
  for (const auto& [k, v] : file.metadata) meta[k] = v;
  header["__metadata__"] = meta;
  uint64_t offset = 0;
  for (size_t l = 0; l < file.layers.size(); ++l) {
    const SeqLayer& L = file.layers[l];
    for (const char* part : {"keys", "values"}) {
      const std::string& bytes = std::string(part) == "keys" ? L.keys : L.values;
      header[absl::StrCat("layer.", l, ".", part)] = {
          {"dtype", DTypeName(L.dtype)},
          {"shape", {L.kv_heads, L.tokens, L.head_dim}},
          {"data_offsets", {offset, offset + bytes.size()}}};
      offset += bytes.size();
    }
  }
  const uint64_t ids_bytes = file.token_ids.size() * sizeof(uint32_t);
  if (!file.token_ids.empty()) {
    header["token_ids"] = {{"dtype", "U32"},
                           {"shape", {file.token_ids.size()}},
                           {"data_offsets", {offset, offset + ids_bytes}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
    uint64_t n = h.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    out.write(len, 8);
    out.write(h.data(), h.size());
    for (const SeqLayer& L : file.layers) {
      out.write(L.keys.data(), L.keys.size());
      out.write(L.values.data(), L.values.size());
    }
    for (uint32_t id : file.token_ids) {  // little-endian
      char b[4];
      for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((id >> (8 * i)) & 0xff);
      out.write(b, 4);
    }
    out.close();
    if (!out) return absl::DataLossError(absl::StrCat("short write to '", path, "'"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat("cannot rename into '", path, "': ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<SeqFile> ReadSeqFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not a kvq sequence file: ", why));
  };
  if (data.size() < 8) return bad("shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(data[i])) << (8 * i);
  if (n > data.size() - 8) return bad("header length beyond the end of the file");
  nlohmann::json header = nlohmann::json::parse(data.substr(8, n), nullptr, false);
  if (header.is_discarded() || !header.is_object()) return bad("header is not a JSON object");
  const size_t base = 8 + n;
  SeqFile file;
  if (header.contains("__metadata__") && header["__metadata__"].is_object()) {
    for (auto& [k, v] : header["__metadata__"].items()) {
      if (v.is_string()) file.metadata[k] = v.get<std::string>();
    }
  }
  int layers = 0;
  while (header.contains(absl::StrCat("layer.", layers, ".keys"))) ++layers;
  if (layers == 0) return bad("no tensor 'layer.0.keys'");
  for (auto& [name, _] : header.items()) {
    if (name == "__metadata__" || name == "token_ids") continue;
    int l = -1;
    std::string rest;
    if (name.rfind("layer.", 0) == 0) {
      const size_t dot = name.find('.', 6);
      if (dot != std::string::npos && absl::SimpleAtoi(name.substr(6, dot - 6), &l)) {
        rest = name.substr(dot + 1);
      }
    }
    if (l < 0 || l >= layers || (rest != "keys" && rest != "values")) {
      return bad(absl::StrCat("unexpected tensor '", name, "' (layers must be 0..", layers - 1,
                              " without gaps)"));
    }
  }
  for (int l = 0; l < layers; ++l) {
    SeqLayer L;
    for (const char* part : {"keys", "values"}) {
      const std::string name = absl::StrCat("layer.", l, ".", part);
      if (!header.contains(name)) return bad(absl::StrCat("missing tensor '", name, "'"));
      const nlohmann::json& t = header[name];
      if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
          !t.contains("data_offsets")) {
        return bad(absl::StrCat(name, ": needs dtype, shape and data_offsets"));
      }
      const std::string dt = t["dtype"].is_string() ? t["dtype"].get<std::string>() : "";
      v1::DType dtype = dt == "F16"    ? v1::DTYPE_F16
                        : dt == "BF16" ? v1::DTYPE_BF16
                        : dt == "F32"  ? v1::DTYPE_F32
                                       : v1::DTYPE_UNSPECIFIED;
      if (dtype == v1::DTYPE_UNSPECIFIED)
        return bad(absl::StrCat(name, ": dtype must be F16, BF16 or F32"));
      const auto& shape = t["shape"];
      if (!shape.is_array() || shape.size() != 3) {
        return bad(absl::StrCat(name, ": shape must be [kv_heads, tokens, head_dim]"));
      }
      int64_t dims[3];
      for (int i = 0; i < 3; ++i) {
        if (!shape[i].is_number_integer() || shape[i].get<int64_t>() < 1) {
          return bad(absl::StrCat(name, ": shape dims must be >= 1"));
        }
        dims[i] = shape[i].get<int64_t>();
      }
      const auto& off = t["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
          !off[1].is_number_unsigned()) {
        return bad(absl::StrCat(name, ": data_offsets must be [begin, end]"));
      }
      const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
      const uint64_t want = static_cast<uint64_t>(dims[0] * dims[1] * dims[2]) * DTypeBytes(dtype);
      if (e < b || e - b != want || base + e > data.size()) {
        return bad(absl::StrCat(name, ": data_offsets [", b, ", ", e, ") do not hold ", want,
                                " bytes inside the file"));
      }
      if (std::string(part) == "keys") {
        L.dtype = dtype;
        L.kv_heads = dims[0];
        L.tokens = dims[1];
        L.head_dim = dims[2];
        L.keys = data.substr(base + b, want);
      } else {
        if (dtype != L.dtype || dims[0] != L.kv_heads || dims[1] != L.tokens ||
            dims[2] != L.head_dim) {
          return bad(absl::StrCat("layer.", l, ".values must match layer.", l,
                                  ".keys in dtype and shape"));
        }
        L.values = data.substr(base + b, want);
      }
    }
    file.layers.push_back(std::move(L));
  }
  if (header.contains("token_ids")) {
    const nlohmann::json& t = header["token_ids"];
    const int64_t tokens = file.layers[0].tokens;
    if (!t.is_object() || t.value("dtype", "") != "U32" || !t.contains("shape") ||
        !t["shape"].is_array() || t["shape"].size() != 1 || !t["shape"][0].is_number_integer() ||
        t["shape"][0].get<int64_t>() != tokens || !t.contains("data_offsets") ||
        !t["data_offsets"].is_array() || t["data_offsets"].size() != 2 ||
        !t["data_offsets"][0].is_number_unsigned() || !t["data_offsets"][1].is_number_unsigned()) {
      return bad(absl::StrCat("token_ids must be U32 [", tokens, "] with data_offsets"));
    }
    const uint64_t b = t["data_offsets"][0].get<uint64_t>(),
                   e = t["data_offsets"][1].get<uint64_t>();
    if (e < b || e - b != static_cast<uint64_t>(tokens) * 4 || base + e > data.size()) {
      return bad("token_ids: data_offsets do not hold 4 bytes per token inside the file");
    }
    for (const SeqLayer& L : file.layers) {
      if (L.tokens != tokens) return bad("token_ids needs every layer to hold the same tokens");
    }
    file.token_ids.resize(tokens);
    for (int64_t i = 0; i < tokens; ++i) {
      uint32_t v = 0;
      for (int k = 0; k < 4; ++k) {
        v |= static_cast<uint32_t>(static_cast<uint8_t>(data[base + b + 4 * i + k])) << (8 * k);
      }
      file.token_ids[i] = v;
    }
  }
  return file;
}

}  // namespace kvq::client
