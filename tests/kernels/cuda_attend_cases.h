// The cases of the CUDA attend's tests (cuda_math_test on the CPU, cuda_parity_test on a GPU):
// real blocks encoded by core's LayerCache, the kernel's inputs, and core's CPU attend as the
// answer. The kernel attends over the encoded blocks only; CompleteOnCpu merges its partial
// with the CPU's over the fp16 sinks and the full-precision window, as a store reading from
// GPU memory would, so the comparison is with LayerCache::Attend over the whole cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/partial_attention.h"
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/kernels.h"
#include "tests/core/test_util.h"

namespace kvq::testing {

struct AttendCase {
  std::string name;
  core::CodecOptions o;
  int kv = 2;  // KV heads: the kernel's items
  int gq = 3;  // query heads per KV head: the kernel's rows
  int nb = 1;  // encoded blocks per head
  int W = 0;   // tokens in the full-precision window (the incomplete group)
};

inline core::CodecOptions Codec(int d, int kb, int G, int r, int sb, int vb, int vg) {
  core::CodecOptions o;
  o.head_dim = d;
  o.key_bits = kb;
  o.key_group = G;
  o.rank = r;
  o.side_bits = sb;
  o.value_bits = vb;
  o.value_group = vg;
  return o;
}

// The server's default codec, the legacy default, an A^2 frontier codec, the levers
// (rotations, fp16 sinks), rank 0, 8-bit and 1-bit widths; head_dim 64, 128 and others;
// 1, 31 and 33 blocks; GQA groups of 3 (SmolLM2), 7 (Qwen2.5-0.5B) and 12.
inline std::vector<AttendCase> AttendCases() {
  auto a2 = [](core::CodecOptions o, float budget) {
    o.value_policy = core::ValuePolicy::kA2;
    o.value_budget = budget;
    return o;
  };
  auto lever = [](core::CodecOptions o, bool rotk, bool rotv, int sinks) {
    o.rotate_keys = rotk;
    o.rotate_values = rotv;
    o.fp16_sinks = sinks;
    return o;
  };
  return {
      {"default k3g128-r4s4-v2 d128", Codec(128, 3, 128, 4, 4, 2, 32), 2, 3, 33, 77},
      {"default k3g128-r4s4-v2 d64 1 block", Codec(64, 3, 128, 4, 4, 2, 32), 2, 3, 1, 0},
      {"legacy k2g32-r4s8-v2 d64", Codec(64, 2, 32, 4, 8, 2, 32), 3, 3, 31, 5},
      {"legacy k2g32-r4s8-v2 d128 gq7", Codec(128, 2, 32, 4, 8, 2, 32), 2, 7, 33, 0},
      {"a2 k2g128-r4s8-a2b2 d128", a2(Codec(128, 2, 128, 4, 8, 2, 32), 2.0f), 2, 3, 5, 3},
      {"a2 k3g64-r4s4-a2b3 d64 gq12", a2(Codec(64, 3, 64, 4, 4, 2, 32), 3.0f), 2, 12, 9, 1},
      {"k3g128-r4s8-v3g64-rotk-sink4 d128", lever(Codec(128, 3, 128, 4, 8, 3, 64), true, false, 4),
       2, 3, 4, 10},
      {"k2g128-r0-v2g64-rotk-rotv d64", lever(Codec(64, 2, 128, 0, 4, 2, 64), true, true, 0), 2, 3,
       3, 0},
      {"k4g64-r0-v4 d96", Codec(96, 4, 64, 0, 4, 4, 32), 2, 4, 7, 9},
      // d 96: 96 threads, fewer than the 128 tokens of a block.
      {"a2 k3g128-r4s4-a2b2 d96", a2(Codec(96, 3, 128, 4, 4, 2, 32), 2.0f), 2, 3, 3, 0},
      {"k8g32-r8s8-v8g64 d256", Codec(256, 8, 32, 8, 8, 8, 64), 1, 2, 5, 2},
      {"k2g32-r2s4-v1g16 d32", Codec(32, 2, 32, 2, 4, 1, 16), 2, 5, 3, 31},
      // The GQA ratios at the ends of the range: 1 (one query row per KV head) and 8
      // (the tensor-core program's most rows).
      {"default k3g128-r4s4-v2 d128 gq1", Codec(128, 3, 128, 4, 4, 2, 32), 4, 1, 6, 3},
      {"default k3g128-r4s4-v2 d64 gq8", Codec(64, 3, 128, 4, 4, 2, 32), 1, 8, 4, 9},
  };
}

// A case's cache, its blocks gathered into one buffer at odd offsets (as a slab pool may place
// them; 16 bytes of slack either side so the kernel's aligned 16-byte loads stay inside), the
// queries in the forms the kernel takes, and the CPU's answer.
struct PreparedAttend {
  AttendCase cs;
  std::unique_ptr<core::LayerCache> cache;
  std::vector<float> k, v;               // the appended rows [kv][T][d]
  std::vector<uint8_t> pool;             // the blocks
  std::vector<size_t> key_at, value_at;  // [kv][nb] offsets into pool
  std::vector<float> q, q_base, uq;      // [kv*gq][d], the same (H q for rotated keys), [kv*gq][r]
  std::vector<float> want;               // LayerCache::Attend, [kv*gq][d]
  float vmax = 0.0f;
  int rows() const { return cs.gq; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(cs.o.head_dim)); }
};

inline PreparedAttend Prepare(const AttendCase& cs) {
  PreparedAttend pa;
  pa.cs = cs;
  const core::CodecOptions& o = cs.o;
  const int d = o.head_dim, G = o.key_group, r = o.rank, kv = cs.kv, qh = kv * cs.gq;
  const int64_t T = static_cast<int64_t>(cs.nb) * G + cs.W;
  const core::ModelBasis b = core::RandomBasis({"t", 1, 1, kv, qh, d, std::max(r, 1)}, 3);
  pa.cache = std::make_unique<core::LayerCache>(o, kv, r > 0 ? b.u.data() : nullptr);
  pa.cache->set_sealing(true);
  pa.k = Gaussian(kv * T * d, 11);
  pa.v = Gaussian(kv * T * d, 12);
  for (float x : pa.v) pa.vmax = std::max(pa.vmax, std::fabs(x));
  if (!pa.cache->Append(View3(pa.k, kv, T, d), View3(pa.v, kv, T, d), 0).ok()) return pa;
  // Every key and value block, each at an odd offset after the previous one.
  const auto& sealed = pa.cache->sealed();
  pa.pool.assign(16, 0xA5);
  pa.key_at.resize(static_cast<size_t>(kv) * cs.nb);
  pa.value_at.resize(pa.key_at.size());
  for (int h = 0; h < kv; ++h)
    for (int blk = 0; blk < cs.nb && blk < static_cast<int>(sealed.size()); ++blk) {
      for (int kind = 0; kind < 2; ++kind) {
        const auto span = kind == 0 ? sealed[blk]->key(h) : sealed[blk]->value(h);
        pa.pool.push_back(0x5A);  // odd offsets
        (kind == 0 ? pa.key_at : pa.value_at)[static_cast<size_t>(h) * cs.nb + blk] =
            pa.pool.size();
        pa.pool.insert(pa.pool.end(), span.begin(), span.end());
      }
    }
  pa.pool.resize(pa.pool.size() + 32, 0xA5);
  pa.q = Gaussian(static_cast<size_t>(qh) * d, 13, 2.0f);
  pa.q_base = pa.q;
  if (o.rotate_keys) core::HadamardRotateRows(pa.q_base.data(), d, qh, d);
  if (r > 0) {
    pa.uq.assign(static_cast<size_t>(qh) * r, 0.0f);
    for (int i = 0; i < qh; ++i) {
      const float* U = b.u.data() + static_cast<size_t>(i / cs.gq) * d * r;
      for (int c = 0; c < d; ++c)
        for (int j = 0; j < r; ++j) pa.uq[i * r + j] += pa.q[i * d + c] * U[c * r + j];
    }
  }
  // The answer on the scalar reference kernels (the definition of correct; the AVX-512 tables
  // round attention weights to int16 on some paths).
  core::AttendOptions ao;
  ao.observe = false;
  pa.want.resize(pa.q.size());
  kernels::SetActive(&kernels::Ref());
  if (!pa.cache->Attend(pa.q.data(), qh, 1, ao, pa.want.data()).ok()) pa.want.clear();
  kernels::SetActive(nullptr);
  return pa;
}

// The kernel's params for a prepared case, over the given block pointers and buffers (host or
// device addresses alike).
inline kernels::cuda::AttendParams ParamsFor(const PreparedAttend& pa,
                                             const uint8_t* const* key_blocks,
                                             const uint8_t* const* value_blocks, const float* q,
                                             const float* uq, float* out, float* mx, float* sum) {
  const core::CodecOptions& o = pa.cs.o;
  kernels::cuda::AttendParams p;
  p.codec = core::BlockCodecOf(o);
  p.items = pa.cs.kv;
  p.rows = pa.cs.gq;
  p.blocks = pa.cs.nb;
  p.key_blocks = key_blocks;
  p.value_blocks = value_blocks;
  p.block_stride = pa.cs.nb;
  p.q = q;
  p.uq = o.rank > 0 ? uq : nullptr;
  p.scale = pa.scale();
  p.masked_prefix = o.fp16_sinks;
  p.out = out;
  p.out_max = mx;
  p.out_sum = sum;
  return p;
}

// Merges the kernel's result over the blocks (out normalized, its max and sum) with the CPU's
// partials over the fp16 sinks and the window, and rotates rotated values back: the attend
// output [kv*gq][d] over the whole cache.
inline std::vector<float> CompleteOnCpu(const PreparedAttend& pa, const std::vector<float>& out,
                                        const std::vector<float>& mx,
                                        const std::vector<float>& sum) {
  const core::CodecOptions& o = pa.cs.o;
  const int d = o.head_dim, G = o.key_group, kv = pa.cs.kv, gq = pa.cs.gq, R = kv * gq;
  const int64_t T = static_cast<int64_t>(pa.cs.nb) * G + pa.cs.W;
  std::vector<float> blocks_out = out;
  if (o.rotate_values) core::HadamardRotateRows(blocks_out.data(), d, R, d);
  // Parts: 0 the kernel's, 1 the sinks, 2 the window.
  constexpr int P = 3;
  std::vector<float> m(P * R, -std::numeric_limits<float>::infinity()), l(P * R, 0.0f),
      po(static_cast<size_t>(P) * R * d, 0.0f);
  auto add_part = [&](int part, int row, const std::vector<float>& keys,
                      const std::vector<float>& values, int n) {
    if (n == 0) return;
    std::vector<float> s(n);
    float mx_row = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) {
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += pa.q[static_cast<size_t>(row) * d + c] * keys[t * d + c];
      s[t] = pa.scale() * dot;
      mx_row = std::max(mx_row, s[t]);
    }
    float den = 0.0f;
    float* o_row = po.data() + (static_cast<size_t>(part) * R + row) * d;
    for (int t = 0; t < n; ++t) {
      const float e = std::exp(s[t] - mx_row);
      den += e;
      for (int c = 0; c < d; ++c) o_row[c] += e * values[t * d + c];
    }
    m[part * R + row] = mx_row;
    l[part * R + row] = den;
  };
  for (int row = 0; row < R; ++row) {
    const int h = row / gq;
    m[row] = mx[row];
    l[row] = sum[row];
    for (int c = 0; c < d; ++c)
      po[static_cast<size_t>(row) * d + c] = blocks_out[row * d + c] * sum[row];
    const auto& sinks = pa.cache->sinks();
    if (sinks && pa.cs.nb > 0) {
      const int S = sinks->sinks;
      std::vector<float> sk(static_cast<size_t>(S) * d), sv(sk.size());
      for (int t = 0; t < S; ++t) {
        core::ToFloat(core::DType::kF16, sinks->key(h, t), sk.data() + t * d, d);
        core::ToFloat(core::DType::kF16, sinks->value(h, t), sv.data() + t * d, d);
      }
      add_part(1, row, sk, sv, S);
    }
    const int64_t w0 = static_cast<int64_t>(pa.cs.nb) * G;
    std::vector<float> wk(pa.k.begin() + (h * T + w0) * d, pa.k.begin() + (h * T + T) * d);
    std::vector<float> wv(pa.v.begin() + (h * T + w0) * d, pa.v.begin() + (h * T + T) * d);
    add_part(2, row, wk, wv, pa.cs.W);
  }
  std::vector<float> full(static_cast<size_t>(R) * d);
  core::MergePartials(m.data(), l.data(), po.data(), P, R, d, full.data());
  return full;
}

// The largest |got - want| over the elements.
inline float WorstError(const std::vector<float>& got, const std::vector<float>& want) {
  float worst = got.size() == want.size() ? 0.0f : std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    worst = std::max(worst, std::isfinite(got[i]) ? std::fabs(got[i] - want[i])
                                                  : std::numeric_limits<float>::infinity());
  return worst;
}

}  // namespace kvq::testing
