// The fused decode attend's arithmetic and index mapping (attend.cu), as __host__ __device__
// functions: the CUDA kernels run one thread block's program (AttendCta, DenseCta) with a
// barrier between its phases, and tests/core/cuda_math_test.cc runs the very same program on
// the CPU, every phase for every thread in turn, over the whole grid, so that CI without a GPU
// checks the kernels' math, shared-memory layout and block parsing against core's CPU attend.
//
// A thread block's program is a sequence of phases; a phase is a function of (thread index,
// that thread's registers) that reads what earlier phases wrote to shared memory and never
// what other threads write in the same phase. `Cta` runs a phase: on the GPU each thread runs
// it and then __syncthreads(); on the CPU a loop runs it for thread 0, 1, ... in turn.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvq/kernels/cuda.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifdef __CUDACC__
#define KVQ_HD __host__ __device__ inline
#else
#define KVQ_HD inline
#endif
#ifdef __CUDA_ARCH__
#define KVQ_UNROLL _Pragma("unroll")
#else
#define KVQ_UNROLL
#endif

namespace kvq::kernels::cuda::attend_math {

inline constexpr int kHeaderBytes = 16;
// The attend's readout: each thread sums 4 adjacent channels (one load of their codes); its
// scores: each thread scores 4 adjacent tokens (one load of their codes, q read once).
inline constexpr int kChannelsPerThread = 4;
inline constexpr int kTokensPerThread = 4;
inline constexpr float kNegInf = -__builtin_huge_valf();

// 16 bytes, the unit of every global load of the staging phases.
struct alignas(16) Vec16 {
  uint32_t w[4];
};

KVQ_HD float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE fp16 bits to fp32 (exact, so the same on both sides): the GPU's conversion, or bit
// manipulation on the host.
KVQ_HD float HalfToFloat(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

// Little-endian u16 at any byte address (records of odd size sit at odd addresses).
KVQ_HD uint32_t LoadU16(const uint8_t* p) { return p[0] | (static_cast<uint32_t>(p[1]) << 8); }
KVQ_HD float LoadHalf(const uint8_t* p) { return HalfToFloat(static_cast<uint16_t>(LoadU16(p))); }

// The 32 bits from byte address p on (little-endian), by two aligned 4-byte loads: p lies in a
// 4-aligned staging buffer that may be read up to 8 bytes past p. Codes are unpacked from it
// by shifts: code i of b bits (LSB-first, codec.h) starts at bit i*b of its row.
KVQ_HD uint32_t Window32(const uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t base = a & ~static_cast<uintptr_t>(3);
#ifdef __CUDA_ARCH__
  const uint32_t* w = reinterpret_cast<const uint32_t*>(base);
  const uint64_t v = (static_cast<uint64_t>(w[1]) << 32) | w[0];
#else
  uint64_t v;
  std::memcpy(&v, reinterpret_cast<const void*>(base), 8);  // little-endian hosts
#endif
  return static_cast<uint32_t>(v >> (8 * (a & 3)));
}

// A code (< 2^23) as a float without an int-to-float conversion (a quarter-rate instruction
// or slower on GPUs): 2^23 + code has the code as its mantissa; subtracting 2^23 is exact.
KVQ_HD float CodeToFloat(uint32_t code) { return BitsToFloat(0x4B000000u | code) - 8388608.0f; }

KVQ_HD int RowBytes(int n, int bits) { return (n * bits + 7) / 8; }
KVQ_HD float Max(float a, float b) { return a > b ? a : b; }
KVQ_HD float Exp(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return __builtin_expf(x);
#endif
}
KVQ_HD int RoundUp16(int n) { return (n + 15) & ~15; }

// Blocks [*b0, *b1) of range k of `splits` over n blocks (LayerCache::AttendPartBounds' rule).
KVQ_HD void SplitRange(int n, int splits, int k, int* b0, int* b1) {
  *b0 = static_cast<int>(static_cast<int64_t>(n) * k / splits);
  *b1 = static_cast<int>(static_cast<int64_t>(n) * (k + 1) / splits);
}

// Threads per thread block for head_dim d: 128 when d divides it, else d (d a multiple of 32);
// either way a multiple of d / 4 (the readout's channel quads) and of G / 4 (the scores'
// token quads).
KVQ_HD int ThreadsFor(int d) { return d <= 128 && 128 % d == 0 ? 128 : d; }

// Where everything sits: block byte offsets (codec.h) and the thread block's shared memory
// (byte offsets, each 16-aligned).
struct Geometry {
  int d, G, rows, rank, key_bits, side_bits, value_bits, value_group, ng;
  int key_row, side_row;  // bytes of one channel's codes over the G tokens
  int k_scale, k_zero, k_codes, s_scale, s_zero, s_codes, key_bytes;
  int value_tags;       // bytes of per-token width tags (0: uniform widths)
  int value_rec;        // bytes of one token record with uniform widths
  int value_bytes_max;  // the largest value block
  // threads; readout: slices of the tokens per channel quad; scores: slices of the channels
  // per token quad.
  int threads, slices, key_slices;
  int sm_q, sm_uq, sm_kscale, sm_kzero, sm_sscale, sm_szero, sm_vscale, sm_vzero, sm_width, sm_off,
      sm_part, sm_p, sm_m, sm_lred, sm_corr, sm_kstage, sm_vstage, sm_red, sm_bytes;
};

KVQ_HD Geometry MakeGeometry(const AttendParams& p) {
  Geometry g{};
  g.d = p.head_dim;
  g.G = p.key_group;
  g.rows = p.rows;
  g.rank = p.rank;
  g.key_bits = p.key_bits;
  g.side_bits = p.rank > 0 ? p.side_bits : 0;
  g.value_bits = p.value_bits;
  g.value_group = p.value_group;
  g.ng = (p.head_dim + p.value_group - 1) / p.value_group;
  g.key_row = RowBytes(g.G, g.key_bits);
  g.side_row = g.rank > 0 ? RowBytes(g.G, g.side_bits) : 0;
  g.k_scale = kHeaderBytes;
  g.k_zero = g.k_scale + 2 * g.d;
  g.k_codes = g.k_zero + 2 * g.d;
  g.s_scale = g.k_codes + g.d * g.key_row;
  g.s_zero = g.s_scale + 2 * g.rank;
  g.s_codes = g.s_zero + 2 * g.rank;
  g.key_bytes = g.s_codes + g.rank * g.side_row;
  g.value_tags = g.value_bits == 0 ? (g.G + 3) / 4 : 0;
  g.value_rec = g.value_bits == 0 ? 0 : 4 * g.ng + RowBytes(g.d, g.value_bits);
  g.value_bytes_max = g.value_bits == 0
                          ? kHeaderBytes + g.value_tags + g.G * (4 * g.ng + RowBytes(g.d, 4))
                          : kHeaderBytes + g.G * g.value_rec;
  g.threads = ThreadsFor(g.d);
  g.slices = g.threads / (g.d / kChannelsPerThread);
  g.key_slices = g.threads / (g.G / kTokensPerThread);
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += RoundUp16(bytes);
    return o;
  };
  g.sm_q = take(4 * g.rows * g.d);
  g.sm_uq = take(4 * g.rows * g.rank);
  g.sm_kscale = take(4 * g.d);
  g.sm_kzero = take(4 * g.d);
  g.sm_sscale = take(4 * g.rank);
  g.sm_szero = take(4 * g.rank);
  g.sm_vscale = take(4 * g.G * g.ng);
  g.sm_vzero = take(4 * g.G * g.ng);
  g.sm_width = take(4 * g.G);
  g.sm_off = take(4 * (g.G + 1));  // + the block's total size
  g.sm_part = take(4 * g.key_slices * g.rows * g.G);
  g.sm_p = take(4 * g.rows * g.G);
  g.sm_m = take(4 * g.rows);
  g.sm_lred = take(4 * g.slices * g.rows);
  g.sm_corr = take(4 * g.rows);
  g.sm_kstage = take(g.key_bytes + 32);  // + the 16-byte alignment slack either side
  g.sm_vstage = take(g.value_bytes_max + 32);
  // The slices' sums, needed only after the last block: in the staging buffers when they fit.
  const int red = 4 * g.slices * g.rows * g.d;
  g.sm_red = red <= at - g.sm_kstage ? g.sm_kstage : take(red);
  g.sm_bytes = at;
  return g;
}

KVQ_HD Vec16 Load16(const Vec16* p) {
#ifdef __CUDA_ARCH__
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  return {{v.x, v.y, v.z, v.w}};
#else
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// 16-byte loads each thread keeps in flight while staging (8 x 128 threads: 16 KiB a block).
inline constexpr int kStageBatch = 8;

// Copies bytes [a, a + na) and [b, b + nb) into shared memory at da and db with aligned
// 16-byte loads (sources at any address: the 16-byte words that cover them, so that byte x
// lands at da + (x - a) + (a & 15)). Thread tid's share: it issues up to kStageBatch loads, runs
// `while_loading` (work that needs none of them) once, then stores them, and so on.
template <class F>
KVQ_HD void StageTwo(const uint8_t* a, int na, uint8_t* da, const uint8_t* b, int nb, uint8_t* db,
                     int tid, int threads, F&& while_loading) {
  const uintptr_t ua = reinterpret_cast<uintptr_t>(a), ub = reinterpret_cast<uintptr_t>(b);
  const int wa = (static_cast<int>(ua & 15u) + na + 15) >> 4;
  const int wb = (static_cast<int>(ub & 15u) + nb + 15) >> 4;
  const Vec16* fa = reinterpret_cast<const Vec16*>(ua & ~static_cast<uintptr_t>(15));
  const Vec16* fb = reinterpret_cast<const Vec16*>(ub & ~static_cast<uintptr_t>(15));
  Vec16* ta = reinterpret_cast<Vec16*>(da);
  Vec16* tb = reinterpret_cast<Vec16*>(db);
  const int total = wa + wb;
  bool first = true;
  for (int i0 = tid; i0 < total || first; i0 += threads * kStageBatch) {
    Vec16 r[kStageBatch] = {};
    KVQ_UNROLL
    for (int k = 0; k < kStageBatch; ++k) {
      const int i = i0 + k * threads;
      if (i < total) r[k] = Load16(i < wa ? fa + i : fb + (i - wa));
    }
    if (first) {
      while_loading();
      first = false;
    }
    KVQ_UNROLL
    for (int k = 0; k < kStageBatch; ++k) {
      const int i = i0 + k * threads;
      if (i < wa)
        ta[i] = r[k];
      else if (i < total)
        tb[i - wa] = r[k];
    }
  }
}

// A key or value block header against the params (codec.h): magic, a readable version, kind,
// the rotation flag, widths, tokens, head_dim and rank / value_group.
KVQ_HD bool HeaderMatches(const uint8_t* h, int kind, bool rotated, int bits, int side_bits,
                          int tokens, int head_dim, int extra) {
  const int version = h[2], flags = h[3] & 0xF0;
  return LoadU16(h) == 0x514bu && version >= 1 && version <= 3 && (h[3] & 0x0F) == kind &&
         flags == (rotated ? 0x10 : 0) && (version == 3) == (flags != 0) && h[4] == bits &&
         h[5] == side_bits && static_cast<int>(LoadU16(h + 6)) == tokens &&
         static_cast<int>(LoadU16(h + 8)) == head_dim && static_cast<int>(LoadU16(h + 10)) == extra;
}

// Width tag of token t in a per-token value block: 1..4 bits.
KVQ_HD int TokenWidth(const uint8_t* tags, int t) {
  return ((tags[t >> 2] >> (2 * (t & 3))) & 3) + 1;
}

// Part of the scores of tokens 4 tq .. 4 tq + 3 over key slice ks (channels
// [ks d / KS, (ks+1) d / KS), side coefficients [ks r / KS, (ks+1) r / KS)), for every row:
//   part[j][i] = sum_c q_ic (z_c + s_c code(c, t_j)) + sum_c sign uq_ic (sz_c + ss_c code_c(t_j)).
// qs [rows][d], uqs [rows][r] (side_sign folded in), scales/zeros fp32; kb the staged block.
template <int MaxRows>
KVQ_HD void ChannelQuadTerms(const uint8_t* rows0, int row_bytes, int bits, int c0, int c1, int tq,
                             const float* q, int ld, int rows, const float* sc, const float* ze,
                             float (&part)[kTokensPerThread][MaxRows]) {
  const int bit = kTokensPerThread * tq * bits, sh = bit & 7;
  const uint32_t mask = (1u << bits) - 1u;
  for (int c = c0; c < c1; ++c) {
    const uint32_t w = Window32(rows0 + c * row_bytes + (bit >> 3)) >> sh;
    const float s = sc[c], z = ze[c];
    float k[kTokensPerThread];
    KVQ_UNROLL
    for (int j = 0; j < kTokensPerThread; ++j) k[j] = z + s * CodeToFloat((w >> (j * bits)) & mask);
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i)
      if (i < rows) {
        const float qi = q[i * ld + c];
        KVQ_UNROLL
        for (int j = 0; j < kTokensPerThread; ++j) part[j][i] += qi * k[j];
      }
  }
}

template <int MaxRows>
KVQ_HD void KeyQuadPart(const Geometry& g, const uint8_t* kb, const float* qs, const float* uqs,
                        const float* ksc, const float* kze, const float* ssc, const float* sze,
                        int tq, int ks, float (&part)[kTokensPerThread][MaxRows]) {
  KVQ_UNROLL
  for (int j = 0; j < kTokensPerThread; ++j) {
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) part[j][i] = 0.0f;
  }
  ChannelQuadTerms<MaxRows>(kb + g.k_codes, g.key_row, g.key_bits, g.d * ks / g.key_slices,
                            g.d * (ks + 1) / g.key_slices, tq, qs, g.d, g.rows, ksc, kze, part);
  if (g.rank > 0)
    ChannelQuadTerms<MaxRows>(kb + g.s_codes, g.side_row, g.side_bits, g.rank * ks / g.key_slices,
                              g.rank * (ks + 1) / g.key_slices, tq, uqs, g.rank, g.rows, ssc, sze,
                              part);
}

// Online softmax, phase 1 for row i (thread i < rows): the block's logits s [rows][n] (-inf:
// no weight) raise the row's running max m; corr = exp(m_old - m_new) rescales what the row
// has summed so far (0 before its first token, whose sums are still 0).
KVQ_HD void RowMaxPhase(int tid, int rows, int n, const float* s, float* m, float* corr) {
  if (tid >= rows) return;
  float bm = kNegInf;
  for (int t = 0; t < n; ++t) bm = Max(bm, s[tid * n + t]);
  const float mo = m[tid], mn = Max(mo, bm);
  corr[tid] = mo == kNegInf ? 0.0f : Exp(mo - mn);
  m[tid] = mn;
}

// Phase 2, element w of [rows][n]: the weight exp(s - m) of a token (0 while a row has seen
// nothing but masked tokens).
KVQ_HD void WeightsPhase(int tid, int threads, int rows, int n, float* s, const float* m) {
  for (int w = tid; w < rows * n; w += threads) {
    const float mi = m[w / n];
    s[w] = mi == kNegInf ? 0.0f : Exp(s[w] - mi);
  }
}

// The merge of one output element over `parts` partials (core::MergePartials, in part order):
// m, l at stride `ms` between parts, o at stride `os`. Writes the normalized output and the
// merged max and sum; a row no part saw gives 0, -inf, 0.
KVQ_HD void MergeElement(const float* m, const float* l, int64_t ms, const float* o, int64_t os,
                         int parts, float* out, float* max_out, float* sum_out) {
  float mx = kNegInf;
  for (int k = 0; k < parts; ++k) mx = Max(mx, m[k * ms]);
  if (mx == kNegInf) {
    *out = 0.0f;
    *max_out = kNegInf;
    *sum_out = 0.0f;
    return;
  }
  float denom = 0.0f, y = 0.0f;
  for (int k = 0; k < parts; ++k) {
    if (m[k * ms] == kNegInf) continue;
    const float w = Exp(m[k * ms] - mx);
    denom += w * l[k * ms];
    y += w * o[k * os];
  }
  *out = y * (1.0f / denom);
  *max_out = mx;
  *sum_out = denom;
}

// Workspace of partials: m, l [items][splits][rows], then o [items][splits][rows][d].
struct Partials {
  float *m, *l, *o;
};
KVQ_HD Partials PartialsIn(void* workspace, int items, int splits, int rows) {
  float* w = static_cast<float*>(workspace);
  const int64_t n = static_cast<int64_t>(items) * splits * rows;
  return {w, w + n, w + 2 * n};
}

template <int MaxRows, int Cpt>
struct ThreadState {
  float acc[Cpt][MaxRows];  // this thread's Cpt channels, summed over its slice of the tokens
  float sum[MaxRows];       // the softmax denominators over the slice (threads of channel 0)
};

// The registers of a thread of each program (its Cta runs phases with them).
template <int MaxRows>
using AttendState = ThreadState<MaxRows, kChannelsPerThread>;
template <int MaxRows>
using DenseState = ThreadState<MaxRows, 1>;

// Rescales a thread's sums by the rows' corr (RowMaxPhase) before a block is added.
template <int MaxRows, int Cpt>
KVQ_HD void RescaleSums(ThreadState<MaxRows, Cpt>& st, int rows, const float* corr) {
  KVQ_UNROLL
  for (int i = 0; i < MaxRows; ++i)
    if (i < rows) {
      KVQ_UNROLL
      for (int j = 0; j < Cpt; ++j) st.acc[j][i] *= corr[i];
      st.sum[i] *= corr[i];
    }
}

// The denominators: the first channel's thread of each slice adds the weights of its tokens.
template <int MaxRows, int Cpt>
KVQ_HD void AddWeights(ThreadState<MaxRows, Cpt>& st, int rows, int cq, int sl, int slices, int n,
                       int stride, const float* pr) {
  if (cq != 0) return;
  for (int t = sl; t < n; t += slices) {
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i)
      if (i < rows) st.sum[i] += pr[i * stride + t];
  }
}

// The end of a thread block: every thread's sums to shared memory (red [slices][rows][d],
// lred [slices][rows]), ...
template <int MaxRows, int Cpt>
KVQ_HD void ReduceSumsPhase(int tid, int rows, int d, const ThreadState<MaxRows, Cpt>& st,
                            float* red, float* lred) {
  const int cq = tid % (d / Cpt), sl = tid / (d / Cpt);
  KVQ_UNROLL
  for (int i = 0; i < MaxRows; ++i)
    if (i < rows) {
      KVQ_UNROLL
      for (int j = 0; j < Cpt; ++j) red[(sl * rows + i) * d + cq * Cpt + j] = st.acc[j][i];
      if (cq == 0) lred[sl * rows + i] = st.sum[i];
    }
}

// ... then summed over the slices into the range's partial (m, l, o).
KVQ_HD void WritePartialPhase(int tid, int threads, int rows, int d, int slices, const float* red,
                              const float* lred, const float* m, float* pm, float* pl, float* po) {
  for (int w = tid; w < rows * d; w += threads) {
    float o = 0.0f;
    for (int sl = 0; sl < slices; ++sl) o += red[sl * rows * d + w];
    po[w] = o;
  }
  if (tid < rows) {
    float l = 0.0f;
    for (int sl = 0; sl < slices; ++sl) l += lred[sl * rows + tid];
    pm[tid] = m[tid];
    pl[tid] = l;
  }
}

// The readout of one block by thread (channel quad cq, token slice sl): for tokens
// t = sl, sl + slices, ... and channels c = 4 cq .. 4 cq + 3,
//   acc[c][i] += p_it (z_tg + s_tg code_t(c)),  g = c / value_group,
// from the staged block vb (off, width: each token record's offset and code width).
template <int MaxRows>
KVQ_HD void ValueQuadSums(const Geometry& g, const uint8_t* vb, const int* off, const int* width,
                          const float* vsc, const float* vze, const float* pr, int cq, int sl,
                          ThreadState<MaxRows, kChannelsPerThread>& st) {
  constexpr int Q = kChannelsPerThread;
  const int c = Q * cq, g0 = c / g.value_group, g3 = (c + Q - 1) / g.value_group;
  for (int t = sl; t < g.G; t += g.slices) {
    const int bits = width[t], bit = c * bits;
    const uint32_t w = Window32(vb + off[t] + 4 * g.ng + (bit >> 3)) >> (bit & 7);
    const uint32_t mask = (1u << bits) - 1u;
    const float* ts = vsc + t * g.ng;
    const float* tz = vze + t * g.ng;
    float v[Q];
    if (g0 == g3) {  // the quad within one scale group (value_group a multiple of 4)
      const float sc = ts[g0], ze = tz[g0];
      KVQ_UNROLL
      for (int j = 0; j < Q; ++j) v[j] = ze + sc * CodeToFloat((w >> (j * bits)) & mask);
    } else {
      KVQ_UNROLL
      for (int j = 0; j < Q; ++j) {
        const int gj = (c + j) / g.value_group;
        v[j] = tz[gj] + ts[gj] * CodeToFloat((w >> (j * bits)) & mask);
      }
    }
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i)
      if (i < g.rows) {
        const float p = pr[i * g.G + t];
        KVQ_UNROLL
        for (int j = 0; j < Q; ++j) st.acc[j][i] += p * v[j];
      }
  }
}

// One thread block of the attend: item `item`, blocks of range `split` of `splits`. `sm`: the
// thread block's shared memory (g.sm_bytes, 16-aligned).
template <int MaxRows, class Cta>
KVQ_HD void AttendCta(Cta& cta, const AttendParams& p, const Geometry& g, uint8_t* sm, int item,
                      int split, int splits) {
  using State = AttendState<MaxRows>;
  const int d = g.d, G = g.G, rows = g.rows, T = g.threads;
  float* qs = reinterpret_cast<float*>(sm + g.sm_q);
  float* uqs = reinterpret_cast<float*>(sm + g.sm_uq);
  float* ksc = reinterpret_cast<float*>(sm + g.sm_kscale);
  float* kze = reinterpret_cast<float*>(sm + g.sm_kzero);
  float* ssc = reinterpret_cast<float*>(sm + g.sm_sscale);
  float* sze = reinterpret_cast<float*>(sm + g.sm_szero);
  float* vsc = reinterpret_cast<float*>(sm + g.sm_vscale);
  float* vze = reinterpret_cast<float*>(sm + g.sm_vzero);
  int* width = reinterpret_cast<int*>(sm + g.sm_width);
  int* off = reinterpret_cast<int*>(sm + g.sm_off);
  float* part = reinterpret_cast<float*>(sm + g.sm_part);
  float* pr = reinterpret_cast<float*>(sm + g.sm_p);
  float* m = reinterpret_cast<float*>(sm + g.sm_m);
  float* lred = reinterpret_cast<float*>(sm + g.sm_lred);
  float* corr = reinterpret_cast<float*>(sm + g.sm_corr);
  uint8_t* kstage = sm + g.sm_kstage;
  uint8_t* vstage = sm + g.sm_vstage;
  float* red = reinterpret_cast<float*>(sm + g.sm_red);

  const int nb = p.item_blocks ? p.item_blocks[item] : p.blocks;
  int b0, b1;
  SplitRange(nb, splits, split, &b0, &b1);
  const float* q = p.q + static_cast<int64_t>(item) * rows * d;
  const float* uq = g.rank > 0 ? p.uq + static_cast<int64_t>(item) * rows * g.rank : nullptr;

  cta.Phase([&](int tid, State& st) {
    for (int w = tid; w < rows * d; w += T) qs[w] = q[w];
    for (int w = tid; w < rows * g.rank; w += T) uqs[w] = p.side_sign * uq[w];
    if (tid < rows) m[tid] = kNegInf;
    for (int t = tid; g.value_bits != 0 && t <= G; t += T) {  // uniform widths: fixed records
      if (t < G) width[t] = g.value_bits;
      off[t] = kHeaderBytes + t * g.value_rec;  // off[G]: the block's size
    }
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      st.sum[i] = 0.0f;
      KVQ_UNROLL
      for (int j = 0; j < kChannelsPerThread; ++j) st.acc[j][i] = 0.0f;
    }
  });

  for (int b = b0; b < b1; ++b) {
    const int64_t at = static_cast<int64_t>(item) * p.block_stride + b;
    const uint8_t* kg = p.key_blocks[at];
    const uint8_t* vg = p.value_blocks[at];
    if (g.value_bits == 0) {  // per-token widths: record offsets by a prefix sum of the tags
      cta.Phase([&](int tid, State&) {
        for (int t = tid; t < G; t += T) width[t] = TokenWidth(vg + kHeaderBytes, t);
      });
      cta.Phase([&](int tid, State&) {
        for (int t = tid; t <= G; t += T) {
          int o = kHeaderBytes + g.value_tags;
          for (int u = 0; u < t; ++u) o += 4 * g.ng + RowBytes(d, width[u]);
          off[t] = o;  // off[G]: the block's size
        }
      });
    }
    // Stage both blocks; while the copies are in flight, fp32 scales and zero points (read
    // from global memory).
    cta.Phase([&](int tid, State&) {
      StageTwo(kg, g.key_bytes, kstage, vg, off[G], vstage, tid, T, [&] {
        for (int c = tid; c < d; c += T) {
          ksc[c] = LoadHalf(kg + g.k_scale + 2 * c);
          kze[c] = LoadHalf(kg + g.k_zero + 2 * c);
        }
        for (int j = tid; j < g.rank; j += T) {
          ssc[j] = LoadHalf(kg + g.s_scale + 2 * j);
          sze[j] = LoadHalf(kg + g.s_zero + 2 * j);
        }
        for (int w = tid; w < G * g.ng; w += T) {
          const int t = w / g.ng, gr = w % g.ng;
          const uint8_t* rec = vg + off[t];
          vsc[w] = LoadHalf(rec + 2 * gr);
          vze[w] = LoadHalf(rec + 2 * (g.ng + gr));
        }
      });
    });
    // Scores, a slice of the channels per thread; header checks.
    cta.Phase([&](int tid, State&) {
      const uint8_t* kb = kstage + (reinterpret_cast<uintptr_t>(kg) & 15u);
      if (tid == 0 && p.error_flags) {
        const uint8_t* vb = vstage + (reinterpret_cast<uintptr_t>(vg) & 15u);
        const bool ok =
            HeaderMatches(kb, 1, p.keys_rotated, g.key_bits, g.side_bits, G, d, g.rank) &&
            HeaderMatches(vb, 2, p.values_rotated, g.value_bits, 0, G, d, g.value_group);
        if (!ok) {
#ifdef __CUDA_ARCH__
          atomicOr(p.error_flags, kAttendHeaderMismatch);
#else
          *p.error_flags |= kAttendHeaderMismatch;
#endif
        }
      }
      const int quads = G / kTokensPerThread;
      for (int w = tid; w < quads * g.key_slices; w += T) {
        const int tq = w % quads, ks = w / quads;
        float s[kTokensPerThread][MaxRows];
        KeyQuadPart<MaxRows>(g, kb, qs, uqs, ksc, kze, ssc, sze, tq, ks, s);
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i)
          if (i < rows) {
            KVQ_UNROLL
            for (int j = 0; j < kTokensPerThread; ++j)
              part[(ks * rows + i) * G + kTokensPerThread * tq + j] = s[j][i];
          }
      }
    });
    cta.Phase([&](int tid, State&) {
      for (int w = tid; w < rows * G; w += T) {
        const int i = w / G, t = w % G;
        float s = 0.0f;
        for (int ks = 0; ks < g.key_slices; ++ks) s += part[(ks * rows + i) * G + t];
        pr[w] = b == 0 && t < p.masked_prefix ? kNegInf : p.scale * s;
      }
    });
    cta.Phase([&](int tid, State&) { RowMaxPhase(tid, rows, G, pr, m, corr); });
    cta.Phase([&](int tid, State&) { WeightsPhase(tid, T, rows, G, pr, m); });
    // Readout: thread (channel quad cq, slice sl) over tokens sl, sl + slices, ...
    cta.Phase([&](int tid, State& st) {
      const uint8_t* vb = vstage + (reinterpret_cast<uintptr_t>(vg) & 15u);
      const int cq = tid % (d / kChannelsPerThread), sl = tid / (d / kChannelsPerThread);
      RescaleSums<MaxRows>(st, rows, corr);
      AddWeights<MaxRows>(st, rows, cq, sl, g.slices, G, G, pr);
      ValueQuadSums<MaxRows>(g, vb, off, width, vsc, vze, pr, cq, sl, st);
    });
  }
  cta.Phase([&](int tid, State& st) { ReduceSumsPhase<MaxRows>(tid, rows, d, st, red, lred); });
  const Partials pt = PartialsIn(p.workspace, p.items, splits, rows);
  const int64_t at = (static_cast<int64_t>(item) * splits + split) * rows;
  cta.Phase([&](int tid, State&) {
    WritePartialPhase(tid, T, rows, d, g.slices, red, lred, m, pt.m + at, pt.l + at, pt.o + at * d);
  });
}

// The merge of every item's partials: output element w of [items][rows][d]; max_out and
// sum_out (either may be null) get the merged m and l of the row, written by its channel 0.
KVQ_HD void MergeOne(void* workspace, int items, int rows, int d, int splits, int64_t w, float* out,
                     float* max_out, float* sum_out) {
  const int64_t row = w / d;  // item * rows + i
  const int c = static_cast<int>(w % d);
  const int64_t item = row / rows, i = row % rows;
  const Partials pt = PartialsIn(workspace, items, splits, rows);
  const int64_t first = item * splits * rows + i;
  float mx, sum;
  MergeElement(pt.m + first, pt.l + first, rows, pt.o + first * d + c,
               static_cast<int64_t>(rows) * d, splits, out + w, &mx, &sum);
  if (c == 0 && max_out) max_out[row] = mx;
  if (c == 0 && sum_out) sum_out[row] = sum;
}

// The dense fp16 baseline's thread block: the same program over chunks of 32 fp16 tokens.
struct DenseGeometry {
  int d, rows, threads, slices, key_slices;
  int sm_q, sm_part, sm_p, sm_m, sm_lred, sm_corr, sm_k, sm_v, sm_red, sm_bytes;
};
inline constexpr int kDenseChunk = 32;

KVQ_HD DenseGeometry MakeDenseGeometry(const DenseAttendParams& p) {
  DenseGeometry g{};
  g.d = p.head_dim;
  g.rows = p.rows;
  g.threads = ThreadsFor(g.d);
  g.slices = g.threads / g.d;
  g.key_slices = g.threads / kDenseChunk;
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += RoundUp16(bytes);
    return o;
  };
  g.sm_q = take(4 * g.rows * g.d);
  g.sm_part = take(4 * g.key_slices * g.rows * kDenseChunk);
  g.sm_p = take(4 * g.rows * kDenseChunk);
  g.sm_m = take(4 * g.rows);
  g.sm_lred = take(4 * g.slices * g.rows);
  g.sm_corr = take(4 * g.rows);
  g.sm_k = take(2 * kDenseChunk * g.d);
  g.sm_v = take(2 * kDenseChunk * g.d);
  g.sm_red = take(4 * g.slices * g.rows * g.d);
  g.sm_bytes = at;
  return g;
}

template <int MaxRows, class Cta>
KVQ_HD void DenseCta(Cta& cta, const DenseAttendParams& p, const DenseGeometry& g, uint8_t* sm,
                     int item, int split, int splits) {
  using State = DenseState<MaxRows>;
  const int d = g.d, rows = g.rows, T = g.threads, C = kDenseChunk;
  float* qs = reinterpret_cast<float*>(sm + g.sm_q);
  float* part = reinterpret_cast<float*>(sm + g.sm_part);
  float* pr = reinterpret_cast<float*>(sm + g.sm_p);
  float* m = reinterpret_cast<float*>(sm + g.sm_m);
  float* lred = reinterpret_cast<float*>(sm + g.sm_lred);
  float* corr = reinterpret_cast<float*>(sm + g.sm_corr);
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(sm + g.sm_k);
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(sm + g.sm_v);
  float* red = reinterpret_cast<float*>(sm + g.sm_red);
  const int chunks = static_cast<int>((p.tokens + C - 1) / C);
  int c0, c1;
  SplitRange(chunks, splits, split, &c0, &c1);
  const float* q = p.q + static_cast<int64_t>(item) * rows * d;
  const uint16_t* kh = p.k + static_cast<int64_t>(item) * p.tokens * d;
  const uint16_t* vh = p.v + static_cast<int64_t>(item) * p.tokens * d;
  cta.Phase([&](int tid, State& st) {
    for (int w = tid; w < rows * d; w += T) qs[w] = q[w];
    if (tid < rows) m[tid] = kNegInf;
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) st.acc[0][i] = st.sum[i] = 0.0f;
  });
  for (int ch = c0; ch < c1; ++ch) {
    const int64_t t0 = static_cast<int64_t>(ch) * C;
    const int n = static_cast<int>(p.tokens - t0 < C ? p.tokens - t0 : C);
    cta.Phase([&](int tid, State&) {
      StageTwo(reinterpret_cast<const uint8_t*>(kh + t0 * d), 2 * n * d, sm + g.sm_k,
               reinterpret_cast<const uint8_t*>(vh + t0 * d), 2 * n * d, sm + g.sm_v, tid, T,
               [] {});
    });
    cta.Phase([&](int tid, State&) {
      for (int w = tid; w < C * g.key_slices; w += T) {
        const int t = w % C, kslice = w / C;
        const int a = d * kslice / g.key_slices, e = d * (kslice + 1) / g.key_slices;
        float s[MaxRows];
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i) s[i] = 0.0f;
        for (int c = a; t < n && c < e; ++c) {
          const float k = HalfToFloat(ks[t * d + c]);
          KVQ_UNROLL
          for (int i = 0; i < MaxRows; ++i)
            if (i < rows) s[i] += qs[i * d + c] * k;
        }
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i)
          if (i < rows) part[(kslice * rows + i) * C + t] = s[i];
      }
    });
    cta.Phase([&](int tid, State&) {
      for (int w = tid; w < rows * C; w += T) {
        const int i = w / C, t = w % C;
        float s = 0.0f;
        for (int k = 0; k < g.key_slices; ++k) s += part[(k * rows + i) * C + t];
        pr[w] = t < n ? p.scale * s : kNegInf;
      }
    });
    cta.Phase([&](int tid, State&) { RowMaxPhase(tid, rows, C, pr, m, corr); });
    cta.Phase([&](int tid, State&) { WeightsPhase(tid, T, rows, C, pr, m); });
    cta.Phase([&](int tid, State& st) {
      const int c = tid % d, sl = tid / d;
      RescaleSums<MaxRows>(st, rows, corr);
      AddWeights<MaxRows>(st, rows, c, sl, g.slices, n, C, pr);
      for (int t = sl; t < n; t += g.slices) {
        const float v = HalfToFloat(vs[t * d + c]);
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i)
          if (i < rows) st.acc[0][i] += pr[i * C + t] * v;
      }
    });
  }
  cta.Phase([&](int tid, State& st) { ReduceSumsPhase<MaxRows>(tid, rows, d, st, red, lred); });
  const Partials pt = PartialsIn(p.workspace, p.items, splits, rows);
  const int64_t at = (static_cast<int64_t>(item) * splits + split) * rows;
  cta.Phase([&](int tid, State&) {
    WritePartialPhase(tid, T, rows, d, g.slices, red, lred, m, pt.m + at, pt.l + at, pt.o + at * d);
  });
}

}  // namespace kvq::kernels::cuda::attend_math
