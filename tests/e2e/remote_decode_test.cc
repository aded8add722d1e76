// End-to-end: the real model (SmolLM2-135M-Instruct Q4_1 GGUF) decodes 2 windows of 128
// tokens token by token through a real kvq-server (in-process, port 0, real gRPC on
// loopback) via the client library, as a serving frontend does: per step and layer, PutBlocks
// of the new token's K/V and one batched Attend (Score for keys-only configs) for both
// windows. Its perplexity must equal the in-process decode-faithful run's to 1e-4 relative.
//
// Needs the model (scripts/fetch-model.sh, or $KVQ_MODEL): without it the test FAILS, unless
// KVQ_ALLOW_NO_MODEL=1 is set by hand, which turns it into a skip.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "gtest/gtest.h"
#include "kvq/client/client.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/perplexity.h"
#include "kvq/frontend/remote_cache.h"
#include "kvq/frontend/remote_eval.h"
#include "tests/e2e/real_model_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::frontend {
namespace {

constexpr int kWindows = 2;
constexpr int kWindowLen = 128;

class RemoteDecode : public RealModelServerTest<SmolLM2File> {
 protected:
  void SetUp() override {
    RealModelServerTest<SmolLM2File>::SetUp();
    if (IsSkipped() || HasFailure()) return;
    ASSERT_GE(ids_->size(), static_cast<size_t>(kWindows * kWindowLen));
  }

  // The in-process decode-faithful run (kvq-eval's default path).
  PerplexityResult InProcess(const EvalConfig& cfg) {
    BasisSet bases;
    bases.query = basis_;
    auto r = EvaluatePerplexity(*model_, *ids_, kWindows, kWindowLen, cfg, &bases);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : PerplexityResult{};
  }
};

// In-process, one token per forward call (as the remote token-by-token run decodes).
double InProcessTokenByToken(const LlamaModel& model, const std::vector<int32_t>& ids,
                             const EvalConfig& cfg, const core::ModelBasis* basis) {
  const LlamaConfig& mc = model.config();
  double nll = 0;
  for (int w = 0; w < kWindows; ++w) {
    core::CodecOptions o = cfg.codec;
    o.head_dim = mc.head_dim;
    auto cache = CodecCache::Create(
        mc.cache_shape(), o, basis,
        {.keys_only = cfg.keys_only, .read = cfg.fused ? CodecRead::kAttend : CodecRead::kDecode});
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return NAN;
    const int32_t* tok = ids.data() + static_cast<size_t>(w) * kWindowLen;
    std::vector<float> logits;
    for (int p = 0; p < kWindowLen - 1; ++p) {
      const bool scored = p >= kWindowLen / 2;
      absl::Status st = model.Forward(tok + p, 1, p, cache->get(), scored ? 0 : 1, &logits);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) return NAN;
      if (scored) nll += TokenNll(logits.data(), mc.vocab, tok[p + 1]);
    }
  }
  return std::exp(nll / (kWindows * (kWindowLen / 2 - 1)));
}

// Decode-faithful chunks through the server: the same K/V bits reach the server's codec as
// the in-process codec's, so the perplexity equals the in-process decode-faithful run's.
// Both configs read attention through the codec's fused attend in-process (the A^2 policy
// always does; "-fused" asks for it), which is what the server's Attend runs.
TEST_F(RemoteDecode, DecodeFaithfulThroughTheServerEqualsInProcess) {
  BasisSet bases;
  bases.query = basis_;
  for (const char* name : {"headq-kv2-a2-g32", "headq-kv2-r4-fused"}) {
    auto cfg = ParseEvalConfig(name);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    const PerplexityResult local = InProcess(*cfg);
    RemoteEvalOptions ro;
    ro.client = client_.get();
    ro.batch = kWindows;
    ro.chunks = true;
    RemoteEvalStats rs;
    auto remote =
        EvaluatePerplexityRemote(*model_, *ids_, kWindows, kWindowLen, *cfg, &bases, ro, &rs);
    ASSERT_TRUE(remote.ok()) << name << ": " << remote.status();
    const double rel = std::abs(remote->ppl - local.ppl) / local.ppl;
    std::printf(
        "%-20s decode-faithful chunks: in-process PPL %.6f, through the server %.6f, "
        "rel diff %.2e\n",
        name, local.ppl, remote->ppl, rel);
    EXPECT_LT(rel, 1e-4) << name;
    EXPECT_EQ(remote->scored_tokens, local.scored_tokens);
    // G = 32, L = 128: chunks [0,31) [31,63) [63,95) [95,127) [127,128), both windows in
    // each call: one Attend carrying the appends per (chunk, layer).
    EXPECT_EQ(rs.rpc.batches, 5 * 30);
    EXPECT_EQ(rs.rpc.items, 2 * 5 * 30);
    EXPECT_EQ(rs.rpc.put_rpcs, 0);
    EXPECT_EQ(rs.rpc.appends_in_attend, rs.rpc.items);
    EXPECT_EQ(rs.rpc.attend_rpcs, rs.rpc.batches);
    auto st = client_->Stats();  // every sequence was deleted after use
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->sequences(), 0);
  }
}

// Token by token, as a serving frontend decodes: per step and layer one PutBlocks message
// with both windows' new K/V and one Attend with both windows' queries (observing: the A^2
// value widths come from the readouts the server saw). Equal to the in-process cache decoded
// the same way. (The gap to the chunked decode-faithful run is float rounding of the forward
// pass over n rows vs one, amplified by the 2-bit and A^2 rounding decisions; printed.)
TEST_F(RemoteDecode, TokenByTokenThroughTheServerEqualsInProcess) {
  BasisSet bases;
  bases.query = basis_;
  const char* name = "headq-kv2-a2-g32";
  auto cfg = ParseEvalConfig(name);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const double local_tbt = InProcessTokenByToken(*model_, *ids_, *cfg, basis_);
  RemoteEvalOptions ro;
  ro.client = client_.get();
  ro.batch = kWindows;
  RemoteEvalStats rs;
  auto remote =
      EvaluatePerplexityRemote(*model_, *ids_, kWindows, kWindowLen, *cfg, &bases, ro, &rs);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const double rel = std::abs(remote->ppl - local_tbt) / local_tbt;
  const PerplexityResult chunked = InProcess(*cfg);
  std::printf(
      "%-20s token by token: in-process PPL %.6f, through the server %.6f, rel diff "
      "%.2e; %.1f decode steps/s, RPC share %.1f%% (PutBlocks %.2fs, Attend %.2fs); "
      "in-process decode-faithful chunks %.6f\n",
      name, local_tbt, remote->ppl, rel, rs.steps_per_second(), 100 * rs.rpc_share(),
      rs.rpc.put_seconds, rs.rpc.read_seconds, chunked.ppl);
  EXPECT_LT(rel, 1e-4);
  EXPECT_EQ(remote->scored_tokens, kWindows * (kWindowLen / 2 - 1));
  EXPECT_EQ(rs.decode_steps, kWindows * (kWindowLen - 1));
  EXPECT_EQ(rs.rpc.batches, static_cast<int64_t>(kWindowLen - 1) * 30);
  EXPECT_EQ(rs.rpc.items, static_cast<int64_t>(kWindows) * (kWindowLen - 1) * 30);
  EXPECT_EQ(rs.rpc.put_rpcs, 0);
  EXPECT_EQ(rs.rpc.appends_in_attend, rs.rpc.items);
  EXPECT_EQ(rs.rpc.attend_rpcs, rs.rpc.batches);
  EXPECT_GT(rs.rpc_share(), 0.0);
  // Sanity: decoding through the server is the same model on the same text.
  EXPECT_LT(std::abs(remote->ppl - chunked.ppl) / chunked.ppl, 0.05);
}

// A prompt's prefill then decoding, as a serving frontend runs them: the prefill chunk's K/V
// go as HeadQ codes encoded in the frontend (client::LayerEncoder), the decode steps as rows.
// The server holds the same blocks as when it encodes every row itself, so the perplexity is
// the same bit for bit, in fewer bytes.
TEST_F(RemoteDecode, PrefillInCodesGivesThePerplexityOfRowsBitForBit) {
  BasisSet bases;
  bases.query = basis_;
  auto cfg = ParseEvalConfig("headq-kv2-r4-fused");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  PerplexityResult ppl[2];
  RemoteEvalStats rs[2];
  for (int codes : {0, 1}) {
    RemoteEvalOptions ro;
    ro.client = client_.get();
    ro.batch = kWindows;
    ro.prefill = true;
    ro.codes = codes;
    auto r = EvaluatePerplexityRemote(*model_, *ids_, kWindows, kWindowLen, *cfg, &bases, ro,
                                      &rs[codes]);
    ASSERT_TRUE(r.ok()) << r.status();
    ppl[codes] = *r;
  }
  std::printf("prefill then decode: PPL %.9f with rows, %.9f with codes; %lld vs %lld bytes sent\n",
              ppl[0].ppl, ppl[1].ppl, static_cast<long long>(rs[0].rpc.bytes_sent),
              static_cast<long long>(rs[1].rpc.bytes_sent));
  EXPECT_EQ(ppl[0].ppl, ppl[1].ppl);
  EXPECT_EQ(rs[0].rpc.appends_in_codes, 0);
  EXPECT_EQ(rs[1].rpc.appends_in_codes, kWindows * 30) << "each window's prefill, every layer";
  EXPECT_LT(rs[1].rpc.bytes_sent, rs[0].rpc.bytes_sent);
}

}  // namespace
}  // namespace kvq::frontend
