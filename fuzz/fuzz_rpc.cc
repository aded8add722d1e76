// Fuzzes every RPC handler of kvq-server in-process: the first byte picks the method (its
// low 7 bits mod 15: RegisterBasis, ListModels, GetModel, PutBlocks, Score, Readout, Attend,
// GetBlocks, DeleteSequence, Stats, Echo, then grpc.health.v1's Check and Watch, whose first
// answer is read before the call is cancelled, then GetBasis, MatchPrefix; its top bit calls as
// tenant "other" instead of the default one), the rest is that method's request, parsed with
// ParseFromArray (an input that does not parse is skipped). PutBlocks, a client stream, takes up to
// four messages: the second byte's low two bits are the count less one, and each message but the
// last has a 2-byte little-endian length before it.
//
// The calls go over real gRPC (127.0.0.1, port 0) to one KvqServer started at the first input
// and kept for the whole run (registry in memory, 2 workers), with a seeded store: model
// "tiny" (2 layers, 1 KV head, 2 query heads, head_dim 64, a rank-8 basis), model "plain" (no
// basis), and sequences s0 (40 tokens on both layers of tiny, fp16, with token ids: the
// prefix index), s1 (33 tokens of layer 0, fp32), s2 (40 tokens of layer 0 with another codec:
// 3-bit keys, A2 values, sinks, a window, rotations) and p0 (plain, 8 tokens of layer 1). After a
// call that may have changed a sequence (PutBlocks, DeleteSequence, an Attend, a Score with an
// append), every sequence the request names is deleted and the seeded ones are put again, so
// each input meets the same store (registrations stay: an input may register new models, but
// never another version of tiny or plain, which would change what the seeds pin).
//
// Checked: the server answers every call (no crash, no hang: a call past its 30 s deadline
// fails the input), with OK or one of the status codes docs/API.md lists for that method or
// for every call; never UNKNOWN, INTERNAL, UNAVAILABLE (the server gone or draining),
// CANCELLED (but for the Watch the harness cancels) or DEADLINE_EXCEEDED. Health answers
// SERVING for the server ("") and kvq.v1.Kvq, NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch)
// for any other name. A batch answered OK has one result per item, each with a
// documented item code.
//
// KVQ_FUZZ_RPC_SEEDS=DIR writes the committed seeds (fuzz/corpus/rpc/) into DIR and exits;
// KVQ_FUZZ_RPC_VERBOSE=1 prints every call's status (and each item's) to stderr.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvq/core/cache.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/encoded_groups.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace {

using grpc::StatusCode;
namespace v1 = kvq::v1;
using kvq::testing::Shape;

enum Method {
  kRegisterBasis,
  kListModels,
  kGetModel,
  kPutBlocks,
  kScore,
  kReadout,
  kAttend,
  kGetBlocks,
  kDeleteSequence,
  kStats,
  kEcho,
  kHealthCheck,
  kHealthWatch,
  kGetBasis,
  kMatchPrefix,
  kMethods
};
const char* const kNames[kMethods] = {"RegisterBasis",  "ListModels", "GetModel",   "PutBlocks",
                                      "Score",          "Readout",    "Attend",     "GetBlocks",
                                      "DeleteSequence", "Stats",      "Echo",       "Health.Check",
                                      "Health.Watch",   "GetBasis",   "MatchPrefix"};

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_rpc: %s\n", what.c_str());
  std::abort();
}

Shape TinyShape() {
  Shape s;
  s.model = "tiny";
  s.layers = 2;
  s.kv_heads = 1;
  s.q_heads = 2;
  s.head_dim = 64;
  s.basis_rank = 8;
  return s;
}

Shape PlainShape() {
  Shape s = TinyShape();
  s.model = "plain";
  s.basis_rank = 0;
  return s;
}

v1::CodecSettings A2Codec() {
  v1::CodecSettings c;
  c.set_key_bits(3);
  c.set_value_policy(v1::CodecSettings::VALUE_POLICY_A2);
  c.set_value_budget(2.5f);
  c.set_sink_tokens(4);
  c.set_window(8);
  c.set_rotate_keys(true);
  c.set_rotate_values(true);
  c.set_fp16_sinks(2);
  return c;
}

// The seeded sequences: the PutBlocks message that creates each.
std::vector<std::pair<std::string, v1::PutBlocksRequest>> SeedPuts() {
  const Shape t = TinyShape();
  const int kv = t.kv_heads, d = t.head_dim;
  std::vector<std::pair<std::string, v1::PutBlocksRequest>> out;
  {
    v1::PutBlocksRequest r;
    const auto k = kvq::testing::RandomKV(kv, 40, d, 1), v = kvq::testing::RandomKV(kv, 40, d, 2);
    for (int layer = 0; layer < 2; ++layer) {
      v1::Append a = kvq::testing::MakeAppend("s0", layer, 0, k, v, kv, 40, d, "tiny");
      for (int i = 0; i < 40; ++i) a.add_token_ids(1000 + i);
      *r.add_appends() = a;
    }
    out.emplace_back("s0", r);
  }
  {
    v1::PutBlocksRequest r;
    const auto k = kvq::testing::RandomKV(kv, 33, d, 3), v = kvq::testing::RandomKV(kv, 33, d, 4);
    *r.add_appends() = kvq::testing::MakeAppend("s1", 0, 0, k, v, kv, 33, d, "tiny", /*f16=*/false);
    out.emplace_back("s1", r);
  }
  {
    v1::PutBlocksRequest r;
    const auto k = kvq::testing::RandomKV(kv, 8, d, 5), v = kvq::testing::RandomKV(kv, 8, d, 6);
    *r.add_appends() = kvq::testing::MakeAppend("p0", 1, 0, k, v, kv, 8, d, "plain");
    out.emplace_back("p0", r);
  }
  {
    // Another codec: 3-bit keys, A2 values (with the frontend's probe weights), attention
    // sinks kept at fp16, a recent-token window, both rotations.
    v1::PutBlocksRequest r;
    const auto k = kvq::testing::RandomKV(kv, 40, d, 7), v = kvq::testing::RandomKV(kv, 40, d, 8);
    v1::Append a = kvq::testing::MakeAppend("s2", 0, 0, k, v, kv, 40, d, "tiny");
    *a.mutable_codec() = A2Codec();
    *a.mutable_probe_weights() =
        kvq::testing::TensorF32(std::vector<float>(kv * 40, 0.025f), {kv, 40});
    *r.add_appends() = a;
    out.emplace_back("s2", r);
  }
  return out;
}

// A call's context: a 30 s deadline (a call past it fails the input: a hang), the tenant.
std::unique_ptr<grpc::ClientContext> Ctx(const std::string& tenant) {
  return kvq::testing::Ctx(tenant, "", 30);
}
using kvq::testing::Put;

struct World {
  std::unique_ptr<kvq::server::KvqServer> server;
  std::unique_ptr<v1::Kvq::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
  std::vector<std::pair<std::string, v1::PutBlocksRequest>> seeds;

  // Deletes `id` of `tenant` and, for a seeded sequence of the default tenant, puts it again.
  void Restore(const std::string& tenant, const std::string& id) {
    v1::DeleteSequenceRequest del;
    del.set_sequence_id(id);
    v1::DeleteSequenceResponse dr;
    auto ctx = Ctx(tenant);
    const grpc::Status ds = stub->DeleteSequence(ctx.get(), del, &dr);
    if (!ds.ok() && ds.error_code() != StatusCode::NOT_FOUND &&
        ds.error_code() != StatusCode::INVALID_ARGUMENT) {
      Fail("restoring " + id + ": delete: " + ds.error_message());
    }
    if (!tenant.empty()) return;
    for (const auto& [name, put] : seeds) {
      if (name != id) continue;
      v1::PutBlocksResponse pr;
      const grpc::Status ps = Put(*stub, {put}, &pr);
      if (!ps.ok()) Fail("restoring " + id + ": put: " + ps.error_message());
    }
  }
};

World& TheWorld() {
  static World* w = [] {
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in parsed strings: no log spam
    auto* w = new World();
    kvq::server::ServerOptions o;
    o.grpc_address = "127.0.0.1";
    o.grpc_port = 0;
    o.metrics_port = -1;
    o.registry_dir = "";  // in memory: no files, no fsync per registration
    o.capacity_bytes = int64_t{256} << 20;
    o.workers = 2;
    o.retain_prefixes = false;  // nothing of a deleted sequence outlives it
    o.reflection = false;
    o.shutdown_grace = absl::Seconds(1);
    w->server = std::make_unique<kvq::server::KvqServer>(o);
    if (absl::Status st = w->server->Start(); !st.ok()) Fail("start: " + st.ToString());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(w->server->grpc_port()),
                                             grpc::InsecureChannelCredentials(), args);
    w->stub = v1::Kvq::NewStub(channel);
    w->health = grpc::health::v1::Health::NewStub(channel);
    for (const Shape& s : {TinyShape(), PlainShape()}) {
      v1::RegisterBasisResponse r;
      auto ctx = Ctx("");
      const grpc::Status st =
          w->stub->RegisterBasis(ctx.get(), kvq::testing::MakeRegister(s, 5), &r);
      if (!st.ok()) Fail("register " + s.model + ": " + st.error_message());
    }
    w->seeds = SeedPuts();
    for (const auto& [name, put] : w->seeds) w->Restore("", name);
    return w;
  }();
  return *w;
}

// Codes any call may answer (docs/API.md, "Calls"): auth (off here, so never), a message over
// the size limit or the server overloaded.
bool AnyCall(StatusCode c) {
  return c == StatusCode::OK || c == StatusCode::UNAUTHENTICATED ||
         c == StatusCode::RESOURCE_EXHAUSTED;
}

bool Documented(Method m, StatusCode c) {
  if (AnyCall(c)) return true;
  switch (m) {
    case kRegisterBasis:
      return c == StatusCode::INVALID_ARGUMENT || c == StatusCode::ALREADY_EXISTS ||
             c == StatusCode::PERMISSION_DENIED;
    case kGetModel:
    case kGetBasis:
    case kListModels:
      return c == StatusCode::NOT_FOUND || c == StatusCode::INVALID_ARGUMENT;
    case kPutBlocks:  // DATA_LOSS: an encoded block whose checksum fails
      return c == StatusCode::INVALID_ARGUMENT || c == StatusCode::NOT_FOUND ||
             c == StatusCode::FAILED_PRECONDITION || c == StatusCode::ALREADY_EXISTS ||
             c == StatusCode::DATA_LOSS;
    case kScore:
    case kReadout:
    case kAttend:
      return c == StatusCode::INVALID_ARGUMENT;  // a malformed batch; the rest is per item
    case kGetBlocks:
      return c == StatusCode::NOT_FOUND || c == StatusCode::FAILED_PRECONDITION ||
             c == StatusCode::INVALID_ARGUMENT || c == StatusCode::DATA_LOSS;
    case kDeleteSequence:
      return c == StatusCode::NOT_FOUND || c == StatusCode::INVALID_ARGUMENT;
    case kMatchPrefix:
      return c == StatusCode::NOT_FOUND || c == StatusCode::INVALID_ARGUMENT ||
             c == StatusCode::FAILED_PRECONDITION;
    case kHealthCheck:
      return c == StatusCode::NOT_FOUND;  // another service name
    case kHealthWatch:
      return c == StatusCode::CANCELLED;  // the harness cancels it after the first answer
    default:
      return false;
  }
}

bool DocumentedItem(Method m, int code) {
  const auto c = static_cast<StatusCode>(code);
  if (c == StatusCode::OK || c == StatusCode::INVALID_ARGUMENT || c == StatusCode::NOT_FOUND ||
      c == StatusCode::FAILED_PRECONDITION || c == StatusCode::DATA_LOSS) {
    return true;
  }
  // An item's append (Attend, and Score as in Attend) answers as PutBlocks does.
  return (m == kAttend || m == kScore) &&
         (c == StatusCode::ALREADY_EXISTS || c == StatusCode::RESOURCE_EXHAUSTED);
}

const bool kVerbose = std::getenv("KVQ_FUZZ_RPC_VERBOSE") != nullptr;

void CheckStatus(Method m, const grpc::Status& st) {
  if (kVerbose) {
    std::fprintf(stderr, "fuzz_rpc: %s -> %d %s\n", kNames[m], static_cast<int>(st.error_code()),
                 st.error_message().c_str());
  }
  if (!Documented(m, st.error_code())) {
    Fail(std::string(kNames[m]) + " answered undocumented code " +
         std::to_string(static_cast<int>(st.error_code())) + ": " + st.error_message());
  }
}

template <typename Resp>
void CheckBatch(Method m, const grpc::Status& st, int items, const Resp& resp) {
  CheckStatus(m, st);
  if (!st.ok()) return;
  if (resp.results_size() != items) {
    Fail(std::string(kNames[m]) + ": " + std::to_string(resp.results_size()) + " results for " +
         std::to_string(items) + " items");
  }
  for (const auto& r : resp.results()) {
    if (kVerbose) {
      std::fprintf(stderr, "fuzz_rpc:   item -> %d %s\n", r.status().code(),
                   r.status().message().c_str());
    }
    if (!DocumentedItem(m, r.status().code())) {
      Fail(std::string(kNames[m]) + " item answered undocumented code " +
           std::to_string(r.status().code()) + ": " + r.status().message());
    }
  }
}

template <typename Req>
bool Parse(const uint8_t* data, size_t size, Req* req) {
  return req->ParseFromArray(data, static_cast<int>(size));
}

// The seeds: one valid request per method, most on the seeded sequences.
void WriteSeeds(const std::string& dir) {
  const Shape t = TinyShape();
  const int kv = t.kv_heads, qh = t.q_heads, d = t.head_dim;
  // first: the method, with 0x80 for tenant "other".
  auto write = [&](const std::string& name, int first, const std::string& body) {
    std::ofstream f(dir + "/" + name, std::ios::binary);
    f.put(static_cast<char>(first));
    f << body;
  };
  Shape other = TinyShape();
  other.model = "fuzzmodel";
  other.layers = 1;
  other.basis_rank = 2;
  write("register", kRegisterBasis, kvq::testing::MakeRegister(other, 9, 2).SerializeAsString());
  write("register_tiny_again", kRegisterBasis,
        kvq::testing::MakeRegister(TinyShape(), 5).SerializeAsString());
  write("list_models", kListModels, "");
  v1::GetModelRequest gm;
  gm.set_model("tiny");
  write("get_model", kGetModel, gm.SerializeAsString());
  write("get_basis", kGetBasis, gm.SerializeAsString());
  {
    // Two messages: a new sequence's first 8 tokens with token ids, then the next 2.
    const auto k = kvq::testing::RandomKV(kv, 10, d, 11), v = kvq::testing::RandomKV(kv, 10, d, 12);
    v1::PutBlocksRequest a, b;
    v1::Append first =
        kvq::testing::MakeAppend("fz", 0, 0, kvq::testing::Slice(k, kv, 10, d, 0, 8),
                                 kvq::testing::Slice(v, kv, 10, d, 0, 8), kv, 8, d, "tiny");
    for (int i = 0; i < 8; ++i) first.add_token_ids(1000 + i);
    *a.add_appends() = first;
    *b.add_appends() = kvq::testing::MakeAppend("fz", 0, 8, kvq::testing::Slice(k, kv, 10, d, 8, 2),
                                                kvq::testing::Slice(v, kv, 10, d, 8, 2), kv, 2, d);
    const std::string sa = a.SerializeAsString();
    std::string body(1, '\x01');  // two messages
    body.push_back(static_cast<char>(sa.size() & 0xFF));
    body.push_back(static_cast<char>(sa.size() >> 8));
    write("put_two_messages", kPutBlocks, body + sa + b.SerializeAsString());
    // An attach: s0's first 32 token ids without data.
    v1::PutBlocksRequest at;
    v1::Append* x = at.add_appends();
    x->set_sequence_id("fa");
    x->set_model("tiny");
    for (int i = 0; i < 32; ++i) x->add_token_ids(1000 + i);
    write("put_attach", kPutBlocks, std::string(1, '\0') + at.SerializeAsString());
  }
  const auto q = kvq::testing::RandomQueries(qh, 1, d, 13);
  {
    v1::ScoreRequest r;
    auto* it = r.add_items();
    it->set_sequence_id("s0");
    it->set_layer(1);
    *it->mutable_queries() = kvq::testing::TensorF32(q, {qh, 1, d});
    auto* it2 = r.add_items();
    it2->set_sequence_id("s1");
    it2->set_corrections_only(true);
    *it2->mutable_queries() = kvq::testing::TensorF16(q, {qh, d});
    write("score", kScore, r.SerializeAsString());
  }
  {
    v1::ReadoutRequest r;
    auto* it = r.add_items();
    it->set_sequence_id("s1");
    *it->mutable_weights() =
        kvq::testing::TensorF32(std::vector<float>(qh * 33, 1.0f / 33), {qh, 1, 33});
    auto* it2 = r.add_items();
    it2->set_sequence_id("p0");
    it2->set_layer(1);
    it2->set_weights_are_logits(true);
    it2->set_output_dtype(v1::DTYPE_F16);
    *it2->mutable_weights() = kvq::testing::TensorF32(std::vector<float>(qh * 8, 0.5f), {qh, 1, 8});
    write("readout", kReadout, r.SerializeAsString());
  }
  {
    v1::AttendRequest r;
    auto* it = r.add_items();
    it->set_sequence_id("s0");
    it->set_causal_offset(39);
    it->set_observe(true);
    *it->mutable_queries() = kvq::testing::TensorF16(q, {qh, 1, d});
    const auto k = kvq::testing::RandomKV(kv, 1, d, 14), v = kvq::testing::RandomKV(kv, 1, d, 15);
    *it->mutable_append() = kvq::testing::MakeAppend("s0", 0, 40, k, v, kv, 1, d);
    it->mutable_append()->add_token_ids(1040);
    write("attend_with_append", kAttend, r.SerializeAsString());
  }
  {
    v1::GetBlocksRequest r;
    r.set_sequence_id("s0");
    r.set_max_tokens_per_message(16);
    r.set_from_token(3);
    r.set_to_token(37);
    r.set_dtype(v1::DTYPE_BF16);
    write("get_blocks", kGetBlocks, r.SerializeAsString());
  }
  {
    // s2 (the A2 codec with sinks, window and rotations): scored, attended, read back.
    v1::ScoreRequest sr;
    auto* si = sr.add_items();
    si->set_sequence_id("s2");
    *si->mutable_queries() = kvq::testing::TensorF32(q, {qh, 1, d});
    write("score_s2", kScore, sr.SerializeAsString());
    v1::AttendRequest ar;
    auto* ai = ar.add_items();
    ai->set_sequence_id("s2");
    ai->set_output_dtype(v1::DTYPE_BF16);
    *ai->mutable_queries() = kvq::testing::TensorF32(q, {qh, 1, d});
    const auto k = kvq::testing::RandomKV(kv, 1, d, 16), v = kvq::testing::RandomKV(kv, 1, d, 17);
    *ai->mutable_append() = kvq::testing::MakeAppend("s2", 0, 40, k, v, kv, 1, d);
    *ai->mutable_append()->mutable_probe_weights() = kvq::testing::TensorF32({0.5f}, {kv, 1});
    write("attend_s2_with_append", kAttend, ar.SerializeAsString());
    v1::GetBlocksRequest gr;
    gr.set_sequence_id("s2");
    write("get_blocks_s2", kGetBlocks, gr.SerializeAsString());
    // A new sequence created with that codec (8 tokens: the window only).
    const auto k8 = kvq::testing::RandomKV(kv, 8, d, 18), v8 = kvq::testing::RandomKV(kv, 8, d, 19);
    v1::PutBlocksRequest pr;
    v1::Append* pa = pr.add_appends();
    *pa = kvq::testing::MakeAppend("fc", 1, 0, k8, v8, kv, 8, d, "tiny");
    *pa->mutable_codec() = A2Codec();
    write("put_codec", kPutBlocks, std::string(1, '\0') + pr.SerializeAsString());
  }
  {
    // Codes on the wire: new sequences put as encoded groups (made by core's encoder with tiny's
    // basis, as a client's would be) plus their window rows, under the model's codec and the A2
    // codec (sinks, window, rotations); and GetBlocks in codes.
    const kvq::core::ModelBasis basis = kvq::testing::MakeBasis(t, 5);
    int i = 0;
    for (const bool a2 : {false, true}) {
      kvq::core::CodecOptions codec = kvq::testing::CodecOf(t);
      if (a2) codec = *kvq::wire::MergeCodec(codec, A2Codec(), "codec");
      codec.head_dim = d;
      const std::vector<float> u = kvq::testing::LayerBasis(basis, 0, codec.rank);
      kvq::core::LayerCache cache(codec, kv, u.data());
      const int64_t n = 150;
      const auto k = kvq::testing::RandomKV(kv, n, d, 20 + i),
                 v = kvq::testing::RandomKV(kv, n, d, 30 + i);
      const std::string kb = kvq::testing::ToF16Bytes(k), vb = kvq::testing::ToF16Bytes(v);
      if (!cache
               .Append(
                   kvq::core::TensorView::Contiguous(kb.data(), kvq::core::DType::kF16, {kv, n, d}),
                   kvq::core::TensorView::Contiguous(vb.data(), kvq::core::DType::kF16, {kv, n, d}),
                   0)
               .ok()) {
        std::abort();
      }
      kvq::core::EncodedGroups run;
      if (!cache.ExportGroups(0, cache.encoded_tokens() / codec.key_group, &run).ok()) std::abort();
      run.basis_fingerprint = kvq::core::BasisFingerprint(basis);
      const int64_t E = cache.encoded_tokens();
      v1::PutBlocksRequest pr;
      v1::Append* pa = pr.add_appends();
      *pa = kvq::testing::MakeAppend(
          a2 ? "fe2" : "fe", 0, 0, kvq::testing::Slice(k, kv, n, d, E, n - E),
          kvq::testing::Slice(v, kv, n, d, E, n - E), kv, n - E, d, "tiny");
      if (a2) *pa->mutable_codec() = A2Codec();
      kvq::wire::EncodedToWire(run, kv, d, pa->mutable_encoded());
      write(a2 ? "put_encoded_a2" : "put_encoded", kPutBlocks,
            std::string(1, '\0') + pr.SerializeAsString());
      ++i;
    }
    v1::GetBlocksRequest gc;
    gc.set_sequence_id("s0");
    gc.set_codes(true);
    gc.set_max_block_version(3);
    gc.set_max_tokens_per_message(32);
    write("get_blocks_codes", kGetBlocks, gc.SerializeAsString());
    v1::GetBlocksRequest gc2 = gc;
    gc2.set_sequence_id("s2");
    gc2.set_from_token(5);
    write("get_blocks_codes_s2", kGetBlocks, gc2.SerializeAsString());
  }
  v1::DeleteSequenceRequest del;
  del.set_sequence_id("s1");
  write("delete", kDeleteSequence, del.SerializeAsString());
  {
    // s0's ids (the prefix index holds its whole groups) and the seeded names.
    v1::MatchPrefixRequest mp;
    mp.set_model("tiny");
    for (int i = 0; i < 40; ++i) mp.add_token_ids(1000 + i);
    for (const char* id : {"s0", "s1", "s2", "absent"}) mp.add_sequence_ids(id);
    write("match_prefix", kMatchPrefix, mp.SerializeAsString());
    mp.mutable_codec()->set_key_group(32);
    write("match_prefix_codec", kMatchPrefix | 0x80, mp.SerializeAsString());
  }
  write("stats_other_tenant", kStats | 0x80, "");
  v1::EchoRequest echo;
  echo.set_payload("ping");
  write("echo", kEcho, echo.SerializeAsString());
  grpc::health::v1::HealthCheckRequest hc;
  hc.set_service("kvq.v1.Kvq");
  write("health_check", kHealthCheck, hc.SerializeAsString());
  write("health_watch_all", kHealthWatch, "");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("KVQ_FUZZ_RPC_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Method m = static_cast<Method>((data[0] & 0x7F) % kMethods);
  const std::string tenant = (data[0] & 0x80) ? "other" : "";
  ++data;
  --size;
  World& w = TheWorld();
  v1::Kvq::Stub& stub = *w.stub;
  std::set<std::string> touched;  // sequences to restore after the call
  auto ctx = Ctx(tenant);
  switch (m) {
    case kRegisterBasis: {
      v1::RegisterBasisRequest req;
      if (!Parse(data, size, &req)) return 0;
      // Another version of a seeded model would change what the seeds pin: not here.
      if ((req.info().model() == "tiny" || req.info().model() == "plain") &&
          req.info().version() != 1) {
        return 0;
      }
      v1::RegisterBasisResponse resp;
      CheckStatus(m, stub.RegisterBasis(ctx.get(), req, &resp));
      break;
    }
    case kListModels: {
      v1::ListModelsRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::ListModelsResponse resp;
      CheckStatus(m, stub.ListModels(ctx.get(), req, &resp));
      break;
    }
    case kGetModel: {
      v1::GetModelRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::ModelInfo resp;
      CheckStatus(m, stub.GetModel(ctx.get(), req, &resp));
      break;
    }
    case kGetBasis: {
      v1::GetModelRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::RegisterBasisRequest resp;
      CheckStatus(m, stub.GetBasis(ctx.get(), req, &resp));
      break;
    }
    case kPutBlocks: {
      if (size == 0) return 0;
      const int n = 1 + (data[0] & 3);
      size_t at = 1;
      std::vector<v1::PutBlocksRequest> msgs(n);
      for (int i = 0; i < n; ++i) {
        size_t len = size - at;
        if (i + 1 < n) {
          if (size - at < 2) return 0;
          len = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
          at += 2;
        }
        if (!Parse(data + at, len, &msgs[i])) return 0;
        at += len;
        for (const auto& a : msgs[i].appends()) touched.insert(a.sequence_id());
      }
      ctx.reset();
      v1::PutBlocksResponse resp;
      CheckStatus(m, Put(stub, msgs, &resp, tenant));
      break;
    }
    case kScore: {
      v1::ScoreRequest req;
      if (!Parse(data, size, &req)) return 0;
      for (const auto& it : req.items()) {
        if (it.has_append()) touched.insert({it.sequence_id(), it.append().sequence_id()});
      }
      v1::ScoreResponse resp;
      CheckBatch(m, stub.Score(ctx.get(), req, &resp), req.items_size(), resp);
      break;
    }
    case kReadout: {
      v1::ReadoutRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::ReadoutResponse resp;
      CheckBatch(m, stub.Readout(ctx.get(), req, &resp), req.items_size(), resp);
      break;
    }
    case kAttend: {
      v1::AttendRequest req;
      if (!Parse(data, size, &req)) return 0;
      // observe changes a sequence's statistics too: restore every sequence named.
      for (const auto& it : req.items())
        touched.insert({it.sequence_id(), it.append().sequence_id()});
      v1::AttendResponse resp;
      CheckBatch(m, stub.Attend(ctx.get(), req, &resp), req.items_size(), resp);
      break;
    }
    case kGetBlocks: {
      v1::GetBlocksRequest req;
      if (!Parse(data, size, &req)) return 0;
      auto reader = stub.GetBlocks(ctx.get(), req);
      v1::GetBlocksResponse msg;
      while (reader->Read(&msg)) {
      }
      CheckStatus(m, reader->Finish());
      break;
    }
    case kDeleteSequence: {
      v1::DeleteSequenceRequest req;
      if (!Parse(data, size, &req)) return 0;
      touched.insert(req.sequence_id());
      v1::DeleteSequenceResponse resp;
      CheckStatus(m, stub.DeleteSequence(ctx.get(), req, &resp));
      break;
    }
    case kMatchPrefix: {
      v1::MatchPrefixRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::MatchPrefixResponse resp;
      const grpc::Status st = stub.MatchPrefix(ctx.get(), req, &resp);
      CheckStatus(m, st);
      if (st.ok() && resp.sequence_tokens_size() != req.sequence_ids_size()) {
        Fail("MatchPrefix answered " + std::to_string(resp.sequence_tokens_size()) +
             " lengths for " + std::to_string(req.sequence_ids_size()) + " sequence ids");
      }
      break;
    }
    case kStats: {
      v1::StatsRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::StatsResponse resp;
      CheckStatus(m, stub.Stats(ctx.get(), req, &resp));
      break;
    }
    case kEcho: {
      v1::EchoRequest req;
      if (!Parse(data, size, &req)) return 0;
      v1::EchoResponse resp;
      const grpc::Status st = stub.Echo(ctx.get(), req, &resp);
      CheckStatus(m, st);
      if (st.ok() && resp.payload() != req.payload()) Fail("Echo returned another payload");
      break;
    }
    case kHealthCheck: {
      grpc::health::v1::HealthCheckRequest req;
      if (!Parse(data, size, &req)) return 0;
      grpc::health::v1::HealthCheckResponse resp;
      const grpc::Status st = w.health->Check(ctx.get(), req, &resp);
      CheckStatus(m, st);
      if (st.ok() && resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
        Fail("Health.Check: not SERVING");
      }
      break;
    }
    case kHealthWatch: {
      grpc::health::v1::HealthCheckRequest req;
      if (!Parse(data, size, &req)) return 0;
      auto reader = w.health->Watch(ctx.get(), req);
      grpc::health::v1::HealthCheckResponse resp;
      if (!reader->Read(&resp)) Fail("Health.Watch: no first answer");
      // kvq's own services are SERVING; any other name is SERVICE_UNKNOWN (not an error).
      if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING &&
          resp.status() != grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN) {
        Fail("Health.Watch: first answer " + std::to_string(resp.status()));
      }
      ctx->TryCancel();
      while (reader->Read(&resp)) {
      }
      CheckStatus(m, reader->Finish());
      break;
    }
    default:
      break;
  }
  for (const auto& id : touched) {
    if (!id.empty()) w.Restore(tenant, id);
  }
  return 0;
}
