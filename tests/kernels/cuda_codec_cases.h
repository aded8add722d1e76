// The block codec ops' test cases, shared by cuda_codec_test (the CPU stand-ins against core's
// codec) and cuda_parity_test (the GPU launchers against the stand-ins): a table of codecs,
// their inputs and core's blocks, and the six ops run on the stand-ins.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/codec.h"
#include "kvq/kernels/cuda_codec.h"
#include "tests/core/test_util.h"

namespace kvq::testing {

inline kernels::cuda::BlockCodec FromOptions(const core::CodecOptions& o) {
  return core::BlockCodecOf(o);
}

inline core::CodecOptions BlockCodecOptions(int d, int G, int kb, int r, int sb, int vb, int vg,
                                            bool rotk = false, bool rotv = false, bool a2 = false) {
  core::CodecOptions o;
  o.head_dim = d;
  o.key_group = G;
  o.key_bits = kb;
  o.rank = r;
  o.side_bits = sb;
  o.value_bits = vb;
  o.value_group = vg;
  o.rotate_keys = rotk;
  o.rotate_values = rotv;
  if (a2) o.value_policy = core::ValuePolicy::kA2;
  return o;
}

inline std::vector<core::CodecOptions> BlockCodecCases() {
  return {
      BlockCodecOptions(64, 32, 2, 4, 8, 2, 32),                // the legacy default
      BlockCodecOptions(64, 128, 3, 4, 4, 2, 64),               // the server's default
      BlockCodecOptions(64, 128, 2, 4, 4, 2, 64, true, false),  // rotated keys (version 3)
      BlockCodecOptions(64, 32, 4, 0, 8, 4, 64, false, true),   // rank 0, rotated values
      BlockCodecOptions(128, 64, 8, 16, 8, 8, 128),             //
      BlockCodecOptions(32, 32, 2, 32, 4, 1, 7),                // full rank, odd value groups
      BlockCodecOptions(96, 64, 3, 5, 4, 3, 96),                // head_dim not a power of two
      BlockCodecOptions(64, 128, 2, 4, 4, 2, 32, false, false, true),  // A^2 per-token widths
      BlockCodecOptions(256, 32, 2, 8, 8, 2, 256, true, true, true),
  };
}

inline std::string CaseName(const core::CodecOptions& o) {
  return o.ToString() + " d" + std::to_string(o.head_dim);
}

inline constexpr int kCodecCaseBlocks = 3;

// Inputs of one codec's case and core's blocks of them (encoded on whatever kernel table is
// active: the reference one in these tests).
struct CodecCase {
  core::CodecOptions o;
  kernels::cuda::BlockCodec c;
  int blocks = kCodecCaseBlocks, n_q = 3;
  int64_t ld = 0;                       // row stride of keys and values, > head_dim
  std::vector<float> keys, values;      // [blocks][G][ld], a few outliers
  std::vector<uint8_t> widths;          // [blocks][G], 1..4 (used with per-token widths)
  std::vector<float> basis_t, basis;    // U^T [r][d] and U [d][r], the same matrix
  std::vector<float> q, hq, uq, probs;  // queries, H q (or q), U^T-like [n_q][r], weights [n_q][T]
  float scale = 0.125f;
  std::vector<std::vector<uint8_t>> key_blocks, value_blocks;  // core's
  int64_t tokens() const { return static_cast<int64_t>(blocks) * o.key_group; }
};

inline CodecCase PrepareCodecCase(const core::CodecOptions& o, uint32_t seed) {
  CodecCase cs;
  cs.o = o;
  cs.c = FromOptions(o);
  const int d = o.head_dim, G = o.key_group, r = o.rank;
  cs.ld = d + 3;
  const size_t n = static_cast<size_t>(cs.blocks) * G * cs.ld;
  cs.keys = Gaussian(n, seed);
  cs.values = Gaussian(n, seed + 1);
  std::mt19937 rng(seed + 2);
  for (int k = 0; k < 3 * cs.blocks; ++k) {
    cs.keys[rng() % n] *= 40.0f;
    cs.values[rng() % n] *= 40.0f;
  }
  cs.widths.resize(static_cast<size_t>(cs.blocks) * G);
  for (auto& w : cs.widths) w = static_cast<uint8_t>(1 + rng() % 4);
  cs.basis_t = Gaussian(static_cast<size_t>(r) * d, seed + 3, 0.2f);
  cs.basis.resize(cs.basis_t.size());
  for (int j = 0; j < r; ++j)
    for (int c = 0; c < d; ++c) cs.basis[c * r + j] = cs.basis_t[j * d + c];
  cs.q = Gaussian(static_cast<size_t>(cs.n_q) * d, seed + 4);
  cs.hq = cs.q;
  if (o.rotate_keys) core::HadamardRotateRows(cs.hq.data(), d, cs.n_q, d);
  cs.uq = Gaussian(static_cast<size_t>(cs.n_q) * std::max(r, 1), seed + 5);
  cs.probs = Gaussian(static_cast<size_t>(cs.n_q) * cs.tokens(), seed + 6);
  for (int b = 0; b < cs.blocks; ++b) {
    const size_t at = static_cast<size_t>(b) * G * cs.ld;
    std::vector<uint8_t> k, v;
    EXPECT_TRUE(core::EncodeKeyBlockT(o, cs.keys.data() + at, cs.ld,
                                      r > 0 ? cs.basis_t.data() : nullptr, &k)
                    .ok());
    EXPECT_TRUE(core::EncodeValueBlock(o, cs.values.data() + at, cs.ld,
                                       o.per_token_value_bits() ? &cs.widths[b * G] : nullptr, &v)
                    .ok());
    cs.key_blocks.push_back(std::move(k));
    cs.value_blocks.push_back(std::move(v));
  }
  return cs;
}

// What the six ops give for a case: blocks encoded from its inputs; decodes [blocks][G][d],
// scores [n_q][T] and the readout [n_q][d] (starting from 0.5) of core's blocks.
struct CodecResults {
  std::vector<std::vector<uint8_t>> key_blocks, value_blocks;
  std::vector<float> keys, values, scores, readout;
  int flags = 0;
};

// Pointer arrays over a case's buffers, and the six ops' params filled from them; the
// pointers are the given base addresses (host buffers for the stand-ins, device copies for the
// launchers) plus the case's offsets.
struct CodecCaseParams {
  kernels::cuda::EncodeKeyParams ek;
  kernels::cuda::EncodeValueParams ev;
  kernels::cuda::DecodeKeyParams dk;
  kernels::cuda::DecodeValueParams dv;
  kernels::cuda::ScoreBlocksParams sc;
  kernels::cuda::ReadoutBlocksParams ro;
};

// Host buffers of every op's inputs and outputs for one case; outputs start as garbage.
struct CodecCaseBuffers {
  std::vector<uint8_t> key_out, value_out, key_in, value_in;  // blocks back to back
  std::vector<int64_t> key_out_at, value_out_at, key_in_at, value_in_at;
  std::vector<float> dec_k, dec_v, scores, readout;
  explicit CodecCaseBuffers(const CodecCase& cs) {
    const int G = cs.o.key_group, d = cs.o.head_dim;
    for (int b = 0; b < cs.blocks; ++b) {
      key_out_at.push_back(static_cast<int64_t>(key_out.size()));
      key_out.resize(key_out.size() + kernels::cuda::KeyBlockSize(cs.c) + 1, 0xA5);  // odd sizes
      value_out_at.push_back(static_cast<int64_t>(value_out.size()));
      value_out.resize(value_out.size() + cs.value_blocks[b].size() + 1, 0x5A);
      key_in_at.push_back(static_cast<int64_t>(key_in.size()));
      key_in.insert(key_in.end(), cs.key_blocks[b].begin(), cs.key_blocks[b].end());
      value_in_at.push_back(static_cast<int64_t>(value_in.size()));
      value_in.insert(value_in.end(), cs.value_blocks[b].begin(), cs.value_blocks[b].end());
    }
    dec_k.assign(static_cast<size_t>(cs.blocks) * G * d, std::nanf(""));
    dec_v = dec_k;
    scores.assign(static_cast<size_t>(cs.n_q) * cs.tokens(), std::nanf(""));
    readout.assign(static_cast<size_t>(cs.n_q) * d, 0.5f);
  }
};

// The addresses (host or device) of a case's buffers, as the ops' params take them.
struct CodecCaseAddresses {
  const float *keys, *values, *basis_t, *basis, *hq, *uq, *probs;
  const uint8_t* widths;
  uint8_t *key_out, *value_out;
  const uint8_t *key_in, *value_in;
  float *dec_k, *dec_v, *scores, *readout;
  int* flags;
};

// Pointer arrays (to be placed where the ops read them: host, or copied to the device) and the
// params that point at them. `arrays` receives the pointer values in this order: keys, values,
// basis_t, widths, key_out, value_out, basis, key_in, value_in, dec_k, dec_v (blocks each).
inline std::vector<const void*> PointerArrays(const CodecCase& cs, const CodecCaseBuffers& buf,
                                              const CodecCaseAddresses& a) {
  const int G = cs.o.key_group, d = cs.o.head_dim, r = cs.o.rank;
  std::vector<const void*> v;
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.keys + b * G * cs.ld);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.values + b * G * cs.ld);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(r > 0 ? a.basis_t : nullptr);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.widths + b * G);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.key_out + buf.key_out_at[b]);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.value_out + buf.value_out_at[b]);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(r > 0 ? a.basis : nullptr);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.key_in + buf.key_in_at[b]);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.value_in + buf.value_in_at[b]);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.dec_k + static_cast<int64_t>(b) * G * d);
  for (int b = 0; b < cs.blocks; ++b) v.push_back(a.dec_v + static_cast<int64_t>(b) * G * d);
  return v;
}

// The params of the six ops over addresses `a`, with the pointer arrays at `arrays` (the
// PointerArrays values, where the ops will read them).
inline CodecCaseParams ParamsOf(const CodecCase& cs, const CodecCaseAddresses& a,
                                const void* const* arrays) {
  namespace kc = kernels::cuda;
  const int n = cs.blocks, d = cs.o.head_dim;
  auto at = [&](int k) { return arrays + static_cast<ptrdiff_t>(k) * n; };
  CodecCaseParams p;
  p.ek.codec = cs.c;
  p.ek.blocks = n;
  p.ek.keys = reinterpret_cast<const float* const*>(at(0));
  p.ek.ld = cs.ld;
  p.ek.basis_t = reinterpret_cast<const float* const*>(at(2));
  p.ek.out = const_cast<uint8_t* const*>(reinterpret_cast<const uint8_t* const*>(at(4)));
  p.ev.codec = cs.c;
  p.ev.blocks = n;
  p.ev.values = reinterpret_cast<const float* const*>(at(1));
  p.ev.ld = cs.ld;
  p.ev.widths = reinterpret_cast<const uint8_t* const*>(at(3));
  p.ev.out = const_cast<uint8_t* const*>(reinterpret_cast<const uint8_t* const*>(at(5)));
  p.dk = {cs.c,
          n,
          reinterpret_cast<const uint8_t* const*>(at(7)),
          reinterpret_cast<const float* const*>(at(6)),
          const_cast<float* const*>(reinterpret_cast<const float* const*>(at(9))),
          d,
          a.flags};
  p.dv = {cs.c,
          n,
          reinterpret_cast<const uint8_t* const*>(at(8)),
          const_cast<float* const*>(reinterpret_cast<const float* const*>(at(10))),
          d,
          a.flags};
  p.sc = {cs.c,     n,        reinterpret_cast<const uint8_t* const*>(at(7)),
          cs.n_q,   a.hq,     cs.o.rank > 0 ? a.uq : nullptr,
          cs.scale, a.scores, cs.tokens(),
          a.flags};
  p.ro = {cs.c,      n,       reinterpret_cast<const uint8_t* const*>(at(8)),
          cs.n_q,    a.probs, cs.tokens(),
          a.readout, d,       a.flags};
  return p;
}

inline int64_t ValueBlockBytesOf(const CodecCase& cs, int b) {
  return static_cast<int64_t>(cs.value_blocks[b].size());
}

// Copies the ops' outputs out of the buffers into results.
inline CodecResults Collect(const CodecCase& cs, const CodecCaseBuffers& buf, int flags) {
  CodecResults r;
  for (int b = 0; b < cs.blocks; ++b) {
    const auto k0 = buf.key_out.begin() + buf.key_out_at[b];
    r.key_blocks.emplace_back(k0, k0 + kernels::cuda::KeyBlockSize(cs.c));
    const auto v0 = buf.value_out.begin() + buf.value_out_at[b];
    r.value_blocks.emplace_back(v0, v0 + ValueBlockBytesOf(cs, b));
  }
  r.keys = buf.dec_k;
  r.values = buf.dec_v;
  r.scores = buf.scores;
  r.readout = buf.readout;
  r.flags = flags;
  return r;
}

// The six ops on the CPU stand-ins.
inline CodecResults RunStandIns(const CodecCase& cs) {
  namespace kc = kernels::cuda;
  CodecCaseBuffers buf(cs);
  int flags = 0;
  const CodecCaseAddresses a{cs.keys.data(),
                             cs.values.data(),
                             cs.basis_t.data(),
                             cs.basis.data(),
                             cs.hq.data(),
                             cs.uq.data(),
                             cs.probs.data(),
                             cs.widths.data(),
                             buf.key_out.data(),
                             buf.value_out.data(),
                             buf.key_in.data(),
                             buf.value_in.data(),
                             buf.dec_k.data(),
                             buf.dec_v.data(),
                             buf.scores.data(),
                             buf.readout.data(),
                             &flags};
  const std::vector<const void*> arrays = PointerArrays(cs, buf, a);
  const CodecCaseParams p = ParamsOf(cs, a, arrays.data());
  EXPECT_EQ(kc::EncodeKeysOnHost(p.ek), 0);
  EXPECT_EQ(kc::EncodeValuesOnHost(p.ev), 0);
  EXPECT_EQ(kc::DecodeKeysOnHost(p.dk), 0);
  EXPECT_EQ(kc::DecodeValuesOnHost(p.dv), 0);
  EXPECT_EQ(kc::ScoreBlocksOnHost(p.sc), 0);
  EXPECT_EQ(kc::ReadoutBlocksOnHost(p.ro), 0);
  return Collect(cs, buf, flags);
}

}  // namespace kvq::testing
