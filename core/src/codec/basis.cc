// Basis files: safetensors (F32 tensors "layer.{l}.u" [kv_heads, head_dim, rank]) plus a JSON
// manifest. The safetensors layout: u64 header length N, N bytes of JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
#include "kvq/core/basis.h"

#include <xxhash.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvq/core/env.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"

namespace kvq::core {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

absl::Status Bad(const std::string& dir, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("basis ", dir, ": ", what));
}

}  // namespace

std::string BasisFingerprint(const ModelBasis& b) {
  uint64_t h = XXH3_64bits(b.u.data(), b.u.size() * sizeof(float));
  if (b.oblique()) h = XXH3_64bits_withSeed(b.encode.data(), b.encode.size() * sizeof(float), h);
  if (!b.query_moment.empty())
    h = XXH3_64bits_withSeed(b.query_moment.data(), b.query_moment.size() * sizeof(float), h);
  if (!b.value_metric.empty())
    h = XXH3_64bits_withSeed(b.value_metric.data(), b.value_metric.size() * sizeof(float), h);
  return absl::StrFormat("%016x", h);
}

ModelBasis ModelBasis::Truncated(int r) const {
  ModelBasis out;
  out.manifest = manifest;
  out.manifest.rank = r;
  const int R = manifest.rank, d = manifest.head_dim;
  const size_t heads = static_cast<size_t>(manifest.layers) * manifest.kv_heads;
  auto keep_first = [&](const std::vector<float>& from, std::vector<float>* to) {
    to->resize(heads * d * r);
    for (size_t h = 0; h < heads; ++h)
      for (int a = 0; a < d; ++a)
        for (int j = 0; j < r; ++j) (*to)[(h * d + a) * r + j] = from[(h * d + a) * R + j];
  };
  // An oblique pair's leading columns are the lower-rank pair (A^T B = I column by column).
  keep_first(u, &out.u);
  if (oblique()) keep_first(encode, &out.encode);
  out.query_moment = query_moment;
  out.value_metric = value_metric;
  out.manifest.fingerprint = BasisFingerprint(out);
  return out;
}

absl::Status WriteBasis(const std::string& dir, ModelBasis& b, Env* env) {
  if (env == nullptr) env = Env::Default();
  const BasisManifest& m = b.manifest;
  const size_t per_layer = static_cast<size_t>(m.kv_heads) * m.head_dim * m.rank;
  if (m.layers < 1 || m.kv_heads < 1 || m.head_dim < 1 || m.rank < 1 ||
      b.u.size() != per_layer * m.layers || (b.oblique() && b.encode.size() != b.u.size()) ||
      (!b.query_moment.empty() && b.query_moment.size() != static_cast<size_t>(m.layers) *
                                                               m.kv_heads * m.head_dim *
                                                               m.head_dim) ||
      (!b.value_metric.empty() && b.value_metric.size() != static_cast<size_t>(m.layers) *
                                                               m.kv_heads * m.head_dim *
                                                               m.head_dim))
    return Bad(dir, "manifest shape does not match the tensor data");
  b.manifest.fingerprint = BasisFingerprint(b);
  json header;
  const size_t all_u = per_layer * m.layers * 4;
  for (int l = 0; l < m.layers; ++l) {
    const size_t begin = l * per_layer * 4;
    header[absl::StrCat("layer.", l, ".u")] = {{"dtype", "F32"},
                                               {"shape", {m.kv_heads, m.head_dim, m.rank}},
                                               {"data_offsets", {begin, begin + per_layer * 4}}};
    if (b.oblique())
      header[absl::StrCat("layer.", l, ".encode")] = {
          {"dtype", "F32"},
          {"shape", {m.kv_heads, m.head_dim, m.rank}},
          {"data_offsets", {all_u + begin, all_u + begin + per_layer * 4}}};
  }
  const size_t moment_layer = static_cast<size_t>(m.kv_heads) * m.head_dim * m.head_dim * 4;
  const size_t moment0 = all_u * (b.oblique() ? 2 : 1);
  if (!b.query_moment.empty())
    for (int l = 0; l < m.layers; ++l)
      header[absl::StrCat("layer.", l, ".query_moment")] = {
          {"dtype", "F32"},
          {"shape", {m.kv_heads, m.head_dim, m.head_dim}},
          {"data_offsets", {moment0 + l * moment_layer, moment0 + (l + 1) * moment_layer}}};
  const size_t metric0 = moment0 + b.query_moment.size() * 4;
  if (!b.value_metric.empty())
    for (int l = 0; l < m.layers; ++l)
      header[absl::StrCat("layer.", l, ".value_metric")] = {
          {"dtype", "F32"},
          {"shape", {m.kv_heads, m.head_dim, m.head_dim}},
          {"data_offsets", {metric0 + l * moment_layer, metric0 + (l + 1) * moment_layer}}};
  header["__metadata__"] = {{"format", "kvq-basis"}, {"fingerprint", b.manifest.fingerprint}};
  std::string h = header.dump();
  while (h.size() % 8) h.push_back(' ');
  std::string bytes(8, '\0');
  const uint64_t n = h.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += h;
  bytes.append(reinterpret_cast<const char*>(b.u.data()), b.u.size() * 4);
  if (b.oblique())
    bytes.append(reinterpret_cast<const char*>(b.encode.data()), b.encode.size() * 4);
  bytes.append(reinterpret_cast<const char*>(b.query_moment.data()), b.query_moment.size() * 4);
  bytes.append(reinterpret_cast<const char*>(b.value_metric.data()), b.value_metric.size() * 4);
  RETURN_IF_ERROR(env->CreateDirs(dir));
  json mj = {{"format", "kvq-basis"},
             {"format_version", b.value_metric.empty() ? 1 : 2},  // 2: value metrics
             {"model", m.model},
             {"version", m.version},
             {"layers", m.layers},
             {"kv_heads", m.kv_heads},
             {"q_heads", m.q_heads},
             {"head_dim", m.head_dim},
             {"rank", m.rank},
             {"rope_layout", m.rope_layout},
             {"channel_order", m.channel_order},
             {"kind", m.kind},
             {"calibration_tokens", m.calibration_tokens},
             {"calibration_text", m.calibration_text},
             {"fingerprint", b.manifest.fingerprint}};
  RETURN_IF_ERROR(env->WriteFileAtomic((fs::path(dir) / "basis.safetensors").string(), bytes));
  return env->WriteFileAtomic((fs::path(dir) / "manifest.json").string(), mj.dump(2) + "\n");
}

absl::StatusOr<ModelBasis> ReadBasis(const std::string& dir, Env* env) {
  if (env == nullptr) env = Env::Default();
  auto ms = env->ReadFile((fs::path(dir) / "manifest.json").string(), 1 << 20);
  if (!ms.ok()) return ms.status();
  json mj = json::parse(*ms, nullptr, false);
  if (mj.is_discarded() || !mj.is_object()) return Bad(dir, "manifest.json is not a JSON object");
  ModelBasis b;
  BasisManifest& m = b.manifest;
  for (const char* key : {"model", "version", "layers", "kv_heads", "q_heads", "head_dim", "rank",
                          "rope_layout", "fingerprint"}) {
    if (!mj.contains(key)) return Bad(dir, absl::StrCat("manifest field '", key, "' missing"));
  }
  // Checked reads (a mistyped field is an error naming it, never an exception or a
  // truncated number).
  const JsonFields f(mj, (fs::path(dir) / "manifest.json").string());
  std::string format;
  RETURN_IF_ERROR(f.String("format", &format));
  if (format != "kvq-basis") return Bad(dir, "manifest format must be 'kvq-basis'");
  RETURN_IF_ERROR(ReadModelShape(f, &m));
  RETURN_IF_ERROR(f.Int("rank", &m.rank));
  RETURN_IF_ERROR(f.String("kind", &m.kind));
  RETURN_IF_ERROR(f.Int64("calibration_tokens", &m.calibration_tokens));
  RETURN_IF_ERROR(f.String("calibration_text", &m.calibration_text));
  RETURN_IF_ERROR(f.String("fingerprint", &m.fingerprint));
  if (m.model.empty() || m.model.size() > 128) return Bad(dir, "model name must be 1..128 chars");
  if (m.version < 1) return Bad(dir, absl::StrCat("version = ", m.version, ": must be >= 1"));
  if (m.layers < 1 || m.layers > 1024) return Bad(dir, "layers must be in [1, 1024]");
  if (m.kv_heads < 1 || m.kv_heads > 1024) return Bad(dir, "kv_heads must be in [1, 1024]");
  if (m.q_heads < m.kv_heads || m.q_heads % m.kv_heads)
    return Bad(dir, "q_heads must be a positive multiple of kv_heads");
  if (m.head_dim < 1 || m.head_dim > 512) return Bad(dir, "head_dim must be in [1, 512]");
  if (m.rank < 1 || m.rank > m.head_dim) return Bad(dir, "rank must be in [1, head_dim]");
  if (m.rope_layout != "adjacent_pairs" && m.rope_layout != "halves")
    return Bad(dir, "rope_layout must be 'adjacent_pairs' or 'halves'");
  const size_t per_layer = static_cast<size_t>(m.kv_heads) * m.head_dim * m.rank;
  const size_t u_bytes = per_layer * m.layers * 4;
  const size_t moment_layer = static_cast<size_t>(m.kv_heads) * m.head_dim * m.head_dim;
  const size_t moment_bytes = moment_layer * m.layers * 4;
  auto ts = env->ReadFile((fs::path(dir) / "basis.safetensors").string(),
                          2 * u_bytes + 2 * moment_bytes + (16 << 20));
  if (!ts.ok()) return ts.status();
  const std::string& t = *ts;
  if (t.size() < 8) return Bad(dir, "basis.safetensors truncated (no header length)");
  uint64_t hn;
  std::memcpy(&hn, t.data(), 8);
  if (hn > t.size() - 8) return Bad(dir, "basis.safetensors header length past the end of file");
  json hj = json::parse(t.substr(8, hn), nullptr, false);
  if (hj.is_discarded() || !hj.is_object()) return Bad(dir, "safetensors header is not JSON");
  const size_t data0 = 8 + hn;
  const bool oblique = hj.contains("layer.0.encode");
  const bool has_moment = hj.contains("layer.0.query_moment");
  const bool has_value_metric = hj.contains("layer.0.value_metric");
  const size_t data_bytes = (oblique ? 2 * u_bytes : u_bytes) + (has_moment ? moment_bytes : 0) +
                            (has_value_metric ? moment_bytes : 0);
  if (t.size() - data0 != data_bytes)
    return Bad(dir, absl::StrCat("tensor data is ", t.size() - data0,
                                 " bytes, the manifest "
                                 "implies ",
                                 data_bytes));
  auto read_tensor = [&](const std::string& name, float* to, int64_t cols = 0) -> absl::Status {
    if (!hj.contains(name)) return Bad(dir, absl::StrCat("tensor ", name, " missing"));
    const json& e = hj[name];
    if (cols == 0) cols = m.rank;
    const size_t n = static_cast<size_t>(m.kv_heads) * m.head_dim * cols;
    try {
      if (e.at("dtype").get<std::string>() != "F32") return Bad(dir, name + ": dtype must be F32");
      auto shape = e.at("shape").get<std::vector<int64_t>>();
      if (shape != std::vector<int64_t>{m.kv_heads, m.head_dim, cols})
        return Bad(dir, absl::StrCat(name, ": shape must be [kv_heads, head_dim, ",
                                     cols == m.rank ? "rank" : "head_dim", "] of the manifest"));
      auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != n * 4 || off[1] > data_bytes)
        return Bad(dir, name + ": data_offsets out of range");
      std::memcpy(to, t.data() + data0 + off[0], n * 4);
    } catch (const json::exception& ex) {
      return Bad(dir, absl::StrCat(name, ": ", ex.what()));
    }
    return absl::OkStatus();
  };
  b.u.resize(per_layer * m.layers);
  if (oblique) b.encode.resize(b.u.size());
  for (int l = 0; l < m.layers; ++l) {
    RETURN_IF_ERROR(read_tensor(absl::StrCat("layer.", l, ".u"), b.u.data() + l * per_layer));
    if (oblique)
      RETURN_IF_ERROR(
          read_tensor(absl::StrCat("layer.", l, ".encode"), b.encode.data() + l * per_layer));
  }
  if (has_moment) {
    b.query_moment.resize(moment_layer * m.layers);
    for (int l = 0; l < m.layers; ++l)
      RETURN_IF_ERROR(read_tensor(absl::StrCat("layer.", l, ".query_moment"),
                                  b.query_moment.data() + l * moment_layer, m.head_dim));
  }
  if (has_value_metric) {
    b.value_metric.resize(moment_layer * m.layers);
    for (int l = 0; l < m.layers; ++l)
      RETURN_IF_ERROR(read_tensor(absl::StrCat("layer.", l, ".value_metric"),
                                  b.value_metric.data() + l * moment_layer, m.head_dim));
  }
  if (BasisFingerprint(b) != m.fingerprint)
    return absl::DataLossError(absl::StrCat("basis ", dir, ": fingerprint ", BasisFingerprint(b),
                                            " does not match the manifest's ",
                                            Excerpt(m.fingerprint)));
  if (absl::Status st = CheckBasisTensors(m, b); !st.ok()) return Bad(dir, st.message());
  return b;
}

absl::Status CheckBasisTensors(const BasisManifest& m, const ModelBasis& b) {
  const int d = m.head_dim, R = m.rank;
  const size_t heads = static_cast<size_t>(m.layers) * m.kv_heads;
  const size_t want = heads * d * R;
  if (b.u.size() != want)
    return absl::InvalidArgumentError(absl::StrCat(
        "basis holds ", b.u.size(), " floats; layers*kv_heads*head_dim*rank = ", want));
  if (b.oblique() && b.encode.size() != want)
    return absl::InvalidArgumentError(
        absl::StrCat("encode basis holds ", b.encode.size(), " floats; the basis holds ", want));
  for (const auto& [v, name] :
       {std::pair{&b.query_moment, "query moment"}, std::pair{&b.value_metric, "value metric"}})
    if (!v->empty() && v->size() != heads * d * d)
      return absl::InvalidArgumentError(
          absl::StrCat(name, " holds ", v->size(),
                       " floats; layers*kv_heads*head_dim*head_dim = ", heads * d * d));
  for (const auto& [v, name] :
       {std::pair{&b.u, "basis"}, std::pair{&b.encode, "encode basis"},
        std::pair{&b.query_moment, "query moment"}, std::pair{&b.value_metric, "value metric"}})
    for (size_t i = 0; i < v->size(); ++i)
      if (!std::isfinite((*v)[i]))
        return absl::InvalidArgumentError(absl::StrCat(name, " holds a non-finite value (layer ",
                                                       i / (v->size() / m.layers), ")"));
  for (int l = 0; l < m.layers; ++l)
    for (int h = 0; h < m.kv_heads; ++h) {
      const size_t at = (static_cast<size_t>(l) * m.kv_heads + h) * d * R;
      const float* u = b.u.data() + at;
      const float* a = b.oblique() ? b.encode.data() + at : u;
      for (int i = 0; i < R; ++i)
        for (int j = b.oblique() ? 0 : i; j < R; ++j) {
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double(a[c * R + i]) * u[c * R + j];
          if (std::fabs(dot - (i == j ? 1.0 : 0.0)) > 1e-3)
            return absl::InvalidArgumentError(
                b.oblique() ? absl::StrFormat("layer %d head %d: encode column %d and decode "
                                              "column %d are not biorthogonal (A^T B = %.4g, "
                                              "tolerance 1e-3)",
                                              l, h, i, j, dot)
                            : absl::StrFormat("layer %d head %d: columns %d and %d are not "
                                              "orthonormal (dot %.4g, tolerance 1e-3)",
                                              l, h, i, j, dot));
        }
      for (const auto& [v, name] : {std::pair{&b.query_moment, "query moment"},
                                    std::pair{&b.value_metric, "value metric"}}) {
        if (v->empty()) continue;
        const float* q = v->data() + (static_cast<size_t>(l) * m.kv_heads + h) * d * d;
        double top = 0;
        for (int c = 0; c < d; ++c) {
          if (q[c * d + c] < 0)
            return absl::InvalidArgumentError(
                absl::StrFormat("layer %d head %d: %s diagonal %d is negative (%.4g)", l, h, name,
                                c, q[c * d + c]));
          top = std::max(top, double(q[c * d + c]));
        }
        for (int x = 0; x < d; ++x)
          for (int y = x + 1; y < d; ++y)
            if (std::fabs(double(q[x * d + y]) - q[y * d + x]) > 1e-4 * top + 1e-30)
              return absl::InvalidArgumentError(absl::StrFormat(
                  "layer %d head %d: %s is not symmetric at (%d, %d)", l, h, name, x, y));
      }
    }
  return absl::OkStatus();
}

ModelBasis RandomBasis(const BasisManifest& shape, uint64_t seed) {
  ModelBasis b;
  b.manifest = shape;
  b.manifest.kind = "random";
  const int d = shape.head_dim, r = shape.rank;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  const size_t heads = static_cast<size_t>(shape.layers) * shape.kv_heads;
  b.u.resize(heads * d * r);
  for (size_t h = 0; h < heads; ++h) {
    Eigen::MatrixXd g(d, r);
    for (int a = 0; a < d; ++a)
      for (int j = 0; j < r; ++j) g(a, j) = nd(rng);
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
    Eigen::MatrixXd q = qr.householderQ() * Eigen::MatrixXd::Identity(d, r);
    for (int a = 0; a < d; ++a)
      for (int j = 0; j < r; ++j) b.u[(h * d + a) * r + j] = static_cast<float>(q(a, j));
  }
  b.manifest.fingerprint = BasisFingerprint(b);
  return b;
}

}  // namespace kvq::core
