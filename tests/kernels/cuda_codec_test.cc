// The GPU block codec ops' programs (kernels/cuda/codec_math.h) run on the CPU by their
// stand-ins, against core's codec on the scalar reference kernels: encoded blocks byte for
// byte, decodes, scores and readouts bit for bit, over a table of codecs (bits, groups,
// ranks, side bits, per-token widths, rotations, odd value groups, head_dim 32..256).
#include "kvq/kernels/cuda_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/codec_math.h"
#include "kernels/src/common.h"
#include "kvq/core/codec.h"
#include "kvq/kernels/kernels.h"
#include "tests/kernels/cuda_codec_cases.h"

namespace kvq::kernels::cuda {
namespace {

using core::CodecOptions;
using testing::BlockCodecOptions;
using testing::FromOptions;

// The scalar reference tables for the whole test (core's encoder uses the active table).
class OnRefKernels : public ::testing::Test {
 protected:
  void SetUp() override { SetActive(&Ref()); }
  void TearDown() override { SetActive(nullptr); }
};

TEST_F(OnRefKernels, EncodedBlocksAreCoresBytes) {
  for (const CodecOptions& o : testing::BlockCodecCases()) {
    SCOPED_TRACE(testing::CaseName(o));
    ASSERT_TRUE(o.Validate().ok());
    const testing::CodecCase cs = testing::PrepareCodecCase(o, 11);
    const testing::CodecResults got = testing::RunStandIns(cs);
    for (int b = 0; b < cs.blocks; ++b) {
      EXPECT_EQ(got.key_blocks[b], cs.key_blocks[b]) << "key block " << b;
      EXPECT_EQ(got.value_blocks[b], cs.value_blocks[b]) << "value block " << b;
      EXPECT_TRUE(core::VerifyBlock(got.key_blocks[b]).ok());
      EXPECT_TRUE(core::VerifyBlock(got.value_blocks[b]).ok());
    }
  }
}

// The encoder's intermediate floats, which equal bytes hide where a code is far from its
// rounding boundary: the base decode and the side coefficients, bit for bit against the
// reference table's quantize_channels and project_residual.
TEST(CudaCodecMath, EncodeStepsComputeTheReferenceFloats) {
  const CodecOptions o = BlockCodecOptions(128, 64, 2, 16, 8, 2, 32);
  const int d = o.head_dim, G = o.key_group, r = o.rank;
  const std::vector<float> keys = testing::Gaussian(static_cast<size_t>(G) * d, 51);
  const std::vector<float> ut = testing::Gaussian(static_cast<size_t>(r) * d, 52, 0.2f);
  std::vector<uint8_t> block(KeyBlockSize(FromOptions(o)));
  const float* kp = keys.data();
  const float* up = ut.data();
  uint8_t* op = block.data();
  EncodeKeyParams p;
  p.codec = FromOptions(o);
  p.blocks = 1;
  p.keys = &kp;
  p.ld = d;
  p.basis_t = &up;
  p.out = &op;
  std::vector<float> work(EncodeKeyWorkspaceBytes(p) / 4, std::nanf(""));
  p.workspace = work.data();
  p.workspace_bytes = 4 * work.size();
  for (int c = 0; c < d; ++c) codec_math::EncodeKeyChannel(p, 0, c);
  for (int t = 0; t < G; ++t) codec_math::EncodeKeyProject(p, 0, t);
  const codec_math::KeyWork w = codec_math::KeyWorkOf(p, 0);

  std::vector<uint16_t> scale(d), zero(d);
  std::vector<uint8_t> codes(static_cast<size_t>(d) * G * 2 / 8);
  std::vector<float> deq(static_cast<size_t>(G) * d), coef(static_cast<size_t>(G) * r);
  Ref().quantize_channels(keys.data(), d, G, d, 2, scale.data(), zero.data(), codes.data(),
                          deq.data());
  Ref().project_residual(keys.data(), d, deq.data(), G, d, ut.data(), r, coef.data());
  for (size_t i = 0; i < deq.size(); ++i) ASSERT_EQ(w.deq[i], deq[i]) << "deq " << i;
  for (size_t i = 0; i < coef.size(); ++i) ASSERT_EQ(w.coef[i], coef[i]) << "coefficient " << i;
}

TEST_F(OnRefKernels, DecodesScoresAndReadoutsAreCoresBitForBit) {
  for (const CodecOptions& o : testing::BlockCodecCases()) {
    SCOPED_TRACE(testing::CaseName(o));
    const int d = o.head_dim, G = o.key_group, r = o.rank;
    const testing::CodecCase cs = testing::PrepareCodecCase(o, 21);
    const testing::CodecResults got = testing::RunStandIns(cs);
    EXPECT_EQ(got.flags, 0);
    const int64_t T = cs.tokens();
    std::vector<float> want_k(static_cast<size_t>(G) * d), want_v = want_k,
                                                           want_s(static_cast<size_t>(cs.n_q) * G);
    std::vector<float> want_out(static_cast<size_t>(cs.n_q) * d, 0.5f);
    for (int b = 0; b < cs.blocks; ++b) {
      auto kv = core::ParseKeyBlock(cs.key_blocks[b], o, true);
      auto vv = core::ParseValueBlock(cs.value_blocks[b], o, true);
      ASSERT_TRUE(kv.ok() && vv.ok());
      core::DecodeKeyBlock(*kv, r > 0 ? cs.basis.data() : nullptr, want_k.data());
      core::DecodeValueBlock(*vv, want_v.data());
      core::ScoreKeyBlock(*kv, cs.hq.data(), r > 0 ? cs.uq.data() : nullptr, cs.n_q, cs.scale,
                          want_s.data(), G, true, true);
      core::ReadoutValueBlock(*vv, cs.probs.data() + static_cast<size_t>(b) * G, T, cs.n_q,
                              want_out.data(), d, true);
      for (size_t i = 0; i < want_k.size(); ++i) {
        ASSERT_EQ(got.keys[b * want_k.size() + i], want_k[i]) << "key block " << b << " at " << i;
        ASSERT_EQ(got.values[b * want_v.size() + i], want_v[i])
            << "value block " << b << " at " << i;
      }
      for (int i = 0; i < cs.n_q; ++i)
        for (int t = 0; t < G; ++t)
          ASSERT_EQ(got.scores[i * T + b * G + t], want_s[i * G + t]) << "block " << b;
    }
    for (size_t i = 0; i < want_out.size(); ++i)
      ASSERT_EQ(got.readout[i], want_out[i]) << "readout " << i;
  }
}

TEST_F(OnRefKernels, AHeaderThatIsNotTheCodecsIsFlaggedAndItsRowsLeftAlone) {
  const testing::CodecCase cs =
      testing::PrepareCodecCase(BlockCodecOptions(64, 32, 2, 4, 8, 2, 32), 41);
  std::vector<uint8_t> bad = cs.key_blocks[1];
  bad[4] = 3;  // key bits
  std::vector<const uint8_t*> in = {cs.key_blocks[0].data(), bad.data()};
  std::vector<float> rows(2 * 32 * 64, 7.0f);
  std::vector<float*> out = {rows.data(), rows.data() + 32 * 64};
  int flags = 0;
  DecodeKeyParams p{cs.c, 2, in.data(), nullptr, out.data(), 64, &flags};
  ASSERT_EQ(DecodeKeysOnHost(p), 0);
  EXPECT_EQ(flags, kBlockHeaderMismatch);
  EXPECT_NE(rows[0], 7.0f);
  for (int i = 32 * 64; i < 2 * 32 * 64; ++i) ASSERT_EQ(rows[i], 7.0f);
  // A value block read as keys is refused too.
  flags = 0;
  in[1] = cs.value_blocks[0].data();
  ASSERT_EQ(DecodeKeysOnHost(p), 0);
  EXPECT_EQ(flags, kBlockHeaderMismatch);
}

TEST(CudaCodecMath, UnsupportedParamsNameTheField) {
  BlockCodec c = FromOptions(BlockCodecOptions(64, 32, 2, 4, 8, 2, 32));
  EXPECT_EQ(BlockCodecUnsupported(c), nullptr);
  c.key_group = 48;
  EXPECT_NE(std::string(BlockCodecUnsupported(c)).find("key_group"), std::string::npos);
  c = FromOptions(BlockCodecOptions(96, 32, 2, 4, 8, 2, 32));
  c.rotate_values = true;
  EXPECT_NE(std::string(BlockCodecUnsupported(c)).find("power of two"), std::string::npos);
  EncodeKeyParams p;
  p.codec = FromOptions(BlockCodecOptions(64, 32, 2, 4, 8, 2, 32));
  p.blocks = 1;
  EXPECT_EQ(EncodeKeysOnHost(p), 1);  // null pointers
  EXPECT_STREQ(codec_math::Reason(p), "keys, out (and basis_t when rank > 0): null");
}

}  // namespace
}  // namespace kvq::kernels::cuda
