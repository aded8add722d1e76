// kvq: the command-line client of a kvq deployment (health, stats, models, sequences).
//
// Exit codes (stable, for scripts):
//   0   success
//   1   a local failure: a file could not be read, parsed or written
//   2   usage: unknown command or flag, bad flag value, missing argument
//   3   health: a server answered but is not SERVING
//   10+c  the call failed with gRPC status code c: 13 INVALID_ARGUMENT, 15 NOT_FOUND,
//         24 UNAVAILABLE, 26 UNAUTHENTICATED, ... (the list is in `kvq --help`)
// Errors go to stderr as one line "kvq: <CODE>: <message>"; results go to stdout.
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/registry_entry.h"
#include "client/cli/seq_file.h"
#include "google/protobuf/util/json_util.h"
#include "kvq/client/client.h"
#include "kvq/client/codes.h"
#include "kvq/client/decode_ahead.h"
#include "kvq/client/flags.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/tensor.h"

namespace {

using kvq::client::Client;
using kvq::client::ClientFlags;
using kvq::client::ClientOptions;
using kvq::client::FlagSet;
namespace v1 = kvq::v1;
namespace core = kvq::core;
namespace wire = kvq::wire;
namespace format = kvq::format;

constexpr int kExitOk = 0;
constexpr int kExitLocal = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotServing = 3;
constexpr int kExitRpcBase = 10;

int Fail(int code, const std::string& what, const std::string& message) {
  std::fprintf(stderr, "kvq: %s: %s\n", what.c_str(), message.c_str());
  return code;
}
int Usage(const std::string& message) {
  return Fail(kExitUsage, "USAGE", message + " (see --help)");
}
int RpcFail(const absl::Status& st) {
  const int code = static_cast<int>(st.code());
  return Fail(kExitRpcBase + code, kvq::client::StatusCodeName(code), std::string(st.message()));
}
// Local (file) failures come back from the file helpers as absl statuses too.
int LocalFail(const absl::Status& st) {
  return Fail(kExitLocal, kvq::client::StatusCodeName(static_cast<int>(st.code())),
              std::string(st.message()));
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

const char* kTopHelp =
    "Usage: kvq COMMAND [SUBCOMMAND] [ARGS] [FLAGS]\n"
    "The command-line client of kvq servers.\n\n"
    "Commands:\n"
    "  health                      serving state of every server\n"
    "  stats                       usage of your tenant on every server\n"
    "  models list                 registered models\n"
    "  models show NAME            one model (latest version unless --version)\n"
    "  models register DIR         register what kvq-calibrate wrote (manifest.json +\n"
    "                              basis.safetensors) on every server\n"
    "  seq put ID FILE             append a sequence's K/V from a safetensors file (a whole\n"
    "                              sequence goes as HeadQ codes encoded here where the server\n"
    "                              takes them; --rows: fp16 rows, the server encodes)\n"
    "  seq get ID FILE             write a sequence's K/V (as attention sees them) to a file\n"
    "                              (fetched as codes and decoded here; --rows: decoded rows)\n"
    "  seq delete ID               drop a sequence\n"
    "  seq shard [ID...]           the server each sequence id is sharded to (no call)\n"
    "Run `kvq COMMAND --help` for a command's flags.\n\n"
    "Exit codes: 0 ok; 1 local file error; 2 usage; 3 a server is not SERVING;\n"
    "10+CODE a call failed with gRPC status CODE (11 CANCELLED, 13 INVALID_ARGUMENT,\n"
    "14 DEADLINE_EXCEEDED, 15 NOT_FOUND, 16 ALREADY_EXISTS,\n"
    "18 RESOURCE_EXHAUSTED, 19 FAILED_PRECONDITION, 23 INTERNAL, 24 UNAVAILABLE,\n"
    "25 DATA_LOSS, 26 UNAUTHENTICATED). Errors: one line on stderr, 'kvq: CODE: message'.\n\n"
    "Connection flags (every command):\n";

struct Command {
  std::string name;     // "seq put"
  std::string args;     // "ID FILE"
  std::string summary;  // one paragraph
  int nargs;            // -1: any number
};

const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      {"health", "",
       "Checks grpc.health.v1 on every server; prints 'ADDR SERVING' lines.\n"
       "Exit 0 when all serve, 3 when one answers NOT_SERVING, 10+code when one\n"
       "cannot be reached.",
       0},
      {"stats", "",
       "Prints your tenant's usage (sequences, tokens, bytes, bits per element) and the\n"
       "server totals, for every server. --json: an object, or an array of them (in\n"
       "--server order) when several servers are given.",
       0},
      {"models list", "", "Lists every registered model version (of the first server).", 0},
      {"models show", "NAME", "Prints one model's entry as JSON.", 1},
      {"models register", "DIR",
       "Registers the registry entry in DIR on every server: manifest.json +\n"
       "basis.safetensors as written by kvq-calibrate (or model.json for a model without\n"
       "basis), plus codec.json when present. Registering an identical entry again is OK.",
       1},
      {"seq put", "ID FILE",
       "Appends the K/V in FILE (a safetensors file with layer.{l}.keys / layer.{l}.values,\n"
       "[kv_heads, tokens, head_dim], F16/BF16/F32; see client/cli/seq_file.h) to sequence\n"
       "ID, starting at --start. Creates the sequence with --model (default: the file's\n"
       "'model' metadata). Safe to re-run: identical ranges are accepted as duplicates.",
       2},
      {"seq get", "ID FILE",
       "Writes sequence ID's K/V as attention sees them (keys = base + side-code correction,\n"
       "values decoded) to FILE in the same format.",
       2},
      {"seq delete", "ID", "Drops sequence ID; prints the bytes freed.", 1},
      {"seq shard", "[ID...]",
       "Prints the server each sequence ID (of your tenant: --tenant, else --token, else\n"
       "'default') is sharded to over --server, one address per line, without calling any\n"
       "server. With --router, the x-kvq-route value the proxy routes it by instead. With no\n"
       "ID, reads ids from standard input, one per line.",
       -1},
  };
  return kCommands;
}

// Flags that take a value among the connection flags: to find the command words when they
// come after flags ("kvq --server X health").
const std::set<std::string>& ValueFlags() {
  static const std::set<std::string> kFlags = {
      "server",          "timeout",      "retries",    "tls-ca", "tls-cert", "tls-key",
      "tls-server-name", "token",        "token-file", "tenant", "version",  "basis-version",
      "start",           "chunk-tokens", "dtype",      "layers", "model"};
  return kFlags;
}

struct CommandFlags {
  bool help = false;
  bool json = false;
  int version = 0;
  std::string model;
  int64_t start = 0;
  int chunk_tokens = 1024;
  std::string dtype = "f16";
  std::string layers;
  bool rows = false;  // seq put/get: fp16 rows on the wire instead of HeadQ codes
};

int Health(Client& c) {
  int exit = kExitOk;
  for (const auto& h : c.Health()) {
    if (h.status.ok()) {
      std::printf("%s %s\n", h.server.c_str(), h.serving ? "SERVING" : "NOT_SERVING");
      if (!h.serving && exit == kExitOk) exit = kExitNotServing;
    } else {
      const int code = static_cast<int>(h.status.code());
      std::printf("%s %s\n", h.server.c_str(), kvq::client::StatusCodeName(code).c_str());
      std::fprintf(stderr, "kvq: %s: %s\n", kvq::client::StatusCodeName(code).c_str(),
                   std::string(h.status.message()).c_str());
      if (exit == kExitOk || exit == kExitNotServing) exit = kExitRpcBase + code;
    }
  }
  return exit;
}

int Stats(Client& c, const CommandFlags& f) {
  // --json: one object for one server; with several, an array in --server order.
  std::string json;
  for (int s = 0; s < c.num_shards(); ++s) {
    auto st = c.Stats(s);
    if (!st.ok()) return RpcFail(st.status());
    if (f.json) {
      std::string one = ToJson(*st);
      while (!one.empty() && one.back() == '\n') one.pop_back();
      absl::StrAppend(&json, s == 0 ? "" : ",\n", one);
      if (s + 1 == c.num_shards()) {
        std::printf(c.num_shards() == 1 ? "%s\n" : "[\n%s\n]\n", json.c_str());
      }
      continue;
    }
    std::printf(
        "server %s\n  tenant %s: %lld sequences, %lld tokens, %lld bytes stored (quota %lld), "
        "%lld evictions\n  bits per element: K %.3f, V %.3f\n  prefix index: %lld groups, "
        "%lld bytes (%lld retained), %lld tokens shared\n  server: %lld of %lld bytes "
        "stored, pool %s, backend %s, up %.0f s\n",
        c.server(s).c_str(), st->tenant().c_str(), static_cast<long long>(st->sequences()),
        static_cast<long long>(st->tokens()), static_cast<long long>(st->stored_bytes()),
        static_cast<long long>(st->quota_bytes()), static_cast<long long>(st->evictions()),
        st->k_bits_per_element(), st->v_bits_per_element(),
        static_cast<long long>(st->prefix_blocks()), static_cast<long long>(st->prefix_bytes()),
        static_cast<long long>(st->retained_prefix_bytes()),
        static_cast<long long>(st->shared_tokens()),
        static_cast<long long>(st->server_stored_bytes()),
        static_cast<long long>(st->server_capacity_bytes()), st->memory_pool().c_str(),
        st->compute_backend().c_str(), st->uptime_seconds());
  }
  return kExitOk;
}

int ModelsList(Client& c, const CommandFlags& f) {
  auto r = c.ListModels();
  if (!r.ok()) return RpcFail(r.status());
  if (f.json) {
    std::printf("%s", ToJson(*r).c_str());
    return kExitOk;
  }
  std::printf("%-32s %7s %6s %8s %7s %8s %5s %6s %s\n", "MODEL", "VERSION", "LAYERS", "KV_HEADS",
              "Q_HEADS", "HEAD_DIM", "RANK", "LIVE", "FINGERPRINT");
  for (const v1::ModelInfo& m : r->models()) {
    std::printf("%-32s %7d %6d %8d %7d %8d %5d %6lld %s\n", m.model().c_str(), m.version(),
                m.layers(), m.kv_heads(), m.q_heads(), m.head_dim(), m.basis_rank(),
                static_cast<long long>(m.live_sequences()),
                m.has_basis() ? m.fingerprint().c_str() : "(no basis)");
  }
  return kExitOk;
}

int ModelsShow(Client& c, const std::string& name, const CommandFlags& f) {
  auto r = c.GetModel(name, f.version);
  if (!r.ok()) return RpcFail(r.status());
  std::printf("%s", ToJson(*r).c_str());
  return kExitOk;
}

int ModelsRegister(Client& c, const std::string& dir) {
  auto req = kvq::client::ReadRegistryEntry(dir);
  if (!req.ok()) return LocalFail(req.status());
  auto r = c.RegisterBasis(*req);
  if (!r.ok()) return RpcFail(r.status());
  std::printf("%s %s v%d (%d layers, rank %d, fingerprint %s) on %d server(s)\n",
              r->already_registered() ? "already registered" : "registered",
              r->model().model().c_str(), r->model().version(), r->model().layers(),
              r->model().basis_rank(), r->model().fingerprint().c_str(), c.num_shards());
  return kExitOk;
}

int SeqPut(Client& c, const std::string& id, const std::string& path, const CommandFlags& f) {
  auto file = kvq::client::ReadSeqFile(path);
  if (!file.ok()) return LocalFail(file.status());
  std::string model = f.model;
  if (model.empty() && file->metadata.count("model")) model = file->metadata.at("model");
  if (f.chunk_tokens < 1) return Usage("--chunk-tokens must be >= 1");
  // One message per (layer, chunk): each is applied atomically; a re-run re-sends all.
  std::vector<v1::PutBlocksRequest> msgs;
  // Codes for a whole sequence of a known model (its groups are fewer bytes than its rows),
  // where the server gives the model's basis and takes this client's block-format versions.
  bool in_codes = !f.rows && f.start == 0 && !model.empty();
  std::unique_ptr<kvq::client::ModelCodes> codes;
  if (in_codes) {
    absl::StatusOr<v1::RegisterBasisRequest> basis = c.GetBasis(model, f.version, c.ShardOf(id));
    if (!basis.ok() && basis.status().code() == absl::StatusCode::kNotFound) {
      return RpcFail(basis.status());
    }
    absl::StatusOr<std::unique_ptr<kvq::client::ModelCodes>> made =
        basis.ok() ? kvq::client::ModelCodes::Create(*basis)
                   : absl::StatusOr<std::unique_ptr<kvq::client::ModelCodes>>(basis.status());
    if (made.ok()) {
      codes = std::move(*made);
    } else {
      std::fprintf(stderr, "kvq: sending rows: %s\n", made.status().ToString().c_str());
      in_codes = false;
    }
  }
  // In codes, each layer is encoded when the stream reaches it (PutBlocksStream), so that its
  // encode overlaps the transfer of the layers before.
  core::CodecOptions codec;
  if (in_codes) {
    absl::StatusOr<core::CodecOptions> c0 = codes->CodecOf(v1::CodecSettings());
    if (!c0.ok()) return LocalFail(c0.status());
    codec = *c0;
  }
  size_t next_layer = 0;
  std::vector<v1::Append> encoded;
  size_t taken = 0;
  auto encode_next_layer = [&]() -> absl::Status {
    const size_t l = next_layer++;
    const kvq::client::SeqLayer& L = file->layers[l];
    ASSIGN_OR_RETURN(const core::DType dt, wire::FromProto(L.dtype, "dtype"));
    const auto view = [&](const std::string& b) {
      return core::TensorView::Contiguous(b.data(), dt, {L.kv_heads, L.tokens, L.head_dim});
    };
    ASSIGN_OR_RETURN(encoded, codes->EncodeLayer(id, static_cast<int>(l), codec, view(L.keys),
                                                 view(L.values), f.chunk_tokens));
    taken = 0;
    for (v1::Append& a : encoded) {
      const int64_t n = static_cast<int64_t>(a.encoded().block_bytes_size()) / (2 * L.kv_heads) *
                            codec.key_group +
                        (a.has_keys() ? a.keys().shape(1) : 0);
      for (int64_t t = a.start(); t < a.start() + n && !file->token_ids.empty(); ++t) {
        a.add_token_ids(file->token_ids[t]);
      }
    }
    return absl::OkStatus();
  };
  bool first = true;
  for (size_t l = 0; l < file->layers.size() && !in_codes; ++l) {
    const kvq::client::SeqLayer& L = file->layers[l];
    const size_t esize = L.dtype == v1::DTYPE_F32 ? 4 : 2;
    const size_t row = static_cast<size_t>(L.head_dim) * esize;
    for (int64_t t0 = 0; t0 < L.tokens; t0 += f.chunk_tokens) {
      const int64_t n = std::min<int64_t>(f.chunk_tokens, L.tokens - t0);
      v1::Append* a = msgs.emplace_back().add_appends();
      a->set_sequence_id(id);
      a->set_layer(static_cast<int>(l));
      a->set_start(f.start + t0);
      if (first && !model.empty()) {
        a->set_model(model);
        a->set_basis_version(f.version);
      }
      first = false;
      for (int64_t t = t0; t < t0 + n && !file->token_ids.empty(); ++t) {
        a->add_token_ids(file->token_ids[t]);
      }
      for (auto [src, dst] :
           {std::pair{&L.keys, a->mutable_keys()}, std::pair{&L.values, a->mutable_values()}}) {
        dst->set_dtype(L.dtype);
        for (int64_t d : {L.kv_heads, n, L.head_dim}) dst->add_shape(d);
        std::string* out = dst->mutable_data();
        out->reserve(static_cast<size_t>(L.kv_heads * n) * row);
        for (int64_t h = 0; h < L.kv_heads; ++h) {
          out->append(*src, (static_cast<size_t>(h * L.tokens + t0)) * row, n * row);
        }
      }
    }
  }
  size_t sent = 0, next_msg = 0;
  absl::Status local;  // a file that cannot be encoded: a local error, not the server's
  auto next = [&](v1::PutBlocksRequest* m) -> absl::StatusOr<bool> {
    if (!in_codes) {
      if (next_msg == msgs.size()) return false;
      *m = std::move(msgs[next_msg++]);
    } else {
      while (taken == encoded.size()) {
        if (next_layer == file->layers.size()) return false;
        local = encode_next_layer();
        if (!local.ok()) return local;
      }
      *m->add_appends() = std::move(encoded[taken++]);
    }
    sent += m->ByteSizeLong();
    return true;
  };
  auto r = c.PutBlocksStream(id, next);
  if (!local.ok()) return LocalFail(local);
  if (!r.ok()) return RpcFail(r.status());
  std::printf(
      "%s: %lld tokens written, %lld duplicate, %lld shared, %zu layers on %s, %zu bytes "
      "sent as %s\n",
      id.c_str(), static_cast<long long>(r->tokens_written()),
      static_cast<long long>(r->tokens_duplicate()), static_cast<long long>(r->tokens_shared()),
      file->layers.size(), c.server(c.ShardOf(id)).c_str(), sent, in_codes ? "codes" : "rows");
  return kExitOk;
}

int SeqGet(Client& c, const std::string& id, const std::string& path, const CommandFlags& f) {
  v1::GetBlocksRequest req;
  req.set_sequence_id(id);
  req.set_basis_version(f.version);
  if (f.dtype == "f16") {
    req.set_dtype(v1::DTYPE_F16);
  } else if (f.dtype == "bf16") {
    req.set_dtype(v1::DTYPE_BF16);
  } else if (f.dtype == "f32") {
    req.set_dtype(v1::DTYPE_F32);
  } else {
    return Usage("--dtype must be f16, bf16 or f32");
  }
  for (absl::string_view s : absl::StrSplit(f.layers, ',', absl::SkipEmpty())) {
    int l = 0;
    if (!absl::SimpleAtoi(s, &l) || l < 0) return Usage("--layers must be a list like 0,1,2");
    req.add_layers(l);
  }
  // Chunks of a layer arrive in order; each carries [kv_heads, n, head_dim] (in codes: decoded
  // here, one message ahead of the stream on a thread of its own, from its groups and rows; a
  // server that answers rows is read as rows).
  std::map<int, std::vector<v1::GetBlocksResponse>> chunks;
  std::mutex chunks_mu;  // rows land on the stream's thread, decoded codes on the decoder's
  int basis_version = 0;
  size_t received = 0;
  if (!f.rows) {
    req.set_codes(true);
    req.set_max_block_version(format::kMaxVersion);
  }
  bool in_codes = false;
  std::unique_ptr<kvq::client::ModelCodes> codes;
  std::unique_ptr<kvq::client::DecodeAhead> ahead;
  absl::Status decoded;
  absl::Status st = c.GetBlocks(req, [&](const v1::GetBlocksResponse& r) {
    received += r.ByteSizeLong();
    basis_version = r.basis_version();
    if (ahead == nullptr && !r.has_codec()) {  // rows
      std::lock_guard<std::mutex> l(chunks_mu);
      chunks[r.layer()].push_back(r);
      return true;
    }
    in_codes = true;
    if (ahead == nullptr) {
      decoded = [&]() -> absl::Status {
        absl::StatusOr<v1::RegisterBasisRequest> basis =
            c.GetBasis(r.model(), r.basis_version(), c.ShardOf(id));
        if (!basis.ok()) return basis.status();
        ASSIGN_OR_RETURN(codes, kvq::client::ModelCodes::Create(*basis));
        ASSIGN_OR_RETURN(const core::DType dt, wire::FromProto(req.dtype(), "dtype"));
        const int64_t kv = codes->entry().manifest.kv_heads, d = codes->entry().manifest.head_dim;
        ahead = std::make_unique<kvq::client::DecodeAhead>(
            *codes, dt,
            [&, kv, d, dt](const v1::GetBlocksResponse& msg, std::vector<uint8_t>& k,
                           std::vector<uint8_t>& v) {
              v1::GetBlocksResponse out;
              out.set_layer(msg.layer());
              for (auto [rows, t] :
                   {std::pair{&k, out.mutable_keys()}, std::pair{&v, out.mutable_values()}}) {
                t->set_dtype(req.dtype());
                for (int64_t dim :
                     {kv, static_cast<int64_t>(rows->size() / core::DTypeSize(dt) / (kv * d)), d})
                  t->add_shape(dim);
                t->set_data(rows->data(), rows->size());
              }
              std::lock_guard<std::mutex> l(chunks_mu);
              chunks[msg.layer()].push_back(std::move(out));
              return absl::OkStatus();
            });
        return absl::OkStatus();
      }();
      if (!decoded.ok()) return false;
    }
    if (!ahead->InCodes(r)) {  // a rows message after codes: not what a server sends
      decoded = absl::DataLossError("GetBlocks: a message in rows inside a stream in codes");
      return false;
    }
    return ahead->Push(r);
  });
  if (ahead != nullptr) decoded.Update(ahead->Finish());
  if (!st.ok()) return RpcFail(st);
  if (!decoded.ok()) return LocalFail(decoded);
  kvq::client::SeqFile file;
  file.metadata["sequence_id"] = id;
  file.metadata["basis_version"] = absl::StrCat(basis_version);
  int expect = 0;
  for (auto& [layer, parts] : chunks) {
    if (req.layers_size() == 0 && layer != expect) {
      return Fail(kExitRpcBase + 13, "INTERNAL", absl::StrCat("layer ", expect, " missing"));
    }
    ++expect;
    kvq::client::SeqLayer L;
    L.dtype = req.dtype();
    L.kv_heads = parts[0].keys().shape(0);
    L.head_dim = parts[0].keys().shape(2);
    for (const auto& p : parts) L.tokens += p.keys().shape(1);
    const size_t row = static_cast<size_t>(L.head_dim) * (L.dtype == v1::DTYPE_F32 ? 4 : 2);
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      for (const auto& p : parts) {
        const size_t n = static_cast<size_t>(p.keys().shape(1)) * row;
        L.keys.append(p.keys().data(), h * n, n);
        L.values.append(p.values().data(), h * n, n);
      }
    }
    file.layers.push_back(std::move(L));
  }
  if (file.layers.empty()) {
    return Fail(kExitRpcBase + 5, "NOT_FOUND", absl::StrCat("sequence ", id, " has no tokens"));
  }
  if (absl::Status w = kvq::client::WriteSeqFile(path, file); !w.ok()) return LocalFail(w);
  std::printf("%s: %zu layers, %lld tokens in layer 0, written to %s, %zu bytes received as %s\n",
              id.c_str(), file.layers.size(), static_cast<long long>(file.layers[0].tokens),
              path.c_str(), received, in_codes ? "codes" : "rows");
  return kExitOk;
}

int SeqShard(Client& c, const std::vector<std::string>& ids) {
  auto print = [&c](const std::string& id) {
    if (c.options().router) {
      std::printf("%s\n", c.RouteKey(id).c_str());
    } else {
      std::printf("%s\n", c.server(c.ShardOf(id)).c_str());
    }
  };
  if (!ids.empty()) {
    for (const std::string& id : ids) print(id);
    return kExitOk;
  }
  std::string line;
  for (int ch; (ch = std::getchar()) != EOF;) {
    if (ch != '\n') {
      line.push_back(static_cast<char>(ch));
      continue;
    }
    print(line);
    line.clear();
  }
  if (!line.empty()) print(line);
  return kExitOk;
}

int SeqDelete(Client& c, const std::string& id) {
  auto r = c.DeleteSequence(id);
  if (!r.ok()) return RpcFail(r.status());
  std::printf("%s: deleted, %lld bytes freed\n", id.c_str(),
              static_cast<long long>(r->bytes_freed()));
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  // The command words: the first one or two arguments that are not flags or flag values.
  std::vector<std::string> words;
  for (int i = 1; i < argc && words.size() < 2; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      if (a.find('=') == std::string::npos && ValueFlags().count(a.substr(2))) ++i;
      continue;
    }
    words.push_back(a);
  }
  const Command* cmd = nullptr;
  for (const Command& c : Commands()) {
    if (c.name == (words.empty() ? "" : words[0]) ||
        (words.size() == 2 && c.name == words[0] + " " + words[1])) {
      if (cmd == nullptr || c.name.size() > cmd->name.size()) cmd = &c;
    }
  }

  ClientOptions opts;
  ClientFlags cflags;
  CommandFlags f;
  FlagSet flags;
  flags.AddBool("help", "print help and exit", &f.help);
  kvq::client::AddClientFlags(&flags, &opts, &cflags);
  const std::string name = cmd ? cmd->name : "";
  if (name == "stats" || name == "models list") {
    flags.AddBool("json", "print JSON instead of text", &f.json);
  }
  if (name == "models show" || name == "seq put" || name == "seq get") {
    flags.Add(name == "models show" ? "version" : "basis-version", "N",
              name == "seq put" ? "basis version for a new sequence (default 0: the latest)"
                                : "basis version (default 0: the latest / the sequence's own)",
              [&f](const std::string& v) {
                return kvq::client::ParseIntFlag(v, &f.version) && f.version >= 0;
              });
  }
  if (name == "seq put") {
    flags.Add("model", "NAME", "model of a new sequence (default: the file's metadata)",
              [&f](const std::string& v) { return f.model = v, true; });
    flags.Add("start", "N", "position of the file's first token (default 0)",
              [&f](const std::string& v) {
                return kvq::client::ParseInt64Flag(v, &f.start) && f.start >= 0;
              });
    flags.Add("chunk-tokens", "N", "tokens per layer per message (default 1024)",
              [&f](const std::string& v) { return kvq::client::ParseIntFlag(v, &f.chunk_tokens); });
  }
  if (name == "seq put" || name == "seq get") {
    flags.AddBool("rows",
                  name == "seq put" ? "send fp16 rows (the server encodes) instead of HeadQ codes"
                                    : "fetch rows the server decoded instead of HeadQ codes",
                  &f.rows);
  }
  if (name == "seq get") {
    flags.Add("dtype", "f16|bf16|f32", "dtype written (default f16)",
              [&f](const std::string& v) { return f.dtype = v, true; });
    flags.Add("layers", "LIST", "layers to fetch, e.g. 0,1 (default all)",
              [&f](const std::string& v) { return f.layers = v, true; });
  }
  std::vector<std::string> pos;
  absl::Status parsed = flags.Parse(argc, argv, 1, &pos);
  if (f.help || words.empty() || (words.size() == 1 && words[0] == "help")) {
    if (cmd == nullptr && !words.empty() && words[0] != "help" && words[0] != "models" &&
        words[0] != "seq") {
      return Usage(absl::StrCat("unknown command '", words[0], "'"));
    }
    if (cmd == nullptr) {
      std::printf("%s%s", kTopHelp, flags.Help().c_str());
      if (!words.empty() && (words[0] == "models" || words[0] == "seq")) {
        std::printf("\nSubcommands of %s:\n", words[0].c_str());
        for (const Command& c : Commands()) {
          if (c.name.rfind(words[0] + " ", 0) == 0) {
            std::printf("  kvq %s %s\n", c.name.c_str(), c.args.c_str());
          }
        }
      }
      return words.empty() && !f.help ? kExitUsage : kExitOk;
    }
    std::printf("Usage: kvq %s%s%s [FLAGS]\n%s\n\nFlags:\n%s", cmd->name.c_str(),
                cmd->args.empty() ? "" : " ", cmd->args.c_str(), cmd->summary.c_str(),
                flags.Help().c_str());
    return kExitOk;
  }
  if (cmd == nullptr && (words[0] == "models" || words[0] == "seq")) {
    return Usage(
        absl::StrCat("kvq ", words[0], " needs a subcommand: ",
                     words[0] == "models" ? "list, show, register" : "put, get, delete, shard"));
  }
  if (cmd == nullptr) {
    return Usage(absl::StrCat("unknown command '", absl::StrJoin(words, " "), "'"));
  }
  if (!parsed.ok()) return Usage(std::string(parsed.message()));
  const size_t nwords = std::count(cmd->name.begin(), cmd->name.end(), ' ') + 1;
  std::vector<std::string> args(pos.begin() + nwords, pos.end());
  if (cmd->nargs >= 0 && static_cast<int>(args.size()) != cmd->nargs) {
    return Usage(absl::StrCat("kvq ", cmd->name, " takes ", cmd->nargs == 0 ? "no" : cmd->args,
                              cmd->nargs == 0 ? " arguments" : "", "; got ", args.size(),
                              " argument(s)"));
  }
  if (absl::Status st = kvq::client::ResolveClientFlags(cflags, &opts); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  auto client = Client::Create(opts);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  Client& c = **client;
  if (name == "health") return Health(c);
  if (name == "stats") return Stats(c, f);
  if (name == "models list") return ModelsList(c, f);
  if (name == "models show") return ModelsShow(c, args[0], f);
  if (name == "models register") return ModelsRegister(c, args[0]);
  if (name == "seq put") return SeqPut(c, args[0], args[1], f);
  if (name == "seq get") return SeqGet(c, args[0], args[1], f);
  if (name == "seq delete") return SeqDelete(c, args[0]);
  if (name == "seq shard") return SeqShard(c, args);
  return Usage("unreachable");
}
