// RemoteCache against the in-process CodecCache on synthetic K/V/Q (no model needed): a
// real kvq-server in-process on port 0, real gRPC on loopback, the client library.
#include "kvq/frontend/remote_cache.h"

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "kvq/client/client.h"
#include "kvq/format/block_format.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/wire/codec_settings.h"
#include "tests/server/test_util.h"

namespace kvq::frontend {
namespace {

constexpr int kTokens = 80;  // two encoded groups of 32 plus an fp16 tail

struct Stream {
  std::vector<float> k, v, q;  // per token: k, v [kv][d]; q [qh][d]
};

Stream MakeStream(const CacheShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Stream st;
  const size_t kv = static_cast<size_t>(kTokens) * s.kv_heads * s.head_dim;
  for (size_t i = 0; i < kv; ++i) {
    const int c = static_cast<int>(i % s.head_dim);
    st.k.push_back(n(rng) * (c % 16 == 3 ? 6.0f : 1.0f));  // a few outlier channels
    st.v.push_back(n(rng));
  }
  for (size_t i = 0; i < static_cast<size_t>(kTokens) * s.q_heads * s.head_dim; ++i)
    st.q.push_back(n(rng));
  return st;
}

class RemoteCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerOptions so;
    so.memory = "host";
    so.workers = 2;
    server_ = std::make_unique<testing::TestServer>(so);
    client::ClientOptions co;
    co.servers = {server_->address()};
    auto c = client::Client::Create(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    basis_ = testing::MakeBasis(TestShape("remote-cache-test"), 7);
    auto m = RegisterRemoteModel(*client_, shape_, &basis_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    EXPECT_EQ(model_.model, "remote-cache-test");
  }

  // The cache's shape as a registered model of that name with a basis of rank 8.
  testing::Shape TestShape(const std::string& model) const {
    testing::Shape ts;
    ts.model = model;
    ts.layers = shape_.layers;
    ts.kv_heads = shape_.kv_heads;
    ts.q_heads = shape_.q_heads;
    ts.head_dim = shape_.head_dim;
    ts.basis_rank = 8;
    return ts;
  }

  core::CodecOptions Codec(bool a2) const {
    core::CodecOptions o;
    o.head_dim = shape_.head_dim;
    o.key_bits = 2;
    o.key_group = 32;
    o.rank = 4;
    o.value_bits = 2;
    o.value_group = 32;
    if (a2) o.value_policy = core::ValuePolicy::kA2;
    return o;
  }

  // Decodes `streams` token by token, one thread per stream through one shared batcher
  // (remote) and sequentially in-process; returns the max |difference| of the outputs.
  double Compare(const core::CodecOptions& o, bool keys_only, int n_streams, RemoteStats* stats) {
    std::vector<Stream> streams;
    for (int i = 0; i < n_streams; ++i) streams.push_back(MakeStream(shape_, 100 + i));
    const int KVH = shape_.kv_heads, QH = shape_.q_heads, D = shape_.head_dim;
    const size_t krow = static_cast<size_t>(KVH) * D, qrow = static_cast<size_t>(QH) * D;
    // In-process reference.
    std::vector<std::vector<float>> ref(n_streams), got(n_streams);
    for (int i = 0; i < n_streams; ++i) {
      auto cc = CodecCache::Create(
          shape_, o, &basis_,
          {.keys_only = keys_only, .read = keys_only ? CodecRead::kDecode : CodecRead::kAttend});
      EXPECT_TRUE(cc.ok()) << cc.status();
      if (!cc.ok()) return INFINITY;
      std::vector<float> out(qrow);
      for (int t = 0; t < kTokens; ++t)
        for (int l = 0; l < shape_.layers; ++l) {
          EXPECT_TRUE((*cc)
                          ->AppendAndAttend(l, &streams[i].k[t * krow], &streams[i].v[t * krow], t,
                                            1, &streams[i].q[t * qrow], out.data())
                          .ok());
          ref[i].insert(ref[i].end(), out.begin(), out.end());
        }
    }
    RemoteBatcher batcher(client_.get());
    std::vector<std::unique_ptr<RemoteCache>> caches;
    for (int i = 0; i < n_streams; ++i) {
      RemoteCache::Options ro;
      ro.sequence_id =
          "s" + std::to_string(i) + (keys_only ? "k" : "") + (o.per_token_value_bits() ? "a" : "u");
      ro.model = model_;
      ro.codec = o;
      ro.keys_only = keys_only;
      auto rc = RemoteCache::Create(client_.get(), &batcher, shape_, ro);
      EXPECT_TRUE(rc.ok()) << rc.status();
      if (!rc.ok()) return INFINITY;
      caches.push_back(std::move(*rc));
    }
    std::vector<absl::Status> status(n_streams);
    auto run = [&](int i) {
      std::vector<float> out(qrow);
      for (int t = 0; t < kTokens && status[i].ok(); ++t)
        for (int l = 0; l < shape_.layers && status[i].ok(); ++l) {
          status[i] =
              caches[i]->AppendAndAttend(l, &streams[i].k[t * krow], &streams[i].v[t * krow], t, 1,
                                         &streams[i].q[t * qrow], out.data());
          got[i].insert(got[i].end(), out.begin(), out.end());
        }
      caches[i]->Finish(/*delete_sequence=*/false).IgnoreError();
    };
    std::vector<std::thread> threads;
    for (int i = 1; i < n_streams; ++i) threads.emplace_back(run, i);
    run(0);
    for (auto& th : threads) th.join();
    double diff = 0;
    for (int i = 0; i < n_streams; ++i) {
      EXPECT_TRUE(status[i].ok()) << status[i];
      EXPECT_EQ(got[i].size(), ref[i].size());
      for (size_t j = 0; j < std::min(got[i].size(), ref[i].size()); ++j)
        diff = std::max(diff, static_cast<double>(std::abs(got[i][j] - ref[i][j])));
      EXPECT_EQ(caches[i]->tokens(0), kTokens);
    }
    if (stats) *stats = batcher.stats();
    return diff;
  }

  // A cache of its own (no shared batcher).
  std::unique_ptr<RemoteCache> Make(const std::string& id, const core::CodecOptions& o, bool share,
                                    bool keys_only = false) {
    RemoteCache::Options ro;
    ro.sequence_id = id;
    ro.model = model_;
    ro.codec = o;
    ro.share = share;
    ro.keys_only = keys_only;
    auto rc = RemoteCache::Create(client_.get(), nullptr, shape_, ro);
    EXPECT_TRUE(rc.ok()) << rc.status();
    return rc.ok() ? std::move(*rc) : nullptr;
  }

  CacheShape shape_{2, 4, 2, 64};
  core::ModelBasis basis_;
  RemoteModel model_;
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(RemoteCacheTest, AttendMatchesTheInProcessFusedCodecAndBatchesAcrossSequences) {
  RemoteStats st;
  // The server runs the same codec and kernels as the in-process fused path: equal outputs.
  EXPECT_LE(Compare(Codec(false), false, 3, &st), 1e-6);
  EXPECT_EQ(st.batches, kTokens * 2);  // one Attend carrying the appends per (token, layer)
  EXPECT_EQ(st.items, 3 * kTokens * 2);
  EXPECT_EQ(st.put_rpcs, 0);
  EXPECT_EQ(st.appends_in_attend, st.items);
  EXPECT_EQ(st.attend_rpcs, st.batches);
  EXPECT_EQ(st.score_rpcs, 0);
}

// The lever codec over an oblique basis with query moments, as kvq-eval --kv remote runs an
// "-obl" config with rotation and metric rounding: RegisterRemoteModel sends the encode basis
// and the moments, CodecToWire the switches, so the server encodes what the in-process cache
// does (before, the encode basis was dropped and the side coefficients were U^T e).
TEST_F(RemoteCacheTest, LeverCodecOverAnObliqueBasisMatchesInProcess) {
  basis_ = testing::MakeLeverBasis(TestShape("remote-cache-levers"), 9);
  auto m = RegisterRemoteModel(*client_, shape_, &basis_);
  ASSERT_TRUE(m.ok()) << m.status();
  model_ = *m;
  core::CodecOptions o = Codec(false);
  o.rotate_keys = true;
  o.rotate_values = true;
  o.metric_rounding = true;
  EXPECT_LE(Compare(o, false, 2, nullptr), 1e-6);
}

// fp16 sinks over the wire: the server keeps the first positions exact as the in-process
// codec does, on the uniform and the A^2 value policies.
TEST_F(RemoteCacheTest, Fp16SinksMatchInProcess) {
  for (bool a2 : {false, true}) {
    core::CodecOptions o = Codec(a2);
    o.fp16_sinks = 3;
    EXPECT_LE(Compare(o, false, 2, nullptr), 1e-6) << "a2=" << a2;
  }
}

TEST_F(RemoteCacheTest, A2ValuePolicyObservesThroughAttend) {
  RemoteStats st;
  EXPECT_LE(Compare(Codec(true), false, 2, &st), 1e-6);
  EXPECT_EQ(st.items, 2 * kTokens * 2);
}

TEST_F(RemoteCacheTest, KeysOnlyScoresRemotelyAndReadsOutLocally) {
  RemoteStats st;
  // Server Score (fused base + side code) vs in-process scores over decoded keys: the same
  // numbers up to float summation order and, where the CPU has AVX512-VNNI, the fused path's
  // int16 rounding of the queries (scores within 5e-4 relative, docs/CODEC.md; 6.1e-4 measured
  // on these outputs, against 2-bit codes that move a logit by 0.1-0.4).
  EXPECT_LE(Compare(Codec(false), true, 2, &st), 1e-3);
  EXPECT_EQ(st.score_rpcs, st.batches);
  EXPECT_EQ(st.attend_rpcs, 0);
  EXPECT_EQ(st.put_rpcs, 0);  // the appends ride in the Score items
  EXPECT_EQ(st.appends_in_attend, st.items);
}

TEST_F(RemoteCacheTest, LeavingReleasesTheOthersAndFinishDeletes) {
  RemoteBatcher batcher(client_.get());
  std::vector<std::unique_ptr<RemoteCache>> caches;
  for (const char* id : {"a", "b"}) {
    RemoteCache::Options ro;
    ro.sequence_id = id;
    ro.model = model_;
    ro.codec = Codec(false);
    auto rc = RemoteCache::Create(client_.get(), &batcher, shape_, ro);
    ASSERT_TRUE(rc.ok()) << rc.status();
    caches.push_back(std::move(*rc));
  }
  Stream s = MakeStream(shape_, 1);
  std::vector<float> out(static_cast<size_t>(shape_.q_heads) * shape_.head_dim);
  // "b" leaves from another thread while "a" is parked waiting for it (or before): "a"'s
  // request must still be sent, never hang.
  std::thread t([&] { ASSERT_TRUE(caches[1]->Finish().ok()); });
  ASSERT_TRUE(
      caches[0]->AppendAndAttend(0, s.k.data(), s.v.data(), 0, 1, s.q.data(), out.data()).ok());
  t.join();
  // Positions are checked before anything is sent.
  auto bad = caches[0]->AppendAndAttend(0, s.k.data(), s.v.data(), 5, 1, s.q.data(), out.data());
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences(), 1);
  ASSERT_TRUE(caches[0]->Finish().ok());
  stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences(), 0);
  // A finished cache refuses further appends.
  EXPECT_FALSE(
      caches[0]->AppendAndAttend(0, s.k.data(), s.v.data(), 1, 1, s.q.data(), out.data()).ok());
}

TEST_F(RemoteCacheTest, ServerErrorsReachTheCaller) {
  // A sequence naming an unknown model: NOT_FOUND from PutBlocks, as the cache's status.
  RemoteCache::Options ro;
  ro.sequence_id = "x";
  ro.model = {"no-such-model", 1};
  ro.codec = Codec(false);
  auto rc = RemoteCache::Create(client_.get(), nullptr, shape_, ro);
  ASSERT_TRUE(rc.ok()) << rc.status();
  Stream s = MakeStream(shape_, 2);
  std::vector<float> out(static_cast<size_t>(shape_.q_heads) * shape_.head_dim);
  auto st = (*rc)->AppendAndAttend(0, s.k.data(), s.v.data(), 0, 1, s.q.data(), out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_EQ((*rc)->tokens(0), 0);
  // Registering a different basis under the same name and version is refused.
  // (Column 0 of one head negated: still orthonormal, different contents.)
  core::ModelBasis other = basis_;
  const int R = other.manifest.rank;
  for (int i = 0; i < other.manifest.head_dim; ++i) other.u[i * R] = -other.u[i * R];
  EXPECT_EQ(RegisterRemoteModel(*client_, shape_, &other).status().code(),
            absl::StatusCode::kAlreadyExists);
  // The identical entry again is fine (idempotent).
  EXPECT_TRUE(RegisterRemoteModel(*client_, shape_, &basis_).ok());
}

// Prefix sharing (share): appends carry token ids, AttachPrefix takes the indexed groups of
// every layer or, when the layers disagree, none; a held row is attended, not re-sent.
TEST_F(RemoteCacheTest, ShareSendsIdsAndAttachesEveryLayerAlike) {
  const int KVH = shape_.kv_heads, QH = shape_.q_heads, D = shape_.head_dim;
  const size_t krow = static_cast<size_t>(KVH) * D, qrow = static_cast<size_t>(QH) * D;
  Stream s = MakeStream(shape_, 3);
  std::vector<int32_t> ids(kTokens), other(kTokens);
  for (int t = 0; t < kTokens; ++t) {
    ids[t] = 1000 + t;
    other[t] = 5000 + t;
  }
  auto make = [&](const std::string& id, bool share, bool keys_only = false) {
    return Make(id, Codec(false), share, keys_only);
  };
  auto step = [&](RemoteCache& c, int layer, int t, float* out) {
    return c.AppendAndAttend(layer, &s.k[t * krow], &s.v[t * krow], t, 1, &s.q[t * qrow], out);
  };
  std::vector<float> out(qrow), at63(qrow);
  // Ids are needed before the tokens they name are sent.
  auto p = make("p", true);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(step(*p, 0, 0, out.data()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p->batcher().stats().put_rpcs, 0);
  // "p" decodes 64 tokens with ids: two whole groups per layer indexed.
  p->SetTokenIds(ids.data(), 64);
  for (int t = 0; t < 64; ++t)
    for (int l = 0; l < shape_.layers; ++l) {
      ASSERT_TRUE(step(*p, l, t, out.data()).ok());
      if (t == 63 && l == 0) at63 = out;
    }
  auto st = client_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->prefix_blocks(), shape_.layers * 2);
  // "q" attaches them (every layer, one call), then resumes at 63: that row is held, so the
  // step sends no PutBlocks, and its attention is p's exactly (the same stored groups).
  auto q = make("q", true);
  ASSERT_NE(q, nullptr);
  q->SetTokenIds(ids.data(), kTokens);
  auto got = q->AttachPrefix();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 64);
  for (int l = 0; l < shape_.layers; ++l) EXPECT_EQ(q->tokens(l), 64);
  EXPECT_EQ(q->batcher().stats().attach_rpcs, 1);
  EXPECT_EQ(q->batcher().stats().tokens_attached, 64);
  ASSERT_TRUE(step(*q, 0, 63, out.data()).ok());
  EXPECT_EQ(q->batcher().stats().put_rpcs, 0);
  EXPECT_EQ(out, at63);
  ASSERT_TRUE(step(*q, 1, 63, out.data()).ok());
  EXPECT_EQ(q->batcher().stats().appends_in_attend, 0);  // held rows: nothing sent
  for (int l = 0; l < shape_.layers; ++l) ASSERT_TRUE(step(*q, l, 64, out.data()).ok());
  EXPECT_EQ(q->batcher().stats().put_rpcs, 0);
  EXPECT_EQ(q->batcher().stats().appends_in_attend, shape_.layers);
  EXPECT_EQ(q->tokens(0), 65);
  st = client_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->shared_tokens(), shape_.layers * 64);
  EXPECT_EQ(st->prefix_blocks(), shape_.layers * 2);  // stored once
  // Attach needs an empty sequence, share, and a kv configuration.
  EXPECT_EQ(q->AttachPrefix().status().code(), absl::StatusCode::kFailedPrecondition);
  auto plain = make("plain", false);
  EXPECT_EQ(plain->AttachPrefix().status().code(), absl::StatusCode::kFailedPrecondition);
  auto ko = make("ko", true, /*keys_only=*/true);
  ko->SetTokenIds(ids.data(), kTokens);
  EXPECT_EQ(ko->AttachPrefix().status().code(), absl::StatusCode::kFailedPrecondition);
  // Layers that disagree: only layer 0 of "r0" indexed one group of `other`; "r1" gets 32
  // tokens on layer 0 and none on layer 1, so it drops the sequence and attaches nothing.
  auto r0 = make("r0", true);
  r0->SetTokenIds(other.data(), kTokens);
  for (int t = 0; t < 32; ++t) ASSERT_TRUE(step(*r0, 0, t, out.data()).ok());
  auto r1 = make("r1", true);
  r1->SetTokenIds(other.data(), kTokens);
  got = r1->AttachPrefix();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 0);
  EXPECT_EQ(r1->tokens(0), 0);
  EXPECT_EQ(r1->batcher().stats().attach_rpcs, 1);
  st = client_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sequences(), 3);  // p, q, r0: r1 was dropped
  for (int l = 0; l < shape_.layers; ++l) ASSERT_TRUE(step(*r1, l, 0, out.data()).ok());
  for (auto* c : {p.get(), q.get(), r0.get(), r1.get()}) ASSERT_TRUE(c->Finish().ok());
  st = client_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sequences(), 0);
}

// With an fp16 window (R = 8 here) an attach takes only the groups a sequence holding the
// offered tokens would have encoded itself, so once the attaching sequence holds those tokens
// it reads exactly like the one that appended the same bytes itself. (Found by this test: an
// attach used to take every whole group, reading the window's newest tokens from codes;
// max |difference| 0.495 at the query after the attach.)
TEST_F(RemoteCacheTest, WindowAttachReadsLikeTheSelfAppendedSequence) {
  const int KVH = shape_.kv_heads, QH = shape_.q_heads, D = shape_.head_dim;
  const size_t krow = static_cast<size_t>(KVH) * D, qrow = static_cast<size_t>(QH) * D;
  Stream s = MakeStream(shape_, 3);
  std::vector<int32_t> ids(kTokens);
  for (int t = 0; t < kTokens; ++t) ids[t] = 1000 + t;
  core::CodecOptions o = Codec(false);
  o.window = 8;
  auto make = [&](const std::string& id) { return Make(id, o, /*share=*/true); };
  auto step = [&](RemoteCache& c, int layer, int t, float* out) {
    return c.AppendAndAttend(layer, &s.k[t * krow], &s.v[t * krow], t, 1, &s.q[t * qrow], out);
  };
  std::vector<float> out(qrow), self(qrow);
  auto p = make("p");  // appends all 80 tokens itself, with ids: 2 groups indexed per layer
  ASSERT_NE(p, nullptr);
  p->SetTokenIds(ids.data(), kTokens);
  for (int t = 0; t < kTokens; ++t)
    for (int l = 0; l < shape_.layers; ++l) {
      ASSERT_TRUE(step(*p, l, t, out.data()).ok());
      if (t == 64 && l == 0) self = out;
    }
  auto q = make("q");  // offered the same 64 tokens, attaches what p encoded of them
  ASSERT_NE(q, nullptr);
  q->SetTokenIds(ids.data(), kTokens);
  auto got = q->AttachPrefix(64);
  ASSERT_TRUE(got.ok()) << got.status();
  // (64 - R) / G = 1 whole group: the tokens a sequence of 64 would still hold at arrival
  // precision (the window and the incomplete group) are not taken from the index.
  ASSERT_EQ(*got, 32);
  // The rest of the offered tokens with data, one append per layer, then token 64: the same
  // groups encoded and the same window as p at that count, so the same output bit for bit.
  std::vector<float> rest(32 * qrow);
  for (int l = 0; l < shape_.layers; ++l) {
    ASSERT_TRUE(q->AppendAndAttend(l, &s.k[32 * krow], &s.v[32 * krow], 32, 32, &s.q[32 * qrow],
                                   rest.data())
                    .ok());
  }
  ASSERT_TRUE(step(*q, 0, 64, out.data()).ok());
  EXPECT_EQ(out, self);
}

// Codes on the wire: a sequence appended in chunks of every size (prefill chunks that seal
// groups, decode steps, a chunk within the window) through a cache sending codes and through
// one sending fp16 rows gives the same outputs bit for bit, the server holds the same blocks,
// and the codes take fewer bytes. The A^2 value policy goes as rows.
TEST_F(RemoteCacheTest, CodesOnTheWireHoldWhatRowsHoldInFewerBytes) {
  const int KVH = shape_.kv_heads, QH = shape_.q_heads, D = shape_.head_dim;
  const size_t krow = static_cast<size_t>(KVH) * D, qrow = static_cast<size_t>(QH) * D;
  ASSERT_NE(model_.codes, nullptr) << model_.rows_reason;
  const std::vector<int> chunks = {50, 7, 1, 60, 33, 1, 1, 47};  // 200 tokens
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(200 * krow), v(200 * krow), q(200 * qrow);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = nd(rng);
  core::CodecOptions sinks = Codec(false);
  sinks.fp16_sinks = 3;
  for (const auto& [name, o] : std::vector<std::pair<std::string, core::CodecOptions>>{
           {"uniform", Codec(false)}, {"sinks", sinks}, {"a2", Codec(true)}}) {
    std::vector<float> outs[2];
    RemoteStats st[2];
    for (int codes : {0, 1}) {
      RemoteBatcher batcher(client_.get());
      RemoteCache::Options ro;
      ro.sequence_id = name + (codes ? "-c" : "-r");
      ro.model = model_;
      ro.codec = o;
      ro.codes = codes;
      auto rc = RemoteCache::Create(client_.get(), &batcher, shape_, ro);
      ASSERT_TRUE(rc.ok()) << rc.status();
      int64_t at = 0;
      for (int n : chunks) {
        std::vector<float> out(static_cast<size_t>(n) * qrow);
        for (int l = 0; l < shape_.layers; ++l) {
          ASSERT_TRUE((*rc)
                          ->AppendAndAttend(l, &k[at * krow], &v[at * krow], at, n, &q[at * qrow],
                                            out.data())
                          .ok());
          outs[codes].insert(outs[codes].end(), out.begin(), out.end());
        }
        at += n;
      }
      st[codes] = batcher.stats();
      ASSERT_TRUE((*rc)->Finish(/*delete_sequence=*/false).ok());
    }
    EXPECT_EQ(outs[0], outs[1]) << name;
    // The stored groups, read back in codes, are the same bytes.
    std::string stored[2];
    for (int codes : {0, 1}) {
      v1::GetBlocksRequest req;
      req.set_sequence_id(name + (codes ? "-c" : "-r"));
      req.set_codes(true);
      req.set_max_block_version(format::kMaxVersion);
      ASSERT_TRUE(client_
                      ->GetBlocks(req,
                                  [&](const v1::GetBlocksResponse& r) {
                                    stored[codes] += r.encoded().blocks() + r.keys().data();
                                    return true;
                                  })
                      .ok());
    }
    EXPECT_FALSE(stored[0].empty());
    EXPECT_EQ(stored[0], stored[1]) << name;
    EXPECT_EQ(st[0].appends_in_codes, 0);
    if (o.per_token_value_bits()) {
      EXPECT_EQ(st[1].appends_in_codes, 0) << "a2 goes as rows";
      EXPECT_EQ(st[1].bytes_sent, st[0].bytes_sent);
    } else {
      // The chunks of 50, 60, 33 and 47 complete groups covering new rows; the rest do not.
      EXPECT_EQ(st[1].appends_in_codes, 4 * shape_.layers) << name;
      EXPECT_LT(st[1].bytes_sent, st[0].bytes_sent) << name;
    }
  }
}

}  // namespace
}  // namespace kvq::frontend
