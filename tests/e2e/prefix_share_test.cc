// End-to-end prefix sharing with the real model (SmolLM2-135M-Instruct Q4_1 GGUF) through a
// real kvq-server (in-process, port 0, real gRPC on loopback) via the client library.
//
// Request A prefills a 256-token prompt P of wiki text plus its own 32-token continuation,
// sending token ids (RemoteCache share). Request B has the same P and another continuation:
// it attaches P from the tenant's prefix index (no data) and runs the forward pass only over
// its continuation, whose attention reads the attached groups through the server. B's logits
// over its continuation must equal, bit for bit, B's logits when it prefills everything
// itself through the server (no ids, no sharing) in the same decode-faithful chunks; Stats
// must show P stored once.
//
// Needs the model (scripts/fetch-model.sh, or $KVQ_MODEL): without it the test FAILS, unless
// KVQ_ALLOW_NO_MODEL=1 is set by hand, which turns it into a skip.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "kvq/client/client.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/remote_cache.h"
#include "kvq/frontend/remote_eval.h"
#include "tests/e2e/real_model_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::frontend {
namespace {

constexpr int kLayers = 30;   // SmolLM2-135M
constexpr int kPrompt = 256;  // |P|: 8 whole groups of G = 32
constexpr int kNew = 32;      // each request's own continuation

class PrefixShare : public RealModelServerTest<SmolLM2File> {
 protected:
  void SetUp() override {
    RealModelServerTest<SmolLM2File>::SetUp();
    if (IsSkipped() || HasFailure()) return;
    ASSERT_GE(ids_->size(), 2048u);
  }

  // A cache for `config` on the server (the basis registered once per test).
  std::unique_ptr<RemoteCache> Cache(const std::string& id, const EvalConfig& config, bool share) {
    if (model_entry_.model.empty()) {
      auto rm = RegisterRemoteModel(*client_, model_->config().cache_shape(), basis_);
      EXPECT_TRUE(rm.ok()) << rm.status();
      if (!rm.ok()) return nullptr;
      model_entry_ = *rm;
    }
    RemoteCache::Options o;
    o.sequence_id = id;
    o.model = model_entry_;
    o.codec = config.codec;
    o.codec.head_dim = model_->config().head_dim;
    o.share = share;
    auto c = RemoteCache::Create(client_.get(), nullptr, model_->config().cache_shape(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // One request: a fresh sequence prefilled through the server (PrefillRemote), logits of
  // its continuation; the sequence stays alive in `cache`.
  struct Prefilled {
    std::unique_ptr<RemoteCache> cache;
    std::vector<float> logits;
    int64_t attached = -1;
  };
  Prefilled Prefill(const std::string& id, const EvalConfig& config,
                    const std::vector<int32_t>& tokens, bool share) {
    Prefilled p;
    p.cache = Cache(id, config, share);
    if (!p.cache) return p;
    auto r = PrefillRemote(*model_, p.cache.get(), tokens.data(), static_cast<int>(tokens.size()),
                           kPrompt, &p.logits, /*attach=*/share);
    EXPECT_TRUE(r.ok()) << id << ": " << r.status();
    if (r.ok()) p.attached = r->attached;
    return p;
  }

  static double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
    double d = a.size() == b.size() ? 0 : INFINITY;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
      d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    return d;
  }

  v1::StatsResponse Stats() {
    auto s = client_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::StatsResponse{};
  }

  // P followed by the continuation that starts at `from` in the text.
  static std::vector<int32_t> Request(int from) {
    std::vector<int32_t> r(ids_->begin(), ids_->begin() + kPrompt);
    r.insert(r.end(), ids_->begin() + from, ids_->begin() + from + kNew);
    return r;
  }

  RemoteModel model_entry_;
};

TEST_F(PrefixShare, AttachedPromptGivesTheSameLogitsAndIsStoredOnce) {
  auto cfg = ParseEvalConfig("headq-kv2");  // rank 4, G = 32, R = 0, uniform 2-bit values
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const int G = cfg->codec.key_group;
  ASSERT_EQ(G, 32);
  const std::vector<int32_t> a_tokens = Request(kPrompt);  // P + its own continuation
  const std::vector<int32_t> b_tokens = Request(1024);     // P + another continuation
  const int n = kPrompt + kNew;
  const int vocab = model_->config().vocab;

  // 1. The reference: B prefills everything itself through the server, no ids, no sharing.
  std::vector<float> ref;
  int64_t bytes_plain = 0;
  {
    Prefilled plain = Prefill("b-plain", *cfg, b_tokens, /*share=*/false);
    ASSERT_NE(plain.cache, nullptr);
    EXPECT_EQ(plain.attached, 0);
    const v1::StatsResponse s = Stats();
    EXPECT_EQ(s.prefix_blocks(), 0);  // no ids: nothing indexed
    bytes_plain = s.stored_bytes();
    ASSERT_TRUE(plain.cache->Finish(true).ok());
    ref = std::move(plain.logits);
  }
  ASSERT_EQ(ref.size(), static_cast<size_t>(kNew) * vocab);
  EXPECT_EQ(Stats().stored_bytes(), 0);

  // 2. A, with ids: nothing to attach yet; its 9 whole groups per layer get indexed.
  Prefilled a = Prefill("a", *cfg, a_tokens, /*share=*/true);
  ASSERT_NE(a.cache, nullptr);
  EXPECT_EQ(a.attached, 0);
  const v1::StatsResponse after_a = Stats();
  const int64_t groups = n / G;  // 9 per layer, every token of A sealed
  EXPECT_EQ(after_a.prefix_blocks(), kLayers * groups);
  ASSERT_GT(after_a.prefix_bytes(), 0);
  ASSERT_EQ(after_a.prefix_bytes() % (kLayers * groups), 0);
  const int64_t group_bytes = after_a.prefix_bytes() / (kLayers * groups);  // uniform policy
  EXPECT_EQ(after_a.shared_tokens(), 0);
  // A holds as many tokens as the plain B in the same codec; the index adds only each
  // group's block offsets (2 x 3 KV heads + 1, 4 bytes each): the tokens' arrival hashes move
  // from the sequence into the index, they are not copied.
  // (Plus A's sealing bookkeeping, the vectors of the blocks it sealed: under 2 KiB a layer,
  // and the index's own per group, counted since it is memory: its map slot, the group's
  // object and heap headers, its retained-set entry: under 768 bytes.)
  const int64_t index_overhead = after_a.stored_bytes() - bytes_plain;
  EXPECT_GE(index_overhead, kLayers * groups * (2 * 3 + 1) * 4);
  EXPECT_LE(index_overhead, kLayers * groups * ((2 * 3 + 1) * 4 + 768) + kLayers * 2048);

  // 3. B, with ids: attaches P (8 groups per layer), computes only its continuation.
  Prefilled b = Prefill("b", *cfg, b_tokens, /*share=*/true);
  ASSERT_NE(b.cache, nullptr);
  EXPECT_EQ(b.attached, kPrompt / G * G);
  const std::vector<float>& got = b.logits;
  const RemoteStats bs = b.cache->batcher().stats();
  EXPECT_EQ(bs.attach_rpcs, 1);
  EXPECT_EQ(bs.tokens_attached, kPrompt);
  // Resumed at 255, the start of the decode-faithful chunk [255,287) that holds the attach
  // point (row 255 recomputed, not re-sent), then [287,288): one PutBlocks + Attend per layer
  // and chunk.
  EXPECT_EQ(bs.batches, 2 * kLayers);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(b.cache->tokens(l), n);

  const v1::StatsResponse after_b = Stats();
  // The server's count of tokens taken from the index: layers x floor(|P| / G) * G.
  EXPECT_EQ(after_b.shared_tokens() - after_a.shared_tokens(), kLayers * (kPrompt / G * G));
  // P is stored once: only B's own last group (its continuation) joins the index.
  EXPECT_EQ(after_b.prefix_blocks() - after_a.prefix_blocks(), kLayers * (n / G - kPrompt / G));
  EXPECT_EQ(after_b.prefix_bytes() - after_a.prefix_bytes(),
            kLayers * (n / G - kPrompt / G) * group_bytes);
  // B adds what A added less P's groups, which it holds without a copy (the arrival hashes
  // of P's tokens are the index's; B keeps only those of its own tokens).
  const int64_t b_bytes = after_b.stored_bytes() - after_a.stored_bytes();
  EXPECT_LE(b_bytes, after_a.stored_bytes() - kLayers * (kPrompt / G) * group_bytes);
  EXPECT_GE(b_bytes,
            after_a.stored_bytes() - kLayers * (kPrompt / G) * group_bytes - kLayers * 2048);
  std::printf(
      "plain B stores %lld bytes, A with ids %lld (index overhead %lld); B attaching P "
      "adds %lld (%.1f%% of plain); one indexed group of one layer is %lld bytes\n",
      static_cast<long long>(bytes_plain), static_cast<long long>(after_a.stored_bytes()),
      static_cast<long long>(index_overhead), static_cast<long long>(b_bytes),
      100.0 * b_bytes / bytes_plain, static_cast<long long>(group_bytes));

  // B's logits over its continuation: bit for bit those of the self-prefilled B.
  ASSERT_EQ(got.size(), ref.size());
  const double max_diff = MaxDiff(got, ref);
  std::printf("B's %d continuation rows x %d logits: max |attached - self-prefilled| = %g\n", kNew,
              vocab, max_diff);
  EXPECT_EQ(std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)), 0)
      << "max |difference| " << max_diff;

  // Both deleted: the groups stay indexed, retained for the next request with P.
  ASSERT_TRUE(a.cache->Finish(true).ok());
  ASSERT_TRUE(b.cache->Finish(true).ok());
  const v1::StatsResponse end = Stats();
  EXPECT_EQ(end.sequences(), 0);
  EXPECT_EQ(end.prefix_bytes(), after_b.prefix_bytes());
  EXPECT_EQ(end.retained_prefix_bytes(), end.prefix_bytes());
}

// The A^2 value policy (per-token value widths from the attention the server observes): a
// shared group keeps the widths of the request that encoded it, which are B's own here (the
// same queries over P observed them), so the logits are again the same bits.
TEST_F(PrefixShare, A2ValuePolicyAttachedGivesTheSameLogits) {
  auto cfg = ParseEvalConfig("headq-kv2-a2-g32");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const std::vector<int32_t> b_tokens = Request(1024);
  Prefilled plain = Prefill("b-plain", *cfg, b_tokens, /*share=*/false);
  Prefilled a = Prefill("a", *cfg, Request(kPrompt), /*share=*/true);
  const int64_t shared_before = Stats().shared_tokens();
  Prefilled b = Prefill("b", *cfg, b_tokens, /*share=*/true);
  EXPECT_EQ(a.attached, 0);
  EXPECT_EQ(b.attached, kPrompt);
  EXPECT_EQ(Stats().shared_tokens() - shared_before, kLayers * kPrompt);
  ASSERT_EQ(b.logits.size(), plain.logits.size());
  const double max_diff = MaxDiff(b.logits, plain.logits);
  std::printf("A^2: max |attached - self-prefilled| = %g\n", max_diff);
  EXPECT_EQ(std::memcmp(b.logits.data(), plain.logits.data(), b.logits.size() * sizeof(float)), 0)
      << "max |difference| " << max_diff;
}

// kvq-eval --kv remote=ADDR,share: the second run over the same text attaches the first half
// of every window (what the first run left retained) and scores the same perplexity.
TEST_F(PrefixShare, SecondEvalRunAttachesWhatTheFirstLeft) {
  auto cfg = ParseEvalConfig("headq-kv2");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  BasisSet bases;
  bases.query = basis_;
  RemoteEvalOptions ro;
  ro.client = client_.get();
  ro.batch = 2;
  ro.chunks = true;
  ro.share = true;
  constexpr int kWindows = 2, kLen = 128;
  RemoteEvalStats first, second;
  ro.sequence_prefix = "run1";
  auto r1 = EvaluatePerplexityRemote(*model_, *ids_, kWindows, kLen, *cfg, &bases, ro, &first);
  ASSERT_TRUE(r1.ok()) << r1.status();
  ro.sequence_prefix = "run2";
  auto r2 = EvaluatePerplexityRemote(*model_, *ids_, kWindows, kLen, *cfg, &bases, ro, &second);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(first.tokens_attached, 0);
  EXPECT_EQ(second.tokens_attached, kWindows * (kLen / 2));  // L/2 = 64: two whole groups
  EXPECT_EQ(second.decode_steps, first.decode_steps - kWindows * (kLen / 2));
  std::printf(
      "eval with share: run 1 PPL %.9f (%lld tokens computed), run 2 PPL %.9f "
      "(%lld attached, %lld computed)\n",
      r1->ppl, static_cast<long long>(first.decode_steps), r2->ppl,
      static_cast<long long>(second.tokens_attached), static_cast<long long>(second.decode_steps));
  EXPECT_EQ(r1->nll_sum, r2->nll_sum);  // bit for bit: same chunks from the attach point on
  EXPECT_EQ(r1->scored_tokens, r2->scored_tokens);
}

}  // namespace
}  // namespace kvq::frontend
