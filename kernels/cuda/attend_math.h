// The fused decode attend's arithmetic and index mapping (attend.cu), as __host__ __device__
// functions: the CUDA kernels run one thread block's program (AttendCta, DenseCta) with a
// barrier between its phases, and tests/kernels/cuda_math_test.cc runs the very same program on
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

#include "kvq/format/block_format.h"
#include "kvq/kernels/cuda.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

namespace kvq::kernels::cuda::attend_math {

using format::BitsToFloat;
using format::HalfToFloat;
using format::kHeaderBytes;
using format::LoadU16;

// The attend's readout: each thread sums 4 adjacent channels (one load of their codes); its
// scores: each thread scores 4 adjacent tokens (one load of their codes, q read once).
inline constexpr int kChannelsPerThread = 4;
inline constexpr int kTokensPerThread = 4;
inline constexpr float kNegInf = -__builtin_huge_valf();

// Bias slices: the zero-point terms of a block's scores are summed by kBiasSlices threads a
// row (channels j, j + kBiasSlices, ...) and added to the logits.
inline constexpr int kBiasSlices = 8;

// 16 bytes, the unit of every global load of the staging phases.
struct alignas(16) Vec16 {
  uint32_t w[4];
};

// One 2-byte load where p is even (a block's fields are, when the block is), else two bytes.
KVQ_HD float LoadHalf(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 1u) == 0) {
#ifdef __CUDA_ARCH__
    return HalfToFloat(*reinterpret_cast<const uint16_t*>(p));
#else
    uint16_t h;
    std::memcpy(&h, p, 2);
    return HalfToFloat(h);
#endif
  }
  return HalfToFloat(static_cast<uint16_t>(LoadU16(p)));
}

// The 32 bits from byte address p on (little-endian), by two aligned 4-byte loads: p lies in a
// staging buffer (or a block) that may be read in the aligned 8 bytes that cover [p, p + 4). Codes
// are unpacked from it by shifts: code i of b bits (LSB-first, codec.h) starts at bit i*b of its
// row.
KVQ_HD uint32_t Window32(const uint8_t* p) {
  // The aligned base by pointer arithmetic, so that the compiler keeps the address space
  // (shared-memory loads, not generic ones).
  const int lo = static_cast<int>(reinterpret_cast<uintptr_t>(p) & 3u);
  const uint8_t* base = p - lo;
#ifdef __CUDA_ARCH__
  const uint32_t* w = reinterpret_cast<const uint32_t*>(base);
  const uint64_t v = (static_cast<uint64_t>(w[1]) << 32) | w[0];
#else
  uint64_t v;
  std::memcpy(&v, base, 8);  // little-endian hosts
#endif
  return static_cast<uint32_t>(v >> (8 * lo));
}

// Codes as floats without an int-to-float conversion (a quarter-rate instruction or slower on
// GPUs) and without a subtraction: code j of b bits in w (at bit j b) as 1 + code / 2^b, the
// float whose mantissa's top b bits are the code (one funnel shift and one LOP3 a code). The
// kernels fold the scale and zero point around it: z + s code = (s 2^b) f + (z - s 2^b).
struct CodeUnpacker {
  uint64_t wide;  // w << (23 - b): code j at bits [23 - b + j b, 23 + j b)
  uint32_t mask;  // the code's bits at [23 - b, 23)
  int bits;
  KVQ_HD CodeUnpacker(uint32_t w, int b)
      : wide(static_cast<uint64_t>(w) << (23 - b)), mask(((1u << b) - 1u) << (23 - b)), bits(b) {}
  KVQ_HD float operator()(int j) const {
    return BitsToFloat(0x3F800000u | (static_cast<uint32_t>(wide >> (j * bits)) & mask));
  }
};
// 2^b as a float (b <= 8).
KVQ_HD float Pow2(int b) { return static_cast<float>(1u << b); }

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

// Ranges per item so that `slots` thread blocks run in all (a device's resident thread blocks,
// times the waves wanted), each range at least 4 blocks; clamped to [1, max(1, blocks)].
KVQ_HD int SplitsToFill(int items, int blocks, int64_t slots) {
  int64_t s = (slots + items - 1) / items;
  const int64_t most = blocks / 4 > 1 ? blocks / 4 : 1;
  if (s > most) s = most;
  if (s > blocks) s = blocks;
  return s > 1 ? static_cast<int>(s) : 1;
}

// Threads per thread block for head_dim d: 128 when d divides it, else d (d a multiple of 32);
// either way a multiple of d / 4 (the readout's channel quads) and of G / 4 (the scores'
// token quads).
KVQ_HD int ThreadsFor(int d) { return d <= 128 && 128 % d == 0 ? 128 : d; }

// The kernels' row counts (template MaxRows): rows up to 4, 8 or 16. A thread's loops run over
// all MaxRows rows without a branch per row; the rows beyond `rows` hold zero queries and
// weights, and their sums are never written.
KVQ_HD int RowsPad(int rows) { return rows <= 4 ? 4 : rows <= 8 ? 8 : 16; }

// Where everything sits: block byte offsets (codec.h) and the thread block's shared memory
// (byte offsets, each 16-aligned).
struct Geometry {
  int d, G, rows, rank, key_bits, side_bits, value_bits, value_group, ng;
  int rows_pad;           // rows rounded up to the kernel's MaxRows (4, 8 or 16): register arrays
  int key_row, side_row;  // bytes of one channel's codes over the G tokens
  int k_scale, k_zero, k_codes, s_scale, s_zero, s_codes, key_bytes;
  int value_tags;       // bytes of per-token width tags (0: uniform widths)
  int value_rec;        // bytes of one token record with uniform widths
  int value_bytes_max;  // the largest value block
  // threads; readout: slices of the tokens per channel quad; scores: slices of the channels
  // per token quad.
  int threads, slices, key_slices;
  int sm_q, sm_uq, sm_qk, sm_uk, sm_zpart, sm_vscale, sm_vzero, sm_width, sm_off, sm_part, sm_p,
      sm_w, sm_pmax, sm_m, sm_lred, sm_corr, sm_red, sm_bytes;
  // Two staging buffers (block b in buffer b & 1 while b + 1 arrives in the other), each a key
  // block then a value block, with the 16-byte alignment slack either side.
  int sm_stage, stage_bytes, stage_value;
};

KVQ_HD Geometry MakeGeometry(const AttendParams& p) {
  Geometry g{};
  const format::BlockCodec& c = p.codec;
  const format::KeyLayout k = format::MakeKeyLayout(c);
  g.d = c.head_dim;
  g.G = c.key_group;
  g.rows = p.rows;
  g.rows_pad = RowsPad(p.rows);
  g.rank = c.rank;
  g.key_bits = c.key_bits;
  g.side_bits = k.side_bits;
  g.value_bits = c.value_bits;
  g.value_group = c.value_group;
  g.ng = format::ValueGroups(c.head_dim, c.value_group);
  g.key_row = static_cast<int>(k.row);
  g.side_row = static_cast<int>(k.side_row);
  g.k_scale = static_cast<int>(k.scale);
  g.k_zero = static_cast<int>(k.zero);
  g.k_codes = static_cast<int>(k.codes);
  g.s_scale = static_cast<int>(k.side_scale);
  g.s_zero = static_cast<int>(k.side_zero);
  g.s_codes = static_cast<int>(k.side_codes);
  g.key_bytes = static_cast<int>(k.bytes);
  g.value_tags = g.value_bits == 0 ? static_cast<int>(format::ValueTagBytes(g.G)) : 0;
  g.value_rec = g.value_bits == 0
                    ? 0
                    : static_cast<int>(format::ValueRecordBytes(g.d, g.value_group, g.value_bits));
  g.value_bytes_max = static_cast<int>(
      g.value_bits == 0 ? format::MaxPerTokenValueBlockBytes(g.d, g.G, g.value_group, 0)
                        : format::UniformValueBlockBytes(g.d, g.G, g.value_group, g.value_bits, 0));
  g.threads = ThreadsFor(g.d);
  g.slices = g.threads / (g.d / kChannelsPerThread);
  g.key_slices = g.threads / (g.G / kTokensPerThread);
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += RoundUp16(bytes);
    return o;
  };
  g.sm_q = take(4 * g.rows_pad * g.d);  // [d][rows_pad], rows beyond `rows` zero
  g.sm_uq = take(4 * g.rows_pad * g.rank);
  g.sm_qk = take(4 * g.rows_pad * g.d);  // KeyPrepPhase's folded queries and bias
  g.sm_uk = take(4 * g.rows_pad * g.rank);
  g.sm_zpart = take(4 * g.rows_pad * kBiasSlices);
  g.sm_vscale = take(4 * g.G * g.ng);
  g.sm_vzero = take(4 * g.G * g.ng);
  g.sm_width = take(4 * g.G);
  g.sm_off = take(4 * (g.G + 1));  // + the block's total size
  g.sm_part = take(4 * g.key_slices * g.rows * g.G);
  g.sm_p = take(4 * g.rows * g.G);
  g.sm_w = take(4 * g.G * g.rows_pad);  // the weights [G][rows_pad]
  g.sm_pmax = take(4 * g.threads);      // [rows][threads / rows]
  g.sm_m = take(4 * g.rows);
  g.sm_lred = take(4 * g.slices * g.rows);
  g.sm_corr = take(4 * g.rows);
  g.stage_value = RoundUp16(g.key_bytes + 32);
  g.stage_bytes = g.stage_value + RoundUp16(g.value_bytes_max + 32);
  g.sm_stage = take(2 * g.stage_bytes);
  // The slices' sums, needed only after the last block: in the staging buffers when they fit.
  const int red = 4 * g.slices * g.rows * g.d;
  g.sm_red = red <= at - g.sm_stage ? g.sm_stage : take(red);
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

// Asynchronous staging (cp.async on the GPU: global to shared memory without registers, so
// that a block's bytes are in flight while the thread block computes on the previous one; on
// the CPU a plain copy). A thread waits for its own copies (WaitStaged) and the barrier after
// that phase makes every thread's copies visible.
KVQ_HD void CopyAsync16(Vec16* dst, const Vec16* src) {
#ifdef __CUDA_ARCH__
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
#else
  std::memcpy(dst, src, sizeof(Vec16));
#endif
}

KVQ_HD void WaitStaged() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Thread tid's share of copying bytes [a, a + na) into shared memory at da (16-aligned) by
// aligned 16-byte words (the source at any address: the words that cover it, so that byte x
// lands at da + (x - a) + (a & 15)).
KVQ_HD void StageAsync(const uint8_t* a, int na, uint8_t* da, int tid, int threads) {
  const uintptr_t ua = reinterpret_cast<uintptr_t>(a);
  const int words = (static_cast<int>(ua & 15u) + na + 15) >> 4;
  const Vec16* from = reinterpret_cast<const Vec16*>(ua & ~static_cast<uintptr_t>(15));
  Vec16* to = reinterpret_cast<Vec16*>(da);
  for (int i = tid; i < words; i += threads) CopyAsync16(to + i, from + i);
}

KVQ_HD int PopCount(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Sum of the 2-bit width tags (width - 1) of tokens [0, n) of a per-token value block (tags at
// any address, in global or shared memory): 16 tags per 32-bit word, by popcounts.
KVQ_HD int TagSum(const uint8_t* tags, int n) {
  int s = 0;
  for (int k = 0; 16 * k < n; ++k) {
    uint32_t w = Window32(tags + 4 * k);
    const int left = n - 16 * k;
    if (left < 16) w &= (1u << (2 * left)) - 1u;
    s += PopCount(w & 0x55555555u) + 2 * PopCount(w & 0xAAAAAAAAu);
  }
  return s;
}

// A key or value block header against the params: magic, a readable version, kind, the
// rotation flag (and no other), widths, tokens, head_dim and rank / value_group.
KVQ_HD bool HeaderMatches(const uint8_t* block, int kind, bool rotated, int bits, int side_bits,
                          int tokens, int head_dim, int extra) {
  const format::Header h = format::ReadHeader(block);
  return h.magic == format::kMagic && format::VersionReadable(h.version) &&
         format::FlagsValid(h.version, h.flags) && h.kind == kind &&
         h.flags == (rotated ? format::kFlagRotated : 0) && h.bits == bits &&
         h.side_bits == side_bits && h.tokens == tokens && h.head_dim == head_dim &&
         h.extra == extra;
}

// MaxRows floats at p (16-aligned) by 16-byte loads.
template <int MaxRows>
KVQ_HD void LoadRows(const float* p, float (&x)[MaxRows]) {
  const Vec16* v = reinterpret_cast<const Vec16*>(p);
  KVQ_UNROLL
  for (int k = 0; k < MaxRows / 4; ++k) {
    const Vec16 w = v[k];
    KVQ_UNROLL
    for (int j = 0; j < 4; ++j) x[4 * k + j] = BitsToFloat(w.w[j]);
  }
}

// Part of the scores of tokens 4 tq .. 4 tq + 3 over key slice ks (channels
// [ks d / KS, (ks+1) d / KS), side coefficients [ks r / KS, (ks+1) r / KS)), for every row,
// without the zero points (KeyBiasPhase):
//   part[j][i] = sum_c qk_ic f(c, t_j) + sum_c uk_ic f_c(t_j),   f = 1 + code / 2^b,
// qk [d][MaxRows] = q_ic s_c 2^b and uk [r][MaxRows] = sign uq_ic ss_c 2^sb (KeyPrepPhase); kb
// the staged block.
template <int MaxRows>
KVQ_HD void ChannelQuadTerms(const uint8_t* rows0, int row_bytes, int bits, int c0, int c1, int tq,
                             const float* qk, float (&part)[kTokensPerThread][MaxRows]) {
  const int bit = kTokensPerThread * tq * bits, sh = bit & 7;
  for (int c = c0; c < c1; ++c) {
    const CodeUnpacker code(Window32(rows0 + c * row_bytes + (bit >> 3)) >> sh, bits);
    float k[kTokensPerThread];
    KVQ_UNROLL
    for (int j = 0; j < kTokensPerThread; ++j) k[j] = code(j);
    float qc[MaxRows];
    LoadRows<MaxRows>(qk + c * MaxRows, qc);
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      KVQ_UNROLL
      for (int j = 0; j < kTokensPerThread; ++j) part[j][i] += qc[i] * k[j];
    }
  }
}

template <int MaxRows>
KVQ_HD void KeyQuadPart(const Geometry& g, const uint8_t* kb, const float* qk, const float* uk,
                        int tq, int ks, float (&part)[kTokensPerThread][MaxRows]) {
  KVQ_UNROLL
  for (int j = 0; j < kTokensPerThread; ++j) {
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) part[j][i] = 0.0f;
  }
  ChannelQuadTerms<MaxRows>(kb + g.k_codes, g.key_row, g.key_bits, g.d * ks / g.key_slices,
                            g.d * (ks + 1) / g.key_slices, tq, qk, part);
  if (g.rank > 0)
    ChannelQuadTerms<MaxRows>(kb + g.s_codes, g.side_row, g.side_bits, g.rank * ks / g.key_slices,
                              g.rank * (ks + 1) / g.key_slices, tq, uk, part);
}

// The block's folded queries and score bias (kb staged; qs [d][MaxRows], uqs [r][MaxRows]):
//   qk_ic = q_ic s_c 2^b,  uk_ij = sign uq_ij ss_j 2^sb,
//   zpart[sl][i] = sum_{c = sl mod kBiasSlices} q_ic (z_c - s_c 2^b) + (side terms alike),
// so that score_it = sum_c qk_ic f(c, t) + ... + sum_sl zpart[sl][i] = q . (z + s code) + ...
template <int MaxRows>
KVQ_HD void KeyPrepPhase(int tid, int threads, const Geometry& g, const uint8_t* kb,
                         const float* qs, const float* uqs, float* qk, float* uk, float* zpart) {
  const float kp = Pow2(g.key_bits), sp = Pow2(g.side_bits);
  for (int w = tid; w < MaxRows * g.d; w += threads)
    qk[w] = qs[w] * (LoadHalf(kb + g.k_scale + 2 * (w / MaxRows)) * kp);
  for (int w = tid; w < MaxRows * g.rank; w += threads)
    uk[w] = uqs[w] * (LoadHalf(kb + g.s_scale + 2 * (w / MaxRows)) * sp);
  for (int w = tid; w < MaxRows * kBiasSlices; w += threads) {
    const int i = w % MaxRows, sl = w / MaxRows;
    float a = 0.0f;
    for (int c = sl; c < g.d; c += kBiasSlices)
      a += qs[c * MaxRows + i] *
           (LoadHalf(kb + g.k_zero + 2 * c) - LoadHalf(kb + g.k_scale + 2 * c) * kp);
    for (int c = sl; c < g.rank; c += kBiasSlices)
      a += uqs[c * MaxRows + i] *
           (LoadHalf(kb + g.s_zero + 2 * c) - LoadHalf(kb + g.s_scale + 2 * c) * sp);
    zpart[w] = a;
  }
}

// The logits of a block of n tokens (of `stride`; the rest get -inf): thread (row i, slice j)
// of rows x spr (spr = threads / rows) sums the `parts` partial scores of tokens j, j + spr, ...
// (part [t][rows][parts] at `ts` floats a token, or [parts][rows][stride] when ts is 0), masks
// tokens below `masked`, and leaves their maximum in pmax [rows][spr] for RowMaxPhase.
// A row's bias (zpart [kBiasSlices][bias_stride], KeyPrepPhase; null: none) adds to its sums.
KVQ_HD void LogitsPhase(int tid, int threads, int rows, int n, int stride, int parts,
                        const float* part, int ts, float scale, int masked, float* s, float* pmax,
                        const float* zpart = nullptr, int bias_stride = 0) {
  const int spr = threads / rows;
  if (tid >= rows * spr) return;
  const int i = tid / spr, j = tid % spr;
  float bias = 0.0f;
  for (int k = 0; zpart && k < kBiasSlices; ++k) bias += zpart[k * bias_stride + i];
  float mx = kNegInf;
  for (int t = j; t < stride; t += spr) {
    float v = kNegInf;
    if (t < n && t >= masked) {
      float a = 0.0f;
      if (ts > 0) {
        const float* pt = part + t * ts + i * parts;
        for (int k = 0; k < parts; ++k) a += pt[k];
      } else {
        for (int k = 0; k < parts; ++k) a += part[(k * rows + i) * stride + t];
      }
      v = scale * (a + bias);
    }
    s[i * stride + t] = v;
    mx = Max(mx, v);
  }
  pmax[i * spr + j] = mx;
}

// Online softmax, phase 1 for row i (thread i < rows): the block's partial maxima pmax
// [rows][n] (LogitsPhase; -inf: no weight) raise the row's running max m; corr =
// exp(m_old - m_new) rescales what the row has summed so far (0 before its first token, whose
// sums are still 0).
KVQ_HD void RowMaxPhase(int tid, int rows, int n, const float* s, float* m, float* corr) {
  if (tid >= rows) return;
  // Four independent maxima (16-byte loads when n is a multiple of 4), so that the loads
  // overlap rather than wait for one another.
  float b4[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
  int t = 0;
  if (n % 4 == 0) {
    const Vec16* v = reinterpret_cast<const Vec16*>(s + tid * n);
    for (; t < n; t += 4) {
      const Vec16 w = v[t / 4];
      KVQ_UNROLL
      for (int k = 0; k < 4; ++k) b4[k] = Max(b4[k], BitsToFloat(w.w[k]));
    }
  }
  for (; t < n; ++t) b4[t % 4] = Max(b4[t % 4], s[tid * n + t]);
  const float bm = Max(Max(b4[0], b4[1]), Max(b4[2], b4[3]));
  const float mo = m[tid], mn = Max(mo, bm);
  corr[tid] = mo == kNegInf ? 0.0f : Exp(mo - mn);
  m[tid] = mn;
}

// Phase 2, element w of [n][rows_pad]: the weight exp(s - m) of token t for row i (s [rows][n])
// into pw [n][rows_pad] (0 while a row has seen nothing but masked tokens, and for the padding
// rows i >= rows), so that a thread reads a token's weights for all rows in one load.
KVQ_HD void WeightsPhase(int tid, int threads, int rows, int rows_pad, int n, const float* s,
                         const float* m, float* pw) {
  for (int w = tid; w < rows_pad * n; w += threads) {
    const int t = w / rows_pad, i = w % rows_pad;
    float x = 0.0f;
    if (i < rows && m[i] != kNegInf) x = Exp(s[i * n + t] - m[i]);
    pw[w] = x;
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
// The attend's: also the zero-point terms of its channel quad (one value group), the same for
// the quad's four channels, added to them at the end.
template <int MaxRows>
struct AttendState : ThreadState<MaxRows, kChannelsPerThread> {
  float zacc[MaxRows];
};

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
// pw: the weights [n][MaxRows] (WeightsPhase).
template <int MaxRows, int Cpt>
KVQ_HD void AddWeights(ThreadState<MaxRows, Cpt>& st, int cq, int sl, int slices, int n,
                       const float* pw) {
  if (cq != 0) return;
  for (int t = sl; t < n; t += slices) {
    float p[MaxRows];
    LoadRows<MaxRows>(pw + t * MaxRows, p);
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) st.sum[i] += p[i];
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
// from the staged block vb (off, width: each token record's offset and code width), pw the
// weights [G][MaxRows], vsc = s 2^b and vze = z - s 2^b per token and group (the fold of
// CodeUnpacker). When the quad lies in one group: acc[c][i] += (p_it vsc_t) f_t(c), and
// zacc[i] += p_it vze_t once for the four channels.
// Token t's codes of the quad c .. c + 3 as CodeUnpacker floats (Uniform: every record
// `bits` wide at a fixed stride, so that the loop keeps the unpacking constants in registers;
// else the record's width and offset from width, off).
template <bool Uniform>
KVQ_HD void UnpackQuad(const Geometry& g, const uint8_t* vb, const int* off, const int* width,
                       int c, int t, float (&f)[kChannelsPerThread]) {
  const int bits = Uniform ? g.value_bits : width[t], bit = c * bits;
  const int at = Uniform ? kHeaderBytes + t * g.value_rec : off[t];
  const CodeUnpacker code(Window32(vb + at + 4 * g.ng + (bit >> 3)) >> (bit & 7), bits);
  KVQ_UNROLL
  for (int j = 0; j < kChannelsPerThread; ++j) f[j] = code(j);
}

// The quad within scale group g0: acc[c][i] += (p_it vsc_t) f_t(c), zacc[i] += p_it vze_t.
template <bool Uniform, int MaxRows>
KVQ_HD void ValueQuadGroupSums(const Geometry& g, const uint8_t* vb, const int* off,
                               const int* width, const float* vsc, const float* vze,
                               const float* pw, int c, int g0, int sl, AttendState<MaxRows>& st) {
  for (int t = sl; t < g.G; t += g.slices) {
    float f[kChannelsPerThread], p[MaxRows];
    UnpackQuad<Uniform>(g, vb, off, width, c, t, f);
    LoadRows<MaxRows>(pw + t * MaxRows, p);
    const float sc = vsc[t * g.ng + g0], ze = vze[t * g.ng + g0];
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      const float ps = p[i] * sc;
      st.zacc[i] += p[i] * ze;
      KVQ_UNROLL
      for (int j = 0; j < kChannelsPerThread; ++j) st.acc[j][i] += ps * f[j];
    }
  }
}

template <int MaxRows>
KVQ_HD void ValueQuadSums(const Geometry& g, const uint8_t* vb, const int* off, const int* width,
                          const float* vsc, const float* vze, const float* pw, int cq, int sl,
                          AttendState<MaxRows>& st) {
  constexpr int Q = kChannelsPerThread;
  const int c = Q * cq, g0 = c / g.value_group, g3 = (c + Q - 1) / g.value_group;
  if (g0 == g3) {  // the quad within one scale group (value_group a multiple of 4)
    if (g.value_bits != 0)
      ValueQuadGroupSums<true, MaxRows>(g, vb, off, width, vsc, vze, pw, c, g0, sl, st);
    else
      ValueQuadGroupSums<false, MaxRows>(g, vb, off, width, vsc, vze, pw, c, g0, sl, st);
    return;
  }
  for (int t = sl; t < g.G; t += g.slices) {
    float f[Q], p[MaxRows], v[Q];
    UnpackQuad<false>(g, vb, off, width, c, t, f);
    LoadRows<MaxRows>(pw + t * MaxRows, p);
    KVQ_UNROLL
    for (int j = 0; j < Q; ++j) {
      const int gj = (c + j) / g.value_group;
      v[j] = vze[t * g.ng + gj] + vsc[t * g.ng + gj] * f[j];
    }
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      KVQ_UNROLL
      for (int j = 0; j < Q; ++j) st.acc[j][i] += p[i] * v[j];
    }
  }
}

// Bytes of the value block at v: fixed records, or (per-token widths) the records' sizes from
// the width tags (head_dim a multiple of 32, AttendUnsupported: a record's codes are d w / 8).
KVQ_HD int ValueBlockBytes(const Geometry& g, const uint8_t* v) {
  if (g.value_bits != 0) return kHeaderBytes + g.G * g.value_rec;
  return kHeaderBytes + g.value_tags + g.G * 4 * g.ng +
         g.d / 8 * (g.G + TagSum(v + kHeaderBytes, g.G));
}

// An item's range of blocks for one thread block, and its two staging buffers at `stage`
// (block b in buffer b & 1 while b + 1 arrives in the other; each a key block, then a value
// block at stage_value, both at their source's offset within a 16-byte word).
struct ItemRun {
  int b0, b1;
  const float* q;   // the item's [rows][d]
  const float* uq;  // the item's [rows][rank], or null
  const uint8_t* const* kblocks;
  const uint8_t* const* vblocks;
  uint8_t* stage;
  int stage_bytes, stage_value;
  KVQ_HD uint8_t* Buffer(int b) const { return stage + ((b - b0) & 1) * stage_bytes; }
  KVQ_HD const uint8_t* Key(int b) const {
    return Buffer(b) + (reinterpret_cast<uintptr_t>(kblocks[b]) & 15u);
  }
  KVQ_HD const uint8_t* Value(int b) const {
    return Buffer(b) + stage_value + (reinterpret_cast<uintptr_t>(vblocks[b]) & 15u);
  }
  // Thread tid's share of block b's copies (of `threads`).
  KVQ_HD void Stage(const Geometry& g, int b, int tid, int threads) const {
    StageAsync(kblocks[b], g.key_bytes, Buffer(b), tid, threads);
    StageAsync(vblocks[b], ValueBlockBytes(g, vblocks[b]), Buffer(b) + stage_value, tid, threads);
  }
};

KVQ_HD ItemRun ItemRunOf(const AttendParams& p, const Geometry& g, uint8_t* stage, int item,
                         int split, int splits) {
  ItemRun r{};
  SplitRange(p.item_blocks ? p.item_blocks[item] : p.blocks, splits, split, &r.b0, &r.b1);
  r.q = p.q + static_cast<int64_t>(item) * p.rows * g.d;
  r.uq = g.rank > 0 ? p.uq + static_cast<int64_t>(item) * p.rows * g.rank : nullptr;
  r.kblocks = p.key_blocks + static_cast<int64_t>(item) * p.block_stride;
  r.vblocks = p.value_blocks + static_cast<int64_t>(item) * p.block_stride;
  r.stage = stage;
  r.stage_bytes = g.stage_bytes;
  r.stage_value = g.stage_value;
  return r;
}

// One thread block of the attend: item `item`, blocks of range `split` of `splits`. `sm`: the
// thread block's shared memory (g.sm_bytes, 16-aligned). Block b + 1 is staged (cp.async)
// while block b is scored and read out, so that a thread block's loads overlap its arithmetic;
// per block: Prep (issue the next block's copies; the block's scales to fp32 and, for
// per-token widths, its record offsets), Scores, Logits, RowMax, Weights, Readout (then wait
// for the next block's copies).
template <int MaxRows, class Cta>
KVQ_HD void AttendCta(Cta& cta, const AttendParams& p, const Geometry& g, uint8_t* sm, int item,
                      int split, int splits) {
  using State = AttendState<MaxRows>;
  const int d = g.d, G = g.G, rows = g.rows, T = g.threads;
  float* qs = reinterpret_cast<float*>(sm + g.sm_q);
  float* uqs = reinterpret_cast<float*>(sm + g.sm_uq);
  float* qk = reinterpret_cast<float*>(sm + g.sm_qk);
  float* uk = reinterpret_cast<float*>(sm + g.sm_uk);
  float* zpart = reinterpret_cast<float*>(sm + g.sm_zpart);
  float* vsc = reinterpret_cast<float*>(sm + g.sm_vscale);
  float* vze = reinterpret_cast<float*>(sm + g.sm_vzero);
  int* width = reinterpret_cast<int*>(sm + g.sm_width);
  int* off = reinterpret_cast<int*>(sm + g.sm_off);
  float* part = reinterpret_cast<float*>(sm + g.sm_part);
  float* pr = reinterpret_cast<float*>(sm + g.sm_p);
  float* pw = reinterpret_cast<float*>(sm + g.sm_w);
  float* pmax = reinterpret_cast<float*>(sm + g.sm_pmax);
  float* m = reinterpret_cast<float*>(sm + g.sm_m);
  float* lred = reinterpret_cast<float*>(sm + g.sm_lred);
  float* corr = reinterpret_cast<float*>(sm + g.sm_corr);
  float* red = reinterpret_cast<float*>(sm + g.sm_red);

  const ItemRun run = ItemRunOf(p, g, sm + g.sm_stage, item, split, splits);
  const int b0 = run.b0, b1 = run.b1;
  const float *q = run.q, *uq = run.uq;
  auto stage = [&](int b, int tid) { run.Stage(g, b, tid, T); };

  cta.Phase([&](int tid, State& st) {
    if (b0 < b1) stage(b0, tid);
    // q and uq transposed to [channel][MaxRows], the padding rows zero.
    for (int w = tid; w < MaxRows * d; w += T) {
      const int c = w / MaxRows, i = w % MaxRows;
      qs[w] = i < rows ? q[i * d + c] : 0.0f;
    }
    for (int w = tid; w < MaxRows * g.rank; w += T) {
      const int c = w / MaxRows, i = w % MaxRows;
      uqs[w] = i < rows ? uq[i * g.rank + c] : 0.0f;
    }
    if (tid < rows) m[tid] = kNegInf;
    for (int t = tid; g.value_bits != 0 && t <= G; t += T) {  // uniform widths: fixed records
      if (t < G) width[t] = g.value_bits;
      off[t] = kHeaderBytes + t * g.value_rec;  // off[G]: the block's size
    }
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      st.sum[i] = st.zacc[i] = 0.0f;
      KVQ_UNROLL
      for (int j = 0; j < kChannelsPerThread; ++j) st.acc[j][i] = 0.0f;
    }
    WaitStaged();
  });

  for (int b = b0; b < b1; ++b) {
    const uint8_t* kb = run.Key(b);
    const uint8_t* vb = run.Value(b);
    // The next block's copies; this block's folded queries and score bias, and (per-token
    // widths) its record widths and offsets from the staged tags.
    cta.Phase([&](int tid, State&) {
      if (b + 1 < b1) stage(b + 1, tid);
      KeyPrepPhase<MaxRows>(tid, T, g, kb, qs, uqs, qk, uk, zpart);
      for (int t = tid; g.value_bits == 0 && t <= G; t += T) {
        if (t < G) width[t] = format::TagWidth(vb + kHeaderBytes, t);
        off[t] = kHeaderBytes + g.value_tags + t * 4 * g.ng +
                 d / 8 * (t + TagSum(vb + kHeaderBytes, t));  // off[G]: the block's size
      }
    });
    // Scores, a slice of the channels per thread; the value scales to fp32; header checks.
    cta.Phase([&](int tid, State&) {
      if (tid == 0 && p.error_flags) {
        const bool ok = HeaderMatches(kb, format::kKindKey, p.codec.rotate_keys, g.key_bits,
                                      g.side_bits, G, d, g.rank) &&
                        HeaderMatches(vb, format::kKindValue, p.codec.rotate_values, g.value_bits,
                                      0, G, d, g.value_group);
        if (!ok) {
#ifdef __CUDA_ARCH__
          atomicOr(p.error_flags, kAttendHeaderMismatch);
#else
          *p.error_flags |= kAttendHeaderMismatch;
#endif
        }
      }
      for (int w = tid; w < G * g.ng; w += T) {
        const int t = w / g.ng, gr = w % g.ng;
        const uint8_t* rec = vb + off[t];
        const float sc = LoadHalf(rec + 2 * gr) * Pow2(width[t]);
        vsc[w] = sc;
        vze[w] = LoadHalf(rec + 2 * (g.ng + gr)) - sc;
      }
      const int quads = G / kTokensPerThread;
      for (int w = tid; w < quads * g.key_slices; w += T) {
        const int tq = w % quads, ks = w / quads;
        float s[kTokensPerThread][MaxRows];
        KeyQuadPart<MaxRows>(g, kb, qk, uk, tq, ks, s);
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i)
          if (i < rows) {
            KVQ_UNROLL
            for (int j = 0; j < kTokensPerThread; ++j)
              part[(ks * rows + i) * G + kTokensPerThread * tq + j] = s[j][i];
          }
      }
    });
    const int masked = b == 0 ? p.masked_prefix : 0;
    cta.Phase([&](int tid, State&) {
      LogitsPhase(tid, T, rows, G, G, g.key_slices, part, 0, p.scale, masked, pr, pmax, zpart,
                  MaxRows);
    });
    cta.Phase([&](int tid, State&) { RowMaxPhase(tid, rows, T / rows, pmax, m, corr); });
    cta.Phase([&](int tid, State&) { WeightsPhase(tid, T, rows, MaxRows, G, pr, m, pw); });
    // Readout: thread (channel quad cq, slice sl) over tokens sl, sl + slices, ...; then the
    // next block's copies must have landed before the barrier.
    cta.Phase([&](int tid, State& st) {
      const int cq = tid % (d / kChannelsPerThread), sl = tid / (d / kChannelsPerThread);
      RescaleSums<MaxRows>(st, rows, corr);
      KVQ_UNROLL
      for (int i = 0; i < MaxRows; ++i)
        if (i < rows) st.zacc[i] *= corr[i];
      AddWeights<MaxRows>(st, cq, sl, g.slices, G, pw);
      ValueQuadSums<MaxRows>(g, vb, off, width, vsc, vze, pw, cq, sl, st);
      WaitStaged();
    });
  }
  cta.Phase([&](int tid, State& st) {
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      KVQ_UNROLL
      for (int j = 0; j < kChannelsPerThread; ++j) st.acc[j][i] += st.zacc[i];
    }
    ReduceSumsPhase<MaxRows>(tid, rows, d, st, red, lred);
  });
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

// The dense fp16 baseline's thread block: the same online-softmax program over chunks of
// tokens, built to run at memory bandwidth: a chunk's K and V rows (16 KiB) are staged by
// cp.async into one of two buffers while the previous chunk is computed; every thread reads 8
// channels (16 bytes) of a row at a time, lanes along the channels, so that a quarter warp
// reads 128 contiguous bytes (no bank conflicts); fp32 arithmetic throughout.
inline constexpr int kDenseLane = 8;  // channels a thread reads at once: 16 bytes of fp16

// A thread's registers: its sums, and the queries of its 8 channels for every row (a thread
// keeps one lane of the rows, so the scores read no query from shared memory).
template <int MaxRows>
struct DenseState : ThreadState<MaxRows, kDenseLane> {
  float q[kDenseLane][MaxRows];
};

struct DenseGeometry {
  int d, rows, threads, chunk, lanes, slices;  // lanes: threads across a row (d / 8)
  int part_stride;
  int sm_part, sm_p, sm_w, sm_pmax, sm_m, sm_lred, sm_corr, sm_stage, stage_bytes, sm_red, sm_bytes;
};

// Tokens of a chunk: 16 KiB of K and V rows (at least one token).
KVQ_HD int DenseChunk(int d) { return d >= 4096 ? 1 : 4096 / d; }

KVQ_HD DenseGeometry MakeDenseGeometry(const DenseAttendParams& p) {
  DenseGeometry g{};
  g.d = p.head_dim;
  g.rows = p.rows;
  g.threads = ThreadsFor(g.d);
  g.chunk = DenseChunk(g.d);
  g.lanes = g.d / kDenseLane;
  g.slices = g.threads / g.lanes;
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += RoundUp16(bytes);
    return o;
  };
  // [t][rows][lanes], a token's scores padded by one float so that LogitsPhase's threads (one
  // token each) read different banks.
  g.part_stride = g.rows * g.lanes + 1;
  g.sm_part = take(4 * g.chunk * g.part_stride);
  g.sm_p = take(4 * g.rows * g.chunk);
  g.sm_w = take(4 * g.chunk * RowsPad(g.rows));  // the weights [chunk][MaxRows]
  g.sm_pmax = take(4 * g.threads);
  g.sm_m = take(4 * g.rows);
  g.sm_lred = take(4 * g.slices * g.rows);
  g.sm_corr = take(4 * g.rows);
  g.stage_bytes = RoundUp16(2 * 2 * g.chunk * g.d);  // K rows, then V rows
  g.sm_stage = take(2 * g.stage_bytes);
  const int red = 4 * g.slices * g.rows * g.d;
  g.sm_red = red <= at - g.sm_stage ? g.sm_stage : take(red);
  g.sm_bytes = at;
  return g;
}

// 8 fp16 values (16 bytes) to fp32.
KVQ_HD void HalvesToFloats(const Vec16& v, float (&f)[kDenseLane]) {
  KVQ_UNROLL
  for (int k = 0; k < 4; ++k) {
#ifdef __CUDA_ARCH__
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&v.w[k]));
    f[2 * k] = x.x;
    f[2 * k + 1] = x.y;
#else
    f[2 * k] = HalfToFloat(static_cast<uint16_t>(v.w[k] & 0xffffu));
    f[2 * k + 1] = HalfToFloat(static_cast<uint16_t>(v.w[k] >> 16));
#endif
  }
}

// k, v must be 16-byte aligned (DenseAttend checks): a chunk's rows are then whole 16-byte
// words, staged at the start of the buffer.
template <int MaxRows, class Cta>
KVQ_HD void DenseCta(Cta& cta, const DenseAttendParams& p, const DenseGeometry& g, uint8_t* sm,
                     int item, int split, int splits) {
  using State = DenseState<MaxRows>;
  const int d = g.d, rows = g.rows, T = g.threads, C = g.chunk, L = g.lanes;
  float* part = reinterpret_cast<float*>(sm + g.sm_part);
  float* pr = reinterpret_cast<float*>(sm + g.sm_p);
  float* pw = reinterpret_cast<float*>(sm + g.sm_w);
  float* pmax = reinterpret_cast<float*>(sm + g.sm_pmax);
  float* m = reinterpret_cast<float*>(sm + g.sm_m);
  float* lred = reinterpret_cast<float*>(sm + g.sm_lred);
  float* corr = reinterpret_cast<float*>(sm + g.sm_corr);
  float* red = reinterpret_cast<float*>(sm + g.sm_red);
  const int chunks = static_cast<int>((p.tokens + C - 1) / C);
  int c0, c1;
  SplitRange(chunks, splits, split, &c0, &c1);
  const float* q = p.q + static_cast<int64_t>(item) * rows * d;
  const uint16_t* kh = p.k + static_cast<int64_t>(item) * p.tokens * d;
  const uint16_t* vh = p.v + static_cast<int64_t>(item) * p.tokens * d;
  auto tokens_in = [&](int ch) {
    const int64_t t0 = static_cast<int64_t>(ch) * C;
    return static_cast<int>(p.tokens - t0 < C ? p.tokens - t0 : C);
  };
  auto buffer = [&](int ch) { return sm + g.sm_stage + ((ch - c0) & 1) * g.stage_bytes; };
  auto stage = [&](int ch, int tid) {
    const int64_t t0 = static_cast<int64_t>(ch) * C;
    const int bytes = 2 * tokens_in(ch) * d;
    StageAsync(reinterpret_cast<const uint8_t*>(kh + t0 * d), bytes, buffer(ch), tid, T);
    StageAsync(reinterpret_cast<const uint8_t*>(vh + t0 * d), bytes, buffer(ch) + 2 * C * d, tid,
               T);
  };
  cta.Phase([&](int tid, State& st) {
    if (c0 < c1) stage(c0, tid);
    // This thread's lane of every row's query (threads is a multiple of the lanes, so a
    // thread's lane is the same in every phase), the padding rows zero.
    const int l = tid % L;
    KVQ_UNROLL
    for (int i = 0; i < MaxRows; ++i) {
      st.sum[i] = 0.0f;
      KVQ_UNROLL
      for (int j = 0; j < kDenseLane; ++j) {
        st.acc[j][i] = 0.0f;
        st.q[j][i] = i < rows ? q[i * d + kDenseLane * l + j] : 0.0f;
      }
    }
    if (tid < rows) m[tid] = kNegInf;
    WaitStaged();
  });
  for (int ch = c0; ch < c1; ++ch) {
    const int n = tokens_in(ch);
    const Vec16* ks = reinterpret_cast<const Vec16*>(buffer(ch));
    const Vec16* vs = reinterpret_cast<const Vec16*>(buffer(ch) + 2 * C * d);
    // The next chunk's copies; partial scores: thread (lane l, token t) over channels
    // 8 l .. 8 l + 7.
    cta.Phase([&](int tid, State& st) {
      if (ch + 1 < c1) stage(ch + 1, tid);
      for (int w = tid; w < n * L; w += T) {
        const int l = w % L, t = w / L;
        float k[kDenseLane];
        HalvesToFloats(ks[t * L + l], k);
        float s[MaxRows];
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i) {
          s[i] = 0.0f;
          KVQ_UNROLL
          for (int j = 0; j < kDenseLane; ++j) s[i] += st.q[j][i] * k[j];
        }
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i)
          if (i < rows) part[t * g.part_stride + i * L + l] = s[i];
      }
    });
    cta.Phase([&](int tid, State&) {
      LogitsPhase(tid, T, rows, n, C, L, part, g.part_stride, p.scale, 0, pr, pmax);
    });
    cta.Phase([&](int tid, State&) { RowMaxPhase(tid, rows, T / rows, pmax, m, corr); });
    cta.Phase([&](int tid, State&) { WeightsPhase(tid, T, rows, MaxRows, C, pr, m, pw); });
    // Readout: thread (lane l, slice sl) over tokens sl, sl + slices, ...; then the next
    // chunk's copies must have landed before the barrier.
    cta.Phase([&](int tid, State& st) {
      const int l = tid % L, sl = tid / L;
      RescaleSums<MaxRows>(st, rows, corr);
      AddWeights<MaxRows>(st, l, sl, g.slices, n, pw);
      for (int t = sl; t < n; t += g.slices) {
        float v[kDenseLane], w[MaxRows];
        HalvesToFloats(vs[t * L + l], v);
        LoadRows<MaxRows>(pw + t * MaxRows, w);
        KVQ_UNROLL
        for (int i = 0; i < MaxRows; ++i) {
          KVQ_UNROLL
          for (int j = 0; j < kDenseLane; ++j) st.acc[j][i] += w[i] * v[j];
        }
      }
      WaitStaged();
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
