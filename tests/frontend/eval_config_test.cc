// The kvq-eval configuration grammar.
#include "kvq/frontend/eval_config.h"

#include "gtest/gtest.h"
#include "kvq/frontend/codec_search.h"
#include "kvq/frontend/perplexity.h"

namespace kvq::frontend {
namespace {

TEST(EvalConfig, RequiredNamesParse) {
  for (const char* n :
       {"dense", "kivi-k2", "headq-k2-r4", "headq-k2-r1", "headq-k2-r2", "headq-k2-r8",
        "headq-k2-r4-random", "headq-k2-r4-wrongsign", "kivi-kv2", "headq-kv2-a2", "kivi-k3",
        "headq-k3-r4", "kivi-k4", "kivi-kv4", "kivi-k2-g128", "headq-k2-r4-g64-w128-s4",
        "headq-k2-r4-resw", "headq-k2-r4-centred"}) {
    auto c = ParseEvalConfig(n);
    EXPECT_TRUE(c.ok()) << n << ": " << c.status();
  }
}

TEST(EvalConfig, SinkTokensSetTheCodecsFp16Sinks) {
  auto c = ParseEvalConfig("headq-kv2-g128-rotk-mr-sink4");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->codec.fp16_sinks, 4);
  EXPECT_EQ(c->codec.key_group, 128);
  EXPECT_EQ(ParseEvalConfig("headq-kv2").value().codec.fp16_sinks, 0);
  // A codec setting now: every read path takes it, the A^2 policy and the fused attend too.
  for (const char* ok : {"headq-kv2-a2-sink4", "headq-kv2-fused-sink16"})
    EXPECT_TRUE(ParseEvalConfig(ok).ok()) << ok;
  for (const char* bad : {"kivi-kv2-sink0", "kivi-kv2-sink17"})
    EXPECT_FALSE(ParseEvalConfig(bad).ok()) << bad;
}

TEST(EvalConfig, VmrSetsValueMetricRoundingOnKvTargetsOnly) {
  auto c = ParseEvalConfig("headq-kv3-g128-s4-v2-vmr");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->value_metric_rounding);
  EXPECT_FALSE(c->wrong_sign);
  EXPECT_FALSE(c->codec.metric_rounding);
  EXPECT_EQ(c->codec.value_bits, 2);
  EXPECT_FALSE(ParseEvalConfig("headq-kv2-g128-mr").value().value_metric_rounding);
  auto k = ParseEvalConfig("headq-k2-vmr");
  ASSERT_FALSE(k.ok());
  EXPECT_NE(k.status().message().find("vmr rounds values"), std::string::npos) << k.status();
}

TEST(EvalConfig, FieldsFollowTheName) {
  auto c = *ParseEvalConfig("headq-k2-r4-wrongsign");
  EXPECT_TRUE(c.keys_only);
  EXPECT_EQ(c.codec.key_bits, 2);
  EXPECT_EQ(c.codec.rank, 4);
  EXPECT_TRUE(c.wrong_sign);
  EXPECT_FALSE(c.value_metric_rounding);
  EXPECT_EQ(c.codec.key_group, 32);
  auto k = *ParseEvalConfig("kivi-kv3-g64-vg64-w128");
  EXPECT_FALSE(k.keys_only);
  EXPECT_EQ(k.codec.rank, 0);
  EXPECT_EQ(k.codec.value_bits, 3);
  EXPECT_EQ(k.codec.key_group, 64);
  EXPECT_EQ(k.codec.value_group, 64);
  EXPECT_EQ(k.codec.window, 128);
  auto a = *ParseEvalConfig("headq-kv2-a2");
  EXPECT_EQ(a.codec.value_policy, core::ValuePolicy::kA2);
  EXPECT_EQ(a.codec.key_group, 128);
  EXPECT_EQ(a.codec.value_group, 32);
  EXPECT_FLOAT_EQ(a.codec.value_budget, 2.0f);
  auto mixed = *ParseEvalConfig("headq-kv2-g128-v3");
  EXPECT_EQ(mixed.codec.key_bits, 2);
  EXPECT_EQ(mixed.codec.value_bits, 3);
  EXPECT_EQ(mixed.codec.key_group, 128);
  auto a3 = *ParseEvalConfig("headq-kv2-a2-v3");
  EXPECT_EQ(a3.codec.key_bits, 2);
  EXPECT_FLOAT_EQ(a3.codec.value_budget, 3.0f);
  EXPECT_EQ(ParseEvalConfig("headq-k2-r4-random")->basis, BasisKind::kRandom);
  EXPECT_TRUE(ParseEvalConfig("dense")->dense);
  // headq-kv2-a2 must fit kivi-kv2's budget: stored bytes per token and head, the A^2 values
  // counted at their mean width (uniform block of that width plus the 2-bit width tags).
  auto kv = *ParseEvalConfig("kivi-kv2");
  auto per_token = [](core::CodecOptions o) {
    double tags = 0;
    if (o.value_policy == core::ValuePolicy::kA2) {
      o.value_policy = core::ValuePolicy::kUniform;
      o.value_bits = static_cast<int>(o.value_budget);
      tags = (o.key_group + 3) / 4;
    }
    return (static_cast<double>(core::KeyBlockBytes(o)) + core::ValueBlockBytes(o) + tags) /
           o.key_group;
  };
  EXPECT_LT(per_token(a.codec), per_token(kv.codec));
}

TEST(EvalConfig, AdaptiveRanksKeepTheMeanAndFollowEnergy) {
  auto c = ParseEvalConfig("headq-k2-r4-adapt");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->adaptive_rank);
  EXPECT_FALSE(ParseEvalConfig("kivi-k2-adapt").ok());
  // Layer 0's columns carry much more energy than layer 1's, layer 2 is in between.
  std::vector<std::vector<double>> e = {{.5, .2, .1, .05, .04, .03, .02, .01},
                                        {.9, .01, .005, .004, .003, .002, .001, .0005},
                                        {.6, .1, .05, .02, .01, .01, .005, .001}};
  std::vector<int> r = AllocateRanks(e, 4, 8);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0] + r[1] + r[2], 12);
  EXPECT_GT(r[0], r[2]);
  EXPECT_GT(r[2], r[1]);
  EXPECT_GE(r[1], 1);
  for (int x : r) EXPECT_LE(x, 8);
}

TEST(EvalConfig, BadNamesAreErrors) {
  for (const char* n :
       {"", "foo-k2", "kivi", "kivi-x2", "kivi-k2-r4", "kivi-k2-random", "headq-k2-zz", "headq-k5",
        "headq-k2-a2", "headq-k2-g33", "headq-k2-v3", "headq-kv2-a2-v8", "kivi-kv2-v5"}) {
    EXPECT_FALSE(ParseEvalConfig(n).ok()) << n;
  }
  EXPECT_TRUE(ParseEvalConfigList("dense,kivi-k2").ok());
  EXPECT_FALSE(ParseEvalConfigList(",").ok());
}

TEST(EvalConfig, CalibratedIsTheGivenCodecAndAnErrorWithoutIt) {
  auto bare = ParseEvalConfig("calibrated");
  ASSERT_FALSE(bare.ok());
  EXPECT_NE(bare.status().message().find("codec.json"), std::string::npos) << bare.status();
  EXPECT_FALSE(ParseEvalConfigList("dense,calibrated").ok());
  EXPECT_TRUE(NamesCalibratedConfig("dense,calibrated"));
  EXPECT_FALSE(NamesCalibratedConfig("dense,calibrated-x"));
  core::CodecOptions codec = ParseEvalConfig("headq-kv3-g128-s4-v2")->codec;
  auto list = ParseEvalConfigList("dense,calibrated", &codec);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  const EvalConfig& c = (*list)[1];
  EXPECT_EQ(c.name, "calibrated");
  EXPECT_EQ(c.family, "headq");
  EXPECT_FALSE(c.keys_only);
  EXPECT_EQ(c.codec.ToString(), codec.ToString());
  codec.key_bits = 5;  // not a codec
  EXPECT_FALSE(EvalConfigFromCodec("calibrated", codec).ok());
}

TEST(CodecSearch, EveryCandidateIsACodecAndItsBitsAreTheBlockSizes) {
  // Every candidate converts to the config that evaluates its codec, unchanged.
  for (const std::string& n : CodecSearchCandidates()) {
    auto parsed = ParseEvalConfig(n);
    ASSERT_TRUE(parsed.ok()) << n << ": " << parsed.status();
    auto back = EvalConfigFromCodec(n, parsed->codec);
    ASSERT_TRUE(back.ok()) << n;
    EXPECT_EQ(back->family, parsed->family) << n;
    EXPECT_EQ(back->codec.ToString(), parsed->codec.ToString()) << n;
  }
  // kivi-kv2 at d = 64: (16 + 4*64 + 64*8) bytes per 32 x 64 keys; the same for values.
  const CodecBits b = SteadyStateBits(ParseEvalConfig("kivi-kv2")->codec);
  EXPECT_DOUBLE_EQ(b.k, 8.0 * 784 / 2048);
  EXPECT_DOUBLE_EQ(b.v, 8.0 * 784 / 2048);
  // The plan: over the budget or the basis rank is skipped; nothing left is an error.
  auto plan = PlanCodecSearch({"kivi-kv2", "headq-kv2", "headq-kv2-r8-g128"}, 64, 4, 3.2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ((*plan)[0].skipped, "");
  EXPECT_EQ((*plan)[1].skipped, "3.344 bits > 3.200");
  EXPECT_EQ((*plan)[2].skipped, "rank 8 > basis rank 4");
  auto none = PlanCodecSearch({"kivi-kv2", "kivi-kv4"}, 64, 4, 3.0);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.status().message().find("kivi-kv2, costs 3.062"), std::string::npos)
      << none.status();
  EXPECT_FALSE(PlanCodecSearch({"kivi-k2"}, 64, 4, 9.0).ok()) << "keys-only is not a codec.json";
  // fp16 sinks: 4 rows of 16-bit keys and values over 512 tokens add 16 * 4 / 512 bits per
  // element, which the budget sees (3.0625 + 0.125 > 3.1).
  const std::string sunk = std::string("kivi-kv2-") + kSinkLever;
  auto with = PlanCodecSearch({"kivi-kv2", sunk}, 64, 4, 3.1, 512);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_DOUBLE_EQ((*with)[1].bits.sinks, 0.125);
  EXPECT_DOUBLE_EQ((*with)[1].bits.per_element(), (*with)[0].bits.per_element() + 0.125);
  EXPECT_EQ((*with)[1].codec.fp16_sinks, 4);
  EXPECT_EQ((*with)[0].skipped, "");
  EXPECT_EQ((*with)[1].skipped, "3.188 bits > 3.100");
}

// The dense-and-sparse lever: keys and values unless the name rotates them; its lists are
// counted in the bits (0.16 bits per element each for keys and values at 5 per mille of 128 x
// 64 elements: 41 entries of 4 bytes per block).
TEST(CodecSearch, TheSparseLeverAppliesWhereNoRotationSpreadsTheOutliers) {
  EXPECT_EQ(WithSparseLever("headq-kv2-g128-obl-mr-sink4"), "headq-kv2-g128-obl-mr-sink4-sk5-sv5");
  EXPECT_EQ(WithSparseLever("headq-kv2-g128-rotk-mr"), "headq-kv2-g128-rotk-mr-sv5");
  EXPECT_EQ(WithSparseLever("headq-kv2-g128-rot"), "headq-kv2-g128-rot");
  for (const std::string& l : KeyLevers())
    for (const std::string& n : CodecSearchCandidates())
      EXPECT_TRUE(ParseEvalConfig(WithSparseLever(WithKeyLever(n, l))).ok())
          << WithSparseLever(WithKeyLever(n, l));
  auto plan = PlanCodecSearch({"headq-kv2-g128", "headq-kv2-g128-sk5-sv5"}, 64, 4, 9.0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ((*plan)[1].codec.sparse_keys, 5);
  EXPECT_EQ((*plan)[1].codec.sparse_values, 5);
  EXPECT_DOUBLE_EQ((*plan)[1].bits.k - (*plan)[0].bits.k, 8.0 * 4 * 41 / (128 * 64));
  EXPECT_DOUBLE_EQ((*plan)[1].bits.v - (*plan)[0].bits.v, 8.0 * 4 * 41 / (128 * 64));
}

TEST(CodecSearch, KeyLeversApplyToEveryCandidateAndKiviHasNoObliquePair) {
  EXPECT_EQ(WithKeyLever("headq-kv3-g128", ""), "headq-kv3-g128");
  EXPECT_EQ(WithKeyLever("headq-kv3-g128", "obl-mr"), "headq-kv3-g128-obl-mr");
  EXPECT_EQ(WithKeyLever("kivi-kv3-g128", "obl-mr"), "kivi-kv3-g128-mr");
  EXPECT_EQ(WithKeyLever("kivi-kv3-g128", "rotk-mr"), "kivi-kv3-g128-rotk-mr");
  for (const std::string& l : KeyLevers()) {
    auto plan = PlanCodecSearch({WithKeyLever(kLeverProbe, l)}, 64, 8, 9.0);
    ASSERT_TRUE(plan.ok()) << l << ": " << plan.status();
    EXPECT_EQ((*plan)[0].oblique, l.rfind("obl", 0) == 0) << l;
    EXPECT_EQ((*plan)[0].codec.rotate_keys, l.find("rotk") != std::string::npos) << l;
    EXPECT_EQ((*plan)[0].codec.metric_rounding, l.find("mr") != std::string::npos) << l;
    for (const std::string& n : CodecSearchCandidates())
      EXPECT_TRUE(ParseEvalConfig(WithKeyLever(n, l)).ok()) << WithKeyLever(n, l);
  }
  // Among evaluated rows, the lowest PPL within each budget.
  std::vector<CodecSearchRow> rows(3);
  rows[0].bits = {2.0, 2.0};
  rows[0].ppl = 30;
  rows[1].bits = {3.0, 3.0};
  rows[1].ppl = 20;
  rows[2].bits = {4.0, 4.0};
  rows[2].skipped = "over";
  EXPECT_EQ(ChooseWithin(rows, 2.5), 0);
  EXPECT_EQ(ChooseWithin(rows, 9.0), 1);
  EXPECT_EQ(ChooseWithin(rows, 1.0), -1);
}

TEST(CodecSearch, NearTiesWithinTheNoiseMarginGoToFewerBits) {
  // Three rows whose perplexities differ by less than the margin, and one just beyond it.
  std::vector<CodecSearchRow> rows(4);
  rows[0].bits = {3.5, 3.5};
  rows[0].ppl = 16.0;
  rows[1].bits = {3.0, 3.0};
  rows[1].ppl = 16.0 * (1 + kChoiceNoiseMargin / 2);
  rows[2].bits = {3.0, 3.0};  // as few bits, later: the earlier row wins
  rows[2].ppl = 16.0 * (1 + kChoiceNoiseMargin / 4);
  rows[3].bits = {2.0, 2.0};
  rows[3].ppl = 16.0 * (1 + 2 * kChoiceNoiseMargin);
  EXPECT_EQ(ChooseWithin(rows, 9.0), 1);
  EXPECT_EQ(ChooseWithin(rows, 2.5), 3);              // alone within 2.5 bits
  rows[1].ppl = 16.0 * (1 + 2 * kChoiceNoiseMargin);  // now beyond: the lowest of the rest
  EXPECT_EQ(ChooseWithin(rows, 9.0), 2);
}

}  // namespace
}  // namespace kvq::frontend
