// Encoded groups: a layer's groups exported and appended elsewhere give the same layer, byte for
// byte, whatever the codec; window rows a run covers are replaced; and every way a hostile run
// can be wrong is refused by CheckEncodedGroups naming the block and the field.
#include "kvq/core/encoded_groups.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/cache.h"
#include "test_util.h"

namespace kvq::core {
namespace {

using testing::Gaussian;
using ::testing::HasSubstr;
using testing::View3;

constexpr int kHeads = 2, kDim = 64, kRank = 4;

struct Case {
  const char* name;
  CodecOptions codec;
};

std::vector<Case> Codecs() {
  std::vector<Case> cases;
  CodecOptions c;
  c.head_dim = kDim;
  c.key_bits = 2;
  c.key_group = 32;
  c.rank = kRank;
  c.side_bits = 8;
  cases.push_back({"k2g32r4", c});
  CodecOptions a2 = c;
  a2.key_bits = 3;
  a2.key_group = 64;
  a2.side_bits = 4;
  a2.value_policy = ValuePolicy::kA2;
  a2.value_budget = 2.5f;
  a2.fp16_sinks = 4;
  a2.window = 16;
  cases.push_back({"k3g64 A2 sinks R16", a2});
  CodecOptions sp = c;
  sp.sparse_keys = 10;
  sp.sparse_values = 10;
  sp.rank = 0;
  cases.push_back({"sparse r0", sp});
  CodecOptions rot = c;
  rot.rotate_keys = rot.rotate_values = true;
  rot.key_group = 128;
  cases.push_back({"rotated g128", rot});
  return cases;
}

std::vector<float> Basis(uint32_t seed) {
  // Orthonormal columns per head: the first kRank unit vectors of a shuffled identity.
  std::vector<float> u(static_cast<size_t>(kHeads) * kDim * kRank, 0.0f);
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kRank; ++j)
      u[(static_cast<size_t>(h) * kDim + (j * 7 + seed) % kDim) * kRank + j] = 1.0f;
  return u;
}

std::vector<uint8_t> All(const LayerCache& c, bool keys) {
  std::vector<uint8_t> k, v;
  EXPECT_TRUE(c.DecodeAs(0, c.tokens(), DType::kF32, &k, &v).ok());
  return keys ? k : v;
}

// The window rows of `c` ([kv_heads][n][d] fp32): what a client sends after its groups.
std::vector<float> WindowRows(const LayerCache& c) {
  std::vector<float> k, v;
  EXPECT_TRUE(c.Decode(c.encoded_tokens(), c.tokens(), &k, &v).ok());
  k.insert(k.end(), v.begin(), v.end());
  return k;
}

TEST(EncodedGroupsTest, ExportedGroupsAppendedElsewhereGiveTheSameLayer) {
  const std::vector<float> basis = Basis(3);
  for (const Case& tc : Codecs()) {
    SCOPED_TRACE(tc.name);
    const int64_t T = 300;
    const auto k = Gaussian(static_cast<size_t>(kHeads) * T * kDim, 1);
    const auto v = Gaussian(k.size(), 2);
    LayerCache sender(tc.codec, kHeads, basis.data());
    ASSERT_TRUE(sender.Append(View3(k, kHeads, T, kDim), View3(v, kHeads, T, kDim), 0).ok());
    ASSERT_GT(sender.encoded_tokens(), 0);
    const int64_t E = sender.encoded_tokens(), W = T - E;
    EncodedGroups run;
    ASSERT_TRUE(sender.ExportGroups(0, sender.encoded_tokens() / tc.codec.key_group, &run).ok());
    ASSERT_TRUE(CheckEncodedGroups(tc.codec, kHeads, ViewOf(run), "encoded").ok());
    EXPECT_EQ(run.sink_keys.empty(), tc.codec.fp16_sinks == 0);

    LayerCache receiver(tc.codec, kHeads, basis.data());
    ASSERT_TRUE(receiver.AppendGroups(ViewOf(run)).ok());

    const std::vector<float> rows = WindowRows(sender);
    const std::vector<float> wk(rows.begin(), rows.begin() + rows.size() / 2),
        wv(rows.begin() + rows.size() / 2, rows.end());
    ASSERT_TRUE(receiver.Append(View3(wk, kHeads, W, kDim), View3(wv, kHeads, W, kDim), E).ok());
    EXPECT_EQ(receiver.tokens(), T);
    EXPECT_EQ(All(receiver, true), All(sender, true));
    EXPECT_EQ(All(receiver, false), All(sender, false));
    // Decoded on its own (a client's GetBlocks in codes: the groups, then the window rows),
    // the sender's decode bit for bit, with and without the rows.
    const float* u = sender.tables()->basis.empty() ? nullptr : sender.tables()->basis.data();
    const TensorView rk = View3(wk, kHeads, W, kDim), rv = View3(wv, kHeads, W, kDim);
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (const bool with_rows : {false, true}) {
        std::vector<uint8_t> dk, dv, sk, sv;
        ASSERT_TRUE(DecodeMessage(tc.codec, kHeads, u, ViewOf(run), with_rows ? &rk : nullptr,
                                  with_rows ? &rv : nullptr, dt, "encoded", &dk, &dv)
                        .ok());
        ASSERT_TRUE(sender.DecodeAs(0, with_rows ? T : E, dt, &sk, &sv).ok());
        EXPECT_EQ(dk, sk);
        EXPECT_EQ(dv, sv);
        // Token-major: the same rows, each token's heads together.
        std::vector<uint8_t> tk, tv;
        ASSERT_TRUE(DecodeMessage(tc.codec, kHeads, u, ViewOf(run), with_rows ? &rk : nullptr,
                                  with_rows ? &rv : nullptr, dt, "encoded", &tk, &tv,
                                  RowOrder::kTokenMajor)
                        .ok());
        ASSERT_EQ(tk.size(), dk.size());
        const int64_t n = with_rows ? T : E;
        const size_t row = static_cast<size_t>(kDim) * DTypeSize(dt);
        std::vector<uint8_t> ek(dk.size()), ev(dv.size());  // dk, dv transposed
        for (int h = 0; h < kHeads; ++h) {
          for (int64_t t = 0; t < n; ++t) {
            const size_t from = (static_cast<size_t>(h) * n + t) * row;
            const size_t to = (static_cast<size_t>(t) * kHeads + h) * row;
            std::memcpy(ek.data() + to, dk.data() + from, row);
            std::memcpy(ev.data() + to, dv.data() + from, row);
          }
        }
        EXPECT_EQ(tk, ek);
        EXPECT_EQ(tv, ev);
      }
    }
    std::vector<uint8_t> dk, dv;
    const TensorView wrong = View3(wk, kHeads, W, kDim / 2);
    EXPECT_THAT(
        DecodeMessage(tc.codec, kHeads, u, ViewOf(run), &wrong, &rv, DType::kF32, "m", &dk, &dv)
            .message(),
        ::testing::HasSubstr("m keys/values: not both [kv_heads = 2, n, head_dim = "));
    EXPECT_FALSE(
        DecodeMessage(tc.codec, kHeads, u, ViewOf(run), &rk, nullptr, DType::kF32, "m", &dk, &dv)
            .ok());
    // Exported again, the same bytes.
    EncodedGroups again;
    ASSERT_TRUE(receiver.ExportGroups(0, run.groups, &again).ok());
    EXPECT_EQ(again.bytes, run.bytes);
    EXPECT_EQ(again.sizes, run.sizes);
  }
}

// A receiver holding the first rows in its window takes the run that covers them: the rows go,
// the blocks stay, and the layer equals the sender's (the window of a chunked put).
TEST(EncodedGroupsTest, ARunReplacesTheWindowRowsItCovers) {
  const std::vector<float> basis = Basis(5);
  CodecOptions c = Codecs()[0].codec;
  const int64_t T = 200, first = 50;  // 50 rows first: one group and a partial one
  const auto k = Gaussian(static_cast<size_t>(kHeads) * T * kDim, 7);
  const auto v = Gaussian(k.size(), 8);
  LayerCache sender(c, kHeads, basis.data());
  ASSERT_TRUE(sender.Append(View3(k, kHeads, T, kDim), View3(v, kHeads, T, kDim), 0).ok());
  LayerCache receiver(c, kHeads, basis.data());
  receiver.set_sealing(true);
  // Its first 50 rows, as a client sends a first chunk: one group encoded, 18 in the window.
  std::vector<float> k50, v50;
  for (int h = 0; h < kHeads; ++h) {
    k50.insert(k50.end(), k.begin() + h * T * kDim, k.begin() + (h * T + first) * kDim);
    v50.insert(v50.end(), v.begin() + h * T * kDim, v.begin() + (h * T + first) * kDim);
  }
  ASSERT_TRUE(
      receiver.Append(View3(k50, kHeads, first, kDim), View3(v50, kHeads, first, kDim), 0).ok());
  ASSERT_EQ(receiver.encoded_tokens(), 32);
  EncodedGroups run;
  ASSERT_TRUE(sender.ExportGroups(1, sender.encoded_tokens() / 32, &run).ok());
  ASSERT_TRUE(receiver.AppendGroups(ViewOf(run)).ok());
  EXPECT_EQ(receiver.tokens(), sender.encoded_tokens());
  EXPECT_EQ(receiver.encoded_tokens(), sender.encoded_tokens());
  EXPECT_TRUE(receiver.AllSealed());
  EXPECT_EQ(receiver.sealed().size(), static_cast<size_t>(sender.encoded_tokens() / 32));
  // A run that does not start at the next group is refused and changes nothing.
  EXPECT_EQ(receiver.AppendGroups(ViewOf(run)).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<uint8_t> sk = All(sender, true);
  const std::vector<uint8_t> rk = All(receiver, true);
  ASSERT_LE(rk.size(), sk.size());
  // Head 0's encoded tokens agree byte for byte.
  EXPECT_EQ(0,
            std::memcmp(rk.data(), sk.data(), static_cast<size_t>(receiver.tokens()) * kDim * 4));
}

// ---- Hostile runs ----

class HostileRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    codec_ = Codecs()[0].codec;
    codec_.sparse_keys = 10;  // so that the list's checks are reached
    const int64_t T = 64;
    const auto k = Gaussian(static_cast<size_t>(kHeads) * T * kDim, 11);
    const auto v = Gaussian(k.size(), 12);
    basis_ = Basis(1);
    LayerCache c(codec_, kHeads, basis_.data());
    ASSERT_TRUE(c.Append(View3(k, kHeads, T, kDim), View3(v, kHeads, T, kDim), 0).ok());
    ASSERT_TRUE(c.ExportGroups(0, 2, &run_).ok());
    ASSERT_TRUE(Check().ok());
  }
  absl::Status Check() const { return CheckEncodedGroups(codec_, kHeads, ViewOf(run_), "enc"); }
  uint8_t* Block(size_t i) {
    return reinterpret_cast<uint8_t*>(run_.bytes.data()) + RunOffsets(ViewOf(run_))[i];
  }
  // Rewrites block i's checksum so that only the field a test broke is wrong.
  void Reseal(size_t i) {
    uint8_t* b = Block(i);
    const size_t n = run_.sizes[i];
    const uint64_t head = XXH3_64bits(b, format::kHashedHeaderBytes);
    const uint64_t payload = XXH3_64bits(b + format::kHeaderBytes, n - format::kHeaderBytes);
    format::StoreU32(b + format::kChecksumAt, format::MixChecksum(payload, head));
  }
  void SetHalf(size_t i, size_t at, float x) {
    format::StoreU16(Block(i) + at, format::FloatToHalf(x));
    Reseal(i);
  }

  CodecOptions codec_;
  std::vector<float> basis_;
  EncodedGroups run_;
};

TEST_F(HostileRunTest, AFlippedBitIsDataLossNamingTheBlock) {
  Block(2)[40] ^= 0x10;  // group 0, head 1, key
  const absl::Status st = Check();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("enc.blocks[2] (group 0, head 1, key)"));
  EXPECT_THAT(st.message(), HasSubstr("checksum"));
}

TEST_F(HostileRunTest, AnotherCodecsBlockIsRefused) {
  CodecOptions other = codec_;
  other.key_bits = 3;
  const absl::Status st = CheckEncodedGroups(other, kHeads, ViewOf(run_), "enc");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("enc.blocks[0] (group 0, head 0, key)"));
  EXPECT_THAT(st.message(), HasSubstr("does not match the sequence's codec"));
}

TEST_F(HostileRunTest, TruncatedAndOversizedBlocksAreRefused) {
  EncodedGroups cut = run_;
  cut.sizes[1] -= 1;  // the value block one byte short, the next key block one byte long
  cut.sizes[2] += 1;
  absl::Status st = CheckEncodedGroups(codec_, kHeads, ViewOf(cut), "enc");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("enc.blocks[1] (group 0, head 0, value)"));
  EXPECT_THAT(st.message(), HasSubstr("truncated or padded"));
  EncodedGroups longer = run_;
  longer.bytes.push_back(0);
  st = CheckEncodedGroups(codec_, kHeads, ViewOf(longer), "enc");
  EXPECT_THAT(st.message(), HasSubstr("block_bytes sums to"));
  EncodedGroups fewer = run_;
  fewer.sizes.pop_back();
  st = CheckEncodedGroups(codec_, kHeads, ViewOf(fewer), "enc");
  EXPECT_THAT(st.message(), HasSubstr("need 8 (a key and a value block per head)"));
}

TEST_F(HostileRunTest, NonFiniteNegativeAndHugeScalesAreRefused) {
  const size_t scale0 = format::kHeaderBytes;  // key block: fp16 scale[d] first
  for (const float bad : {std::nanf(""), INFINITY, -1.0f, 60000.0f}) {
    SCOPED_TRACE(bad);
    EncodedGroups keep = run_;
    SetHalf(0, scale0, bad);
    if (bad == 60000.0f) SetHalf(0, scale0 + 2 * kDim, 60000.0f);  // zero: top = 60000 + 3 x 60000
    const absl::Status st = Check();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(),
                HasSubstr("enc.blocks[0] (group 0, head 0, key): channel scale/zero[0]"));
    run_ = keep;
  }
  // A value token's scale.
  const size_t vscale = format::kHeaderBytes;  // uniform widths: token 0's record first
  SetHalf(1, vscale, INFINITY);
  const absl::Status st = Check();
  EXPECT_THAT(st.message(),
              HasSubstr("enc.blocks[1] (group 0, head 0, value): token 0 channel group"));
}

// CheckAffine accepts pairs inside a box (scale < 128, |zero| < 32768) from their bits alone;
// pairs outside it take the exact check, which accepts these (each decodes within range).
TEST_F(HostileRunTest, ScalesOutsideTheFastBoxAreCheckedExactly) {
  const size_t scale0 = format::kHeaderBytes, zero0 = scale0 + 2 * kDim;
  for (const auto& [scale, zero] : std::vector<std::pair<float, float>>{
           {127.9f, -32752.0f}, {128.0f, 0.0f}, {1000.0f, -40000.0f}, {-0.0f, 65504.0f}}) {
    SCOPED_TRACE(absl::StrCat(scale, " ", zero));
    EncodedGroups keep = run_;
    SetHalf(0, scale0, scale);
    SetHalf(0, zero0, zero);
    EXPECT_TRUE(Check().ok()) << Check();
    run_ = keep;
  }
  // Beyond it: zero + 3 x scale past the fp16 maximum plus one step, from the zero or from the
  // scale alone, or from the zero near the maximum with a scale inside the box.
  for (const auto& [scale, zero] : std::vector<std::pair<float, float>>{
           {20000.0f, 40000.0f}, {60000.0f, 0.0f}, {127.0f, 65504.0f}}) {
    SCOPED_TRACE(absl::StrCat(scale, " ", zero));
    EncodedGroups keep = run_;
    SetHalf(0, scale0, scale);
    SetHalf(0, zero0, zero);
    EXPECT_THAT(Check().message(), HasSubstr("beyond the fp16 maximum"));
    run_ = keep;
  }
}

TEST_F(HostileRunTest, SparsePositionsOutOfRangeAndNonFiniteDeltasAreRefused) {
  const size_t list = run_.sizes[0] - format::kSparseEntryBytes * SparseCount(codec_, true);
  EncodedGroups keep = run_;
  format::StoreU16(Block(0) + list, 32 * kDim);  // one past the block's last element
  Reseal(0);
  absl::Status st = Check();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("names a position outside it"));
  run_ = keep;
  SetHalf(0, list + 2, INFINITY);
  st = Check();
  EXPECT_THAT(st.message(), HasSubstr("dense-and-sparse entry 0 has a non-finite delta"));
}

TEST_F(HostileRunTest, AnUnknownVersionIsFailedPreconditionNamingBoth) {
  Block(0)[format::kVersionAt] = 9;
  Reseal(0);
  const absl::Status st = Check();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("block format version 9; this server reads versions 2 to 3"));
}

TEST_F(HostileRunTest, SinkRowsOnlyWithGroupZeroOfASinkCodec) {
  run_.sink_keys.assign(kHeads * 4 * kDim, 0);
  run_.sink_values = run_.sink_keys;
  EXPECT_THAT(Check().message(), HasSubstr("sink rows are sent only with group 0"));
  CodecOptions sinks = codec_;
  sinks.fp16_sinks = 4;
  run_.sink_values.pop_back();
  // (the blocks were not made by a sink codec, but the layout is the same: the sinks are checked)
  absl::Status st = CheckEncodedGroups(sinks, kHeads, ViewOf(run_), "enc");
  EXPECT_THAT(st.message(), HasSubstr("enc.sink_values holds"));
  run_.sink_values = run_.sink_keys;
  run_.sink_keys[5] = 0x7c00;  // +Inf
  st = CheckEncodedGroups(sinks, kHeads, ViewOf(run_), "enc");
  EXPECT_THAT(st.message(), HasSubstr("enc.sink_keys[5] is not finite"));
}

}  // namespace
}  // namespace kvq::core
