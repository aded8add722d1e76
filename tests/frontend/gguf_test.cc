// GGUF reader: synthetic files written by the test (metadata of every kind, each supported
// tensor type against a hand-computed dequantization, alignment) and the errors on truncated,
// malformed and unsupported files.
#include "kvq/frontend/gguf.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/core/half.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {
namespace {

std::string WriteTemp(const std::vector<uint8_t>& bytes, const std::string& tag) {
  std::string path =
      ::testing::TempDir() + "/gguf_test_" + tag + "_" + std::to_string(::getpid()) + ".gguf";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return path;
}

void PutHalf(std::vector<uint8_t>& b, float f) {
  uint16_t h = core::FloatToHalf(f);
  b.push_back(h & 0xFF);
  b.push_back(h >> 8);
}

// Q4_1 block: d = 0.5, m = -1, codes j -> j % 16 (low nibble weight j, high nibble j + 16).
std::vector<uint8_t> Q41Block() {
  std::vector<uint8_t> b;
  PutHalf(b, 0.5f);
  PutHalf(b, -1.0f);
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>((j % 16) | (((15 - j) % 16) << 4)));
  return b;
}

std::vector<uint8_t> Q80Block() {
  std::vector<uint8_t> b;
  PutHalf(b, 0.25f);
  for (int j = 0; j < 32; ++j) b.push_back(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
  return b;
}

GgufWriter Example() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddUint32("llama.block_count", 30);
  w.AddFloat32("llama.rope.freq_base", 100000.0f);
  w.AddStringArray("tokenizer.ggml.tokens", {"a", "b", "\xc4\xa0hello"});
  std::vector<uint8_t> f32(4 * 3);
  const float vals[3] = {1.5f, -2.0f, 3.25f};
  std::memcpy(f32.data(), vals, sizeof(vals));
  w.AddTensor("norm", {3}, static_cast<uint32_t>(GgmlType::kF32), f32);
  std::vector<uint8_t> f16;
  for (float v : {0.5f, -0.25f, 65504.0f, 0.0f}) PutHalf(f16, v);
  w.AddTensor("half", {2, 2}, static_cast<uint32_t>(GgmlType::kF16), f16);
  auto q41 = Q41Block();
  auto q41b = q41;
  q41.insert(q41.end(), q41b.begin(), q41b.end());
  w.AddTensor("q41", {32, 2}, static_cast<uint32_t>(GgmlType::kQ4_1), q41);
  w.AddTensor("q80", {32}, static_cast<uint32_t>(GgmlType::kQ8_0), Q80Block());
  return w;
}

TEST(Gguf, ReadsMetadataAndTensorInfos) {
  auto f = GgufFile::Open(WriteTemp(Example().Finish(), "meta"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ((*f)->alignment(), 32u);
  EXPECT_EQ(*(*f)->GetString("general.architecture"), "llama");
  EXPECT_EQ(*(*f)->GetInt("llama.block_count"), 30);
  EXPECT_FLOAT_EQ(static_cast<float>(*(*f)->GetFloat("llama.rope.freq_base")), 100000.0f);
  auto toks = (*f)->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(toks.ok());
  EXPECT_EQ(toks->size(), 3u);
  EXPECT_EQ((*toks)[2], "\xc4\xa0hello");
  EXPECT_EQ((*f)->GetInt("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*f)->GetInt("general.architecture").status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ((*f)->tensors().size(), 4u);
  const GgufTensorInfo* q = (*f)->FindTensor("q41");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dims, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(q->bytes(), 40u);
}

TEST(Gguf, DequantizesEveryTypeExactly) {
  auto f = GgufFile::Open(WriteTemp(Example().Finish(), "deq"));
  ASSERT_TRUE(f.ok()) << f.status();
  auto n = (*f)->Dequantize("norm");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  auto h = (*f)->Dequantize("half");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, (std::vector<float>{0.5f, -0.25f, 65504.0f, 0.0f}));
  auto q = (*f)->Dequantize("q41");
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(q->size(), 64u);
  for (int blk = 0; blk < 2; ++blk)
    for (int j = 0; j < 16; ++j) {
      EXPECT_FLOAT_EQ((*q)[blk * 32 + j], 0.5f * (j % 16) - 1.0f) << j;
      EXPECT_FLOAT_EQ((*q)[blk * 32 + j + 16], 0.5f * ((15 - j) % 16) - 1.0f) << j;
    }
  auto q8 = (*f)->Dequantize("q80");
  ASSERT_TRUE(q8.ok());
  for (int j = 0; j < 32; ++j) EXPECT_FLOAT_EQ((*q8)[j], 0.25f * (j - 16));
}

// Q6_K is not in the SmolLM2 file but is common in Llama GGUFs. Expected values from the
// gguf Python package (gguf.quants.dequantize), on one pseudo-random super block with d = 0.01.
TEST(Gguf, DequantizesQ6KLikeGgufPy) {
  const std::string hex =
      "4ecc402210fae920677a0dcc8aacd07f7c640c97decbfb99d3eb50b6b02958078df1497cdf7bde255437c866d33c"
      "9fed358a398c371507127643f18a94dd382159d022c14ca7c5f2b1f3bcfa5cc3339f90244bde5655765e3b394f25"
      "db74ea82d58a98716313b0a9132f9afe77a37a46ff5910db28e051237eec05597ef6bcc9d764643f51c09cabc2a7"
      "8075bf7c2b8302b7f7f099a315d19eded3d66232908c37e375fb00281dfbdf35972268bb5a342a1af14ee745c18d"
      "1ba3e8d200d4ce7bdb05d8fb8c38705a427fa6ed32ca72971f21";
  std::vector<uint8_t> blk;
  for (size_t i = 0; i < hex.size(); i += 2)
    blk.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  ASSERT_EQ(blk.size(), 210u);
  std::vector<float> out(256);
  ASSERT_TRUE(
      DequantizeRow(static_cast<uint32_t>(GgmlType::kQ6_K), blk.data(), 256, out.data()).ok());
  const std::vector<std::pair<int, float>> want = {
      {0, -11.102371f},  {1, 7.401581f},    {31, -1.250267f},  {32, 1.200256f},
      {63, -0.850182f},  {64, 13.922974f},  {100, -3.360718f}, {127, 1.800385f},
      {128, 16.503525f}, {200, -2.500534f}, {255, 4.200898f}};
  for (auto [i, v] : want) EXPECT_NEAR(out[i], v, 1e-4) << i;
}

// Real blocks of the Qwen2.5-Coder-0.5B file (Q5_0, Q4_K, Q6_K, Q8_0 tensors) against gguf-py's
// dequantization of the same bytes (tests/fixtures/frontend/make_dequant_fixture.py).
TEST(Gguf, DequantizesRealQwenBlocksLikeGgufPy) {
  std::ifstream in(std::string(KVQ_FE_FIXTURES) + "/dequant_qwen.json");
  ASSERT_TRUE(in) << "missing fixture dequant_qwen.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  std::map<std::string, GgmlType> types = {{"Q5_0", GgmlType::kQ5_0},
                                           {"Q4_K", GgmlType::kQ4_K},
                                           {"Q6_K", GgmlType::kQ6_K},
                                           {"Q8_0", GgmlType::kQ8_0}};
  ASSERT_EQ(j["cases"].size(), types.size());
  for (const auto& c : j["cases"]) {
    const std::string name = c["type"].get<std::string>();
    ASSERT_TRUE(types.count(name)) << name;
    const std::string hex = c["hex"].get<std::string>();
    std::vector<uint8_t> raw;
    for (size_t i = 0; i < hex.size(); i += 2)
      raw.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    const auto want = c["values"].get<std::vector<float>>();
    const uint32_t type = static_cast<uint32_t>(types[name]);
    auto [bs, bb] = GgmlBlockLayout(type);
    ASSERT_EQ(raw.size(), want.size() / bs * bb) << name;
    std::vector<float> got(want.size());
    ASSERT_TRUE(DequantizeRow(type, raw.data(), static_cast<int64_t>(want.size()), got.data()).ok())
        << name;
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      // Both sides compute in fp32 from the same fp16 scales; allow one rounding step.
      if (std::abs(got[i] - want[i]) > 1e-6f * std::max(1.0f, std::abs(want[i])) && bad++ < 5) {
        ADD_FAILURE() << name << " (" << c["tensor"].get<std::string>() << ") value " << i << ": "
                      << got[i] << " vs gguf-py " << want[i];
      }
    }
    EXPECT_EQ(bad, 0) << name;
  }
}

TEST(Gguf, HonoursCustomAlignment) {
  GgufWriter w = Example();
  w.AddUint32("general.alignment", 64);
  auto f = GgufFile::Open(WriteTemp(w.Finish(64), "align"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
  auto q8 = (*f)->Dequantize("q80");
  ASSERT_TRUE(q8.ok());
  EXPECT_FLOAT_EQ((*q8)[0], -4.0f);
  // Read with the wrong alignment, the data would be misplaced: check it is not.
  EXPECT_FLOAT_EQ((*q8)[31], 3.75f);
}

TEST(Gguf, TruncatedFilesAreErrorsAtEveryCut) {
  const std::vector<uint8_t> full = Example().Finish();
  // Every prefix must fail cleanly (never crash, never succeed).
  for (size_t cut : {size_t{0}, size_t{3}, size_t{10}, size_t{23}, size_t{60}, full.size() / 2,
                     full.size() - 1}) {
    std::vector<uint8_t> part(full.begin(), full.begin() + static_cast<long>(cut));
    auto f = GgufFile::Open(WriteTemp(part, "trunc"));
    EXPECT_FALSE(f.ok()) << "cut at " << cut;
    if (!f.ok() && cut >= 4) {
      EXPECT_NE(f.status().message().find("truncated"), std::string::npos) << f.status();
    }
  }
}

TEST(Gguf, RejectsBadMagicVersionAndUnsupportedTypes) {
  std::vector<uint8_t> b = Example().Finish();
  b[0] = 'X';
  EXPECT_EQ(GgufFile::Open(WriteTemp(b, "magic")).status().code(),
            absl::StatusCode::kInvalidArgument);
  b = Example().Finish();
  b[4] = 9;  // version 9
  EXPECT_EQ(GgufFile::Open(WriteTemp(b, "ver")).status().code(), absl::StatusCode::kUnimplemented);
  GgufWriter w;
  w.AddTensor("iq", {256}, 16 /* IQ2_XXS */, std::vector<uint8_t>(66, 0));
  auto f = GgufFile::Open(WriteTemp(w.Finish(), "type"));
  ASSERT_TRUE(f.ok()) << f.status();  // the file is readable; the tensor is not
  auto d = (*f)->Dequantize("iq");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented);
  // The error names the tensor and the type id, so that a user knows what the file needs.
  EXPECT_NE(d.status().message().find("tensor iq"), std::string::npos) << d.status();
  EXPECT_NE(d.status().message().find("(16)"), std::string::npos) << d.status();
  EXPECT_EQ(GgufFile::Open("/nonexistent/model.gguf").status().code(), absl::StatusCode::kNotFound);
}

TEST(Gguf, RejectsTensorsPastTheEndAndMisaligned) {
  GgufWriter w;
  w.AddTensor("t", {64}, static_cast<uint32_t>(GgmlType::kF32), std::vector<uint8_t>(64 * 4, 0));
  std::vector<uint8_t> b = w.Finish();
  b.resize(b.size() - 8);  // data section shorter than the tensor
  auto f = GgufFile::Open(WriteTemp(b, "short"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("tensor t"), std::string::npos) << f.status();
}

// Tensor infos whose numbers would wrap around: an offset near 2^64 (the sum with the data
// section's start wrapped, placing the tensor silently in the header), dims whose
// product overflows int64, a tensor count or array length the file cannot hold (which sized
// an allocation before anything was read). Each is an error naming what is wrong; found by
// fuzz/fuzz_gguf.cc's review.
TEST(Gguf, RejectsCountsAndOffsetsThatWrapOrOutgrowTheFile) {
  GgufWriter w;
  w.AddUint32("general.alignment", 1);
  w.AddTensor("t", {4}, static_cast<uint32_t>(GgmlType::kF32), std::vector<uint8_t>(16, 0));
  std::vector<uint8_t> b = w.Finish(1);
  const size_t data_start = b.size() - 16;  // alignment 1: right after the tensor info
  ASSERT_TRUE(GgufFile::FromBytes(std::string(b.begin(), b.end())).ok());
  // data_start + offset wraps to 0: the tensor was read from the header (the magic onwards),
  // through a pointer computed past the end of the address space.
  const uint64_t wrap = uint64_t{0} - data_start;
  std::memcpy(b.data() + data_start - 8, &wrap, 8);
  auto f = GgufFile::FromBytes(std::string(b.begin(), b.end()), "wrap.gguf");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("wrap.gguf: GGUF truncated: tensor t"), std::string::npos)
      << f.status();

  GgufWriter big;
  big.AddTensor("huge", {int64_t{1} << 40, int64_t{1} << 40}, static_cast<uint32_t>(GgmlType::kF32),
                std::vector<uint8_t>(16, 0));
  auto h = GgufFile::FromBytes([&] {
    auto v = big.Finish();
    return std::string(v.begin(), v.end());
  }());
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("tensor huge has over 2^56 elements"), std::string::npos)
      << h.status();

  // Header: magic, version 3, 1000 tensors, no metadata, then 1000 zero bytes (a count up
  // to the file size passed before, and was reserved: 80 bytes per byte of file).
  std::vector<uint8_t> many = GgufWriter().Finish(1);
  many.resize(many.size() + 1000, 0);
  const uint64_t n = 1000;
  std::memcpy(many.data() + 8, &n, 8);
  auto m = GgufFile::FromBytes(std::string(many.begin(), many.end()));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("1000 tensor infos need at least 32 bytes each"),
            std::string::npos)
      << m.status();

  // An array of 100 u64 (8 bytes each) with 100 bytes left.
  GgufWriter arr;
  arr.AddStringArray("a", {});
  std::vector<uint8_t> ab = arr.Finish(1);
  ab.resize(ab.size() + 100, 0);
  const size_t type_at = 24 + 8 + 1 + 4;  // header, key "a", value type: the element type
  const uint32_t u64 = 10;
  const uint64_t len = 100;
  std::memcpy(ab.data() + type_at, &u64, 4);
  std::memcpy(ab.data() + type_at + 4, &len, 8);
  auto a = GgufFile::FromBytes(std::string(ab.begin(), ab.end()));
  ASSERT_FALSE(a.ok());
  EXPECT_NE(
      a.status().message().find("array of 100 elements of type 10 needs at least 8 bytes each"),
      std::string::npos)
      << a.status();
}

TEST(Gguf, ReadsFromMemoryAsFromAFile) {
  const std::vector<uint8_t> bytes = Example().Finish();
  auto f = GgufFile::FromBytes(std::string(bytes.begin(), bytes.end()));
  ASSERT_TRUE(f.ok()) << f.status();
  auto g = GgufFile::Open(WriteTemp(bytes, "mem"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*f)->tensors().size(), (*g)->tensors().size());
  EXPECT_EQ(*(*f)->Dequantize("q41"), *(*g)->Dequantize("q41"));
  EXPECT_EQ(*(*f)->GetStringArray("tokenizer.ggml.tokens"),
            *(*g)->GetStringArray("tokenizer.ggml.tokens"));
}

}  // namespace
}  // namespace kvq::frontend
