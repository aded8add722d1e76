// The fused decode attend with both products of a block on the tensor cores (attend.cu
// launches it, attend_host.cc runs it on the CPU with warp_mma.h's emulated warps): AttendCta's
// staging, online softmax and partials, with
//   scores   S^T = K_codes Q'      A = a 16-token x 16-channel tile of key (or side) codes,
//                                  B = the block's folded queries q_ic s_c (u_ij ss_j)
//   readout  O^T += V_codes^T P'   A = a 16-channel x 16-token tile of value codes,
//                                  B = the weights times the tokens' value scales p_it s_tg
// Codes enter the products as exact small integers (bf16, warp_mma::CodePair) and every affine
// term is folded out of them: key zero points into a per-row bias (as AttendCta), value zero
// points into per-group sums sum_t p_it z_tg added once per block. Each B is carried as two bf16
// (hi + lo, warp_mma::SplitBf16) so that the result is within about 2^-17 of fp32 arithmetic
// and keeps fp32's range (a query's scale never needs a per-block normalization).
//
// A lane's rows of an A tile are picked so that its codes sit next to each other in the
// block: tile row g holds token (or channel) 2g and row g + 8 token 2g + 1, so one window of
// the packed codes gives both (the score and readout tiles are permuted back on the way out).
// Query rows are the mma's n: up to 8 rows per item (GQA groups of 1-8); B's columns beyond
// `rows` repeat its rows and C's are never read (a column of C depends on its column of B alone).
// A warp takes J tiles side by side (KJ token tiles, VJ channel tiles), so that a lane's 2J
// codes of a row share one window and every B fragment serves J products.
#pragma once

#include <type_traits>

#include "attend_math.h"
#include "warp_mma.h"

namespace kvq::kernels::cuda::tc_attend {

using attend_math::Geometry;
using attend_math::kBiasSlices;
using attend_math::kNegInf;
using attend_math::LoadHalf;
using attend_math::Window32;

inline constexpr int kRows = 8;       // the mma's n: an item's query rows, padded
inline constexpr int kThreads = 128;  // four warps
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kPad = 8;  // bf16 after each B row: a warp's B loads hit 32 distinct banks

struct TcGeometry {
  Geometry b;  // the block layouts and the staging buffers' sizes (MakeGeometry's)
  int rows;
  int key_steps, side_steps;  // 16-channel k steps of the scores over key codes, side codes
  int kq, bq_stride;          // the scores' k extent (16 (key_steps + side_steps)), B row stride
  int bv_stride;              // the readout's B row stride (G + kPad)
  int zpairs, zslices;        // (value group + the denominator) x rows, token slices of their sums
  int kj, vj;                 // tiles a warp takes side by side: score tiles, readout tiles
  int g_shift;                // log2 G (G is 32, 64 or 128): threads tid & (G - 1) take token t
  int sm_q, sm_uq, sm_bq_hi, sm_bq_lo, sm_zpart, sm_vz, sm_width, sm_off, sm_part, sm_p, sm_w,
      sm_pmax, sm_m, sm_corr, sm_bv_hi, sm_bv_lo, sm_zt, sm_o, sm_l, sm_stage, sm_bytes;
};

KVQ_HD TcGeometry MakeTcGeometry(const AttendParams& p) {
  TcGeometry tg{};
  tg.b = attend_math::MakeGeometry(p);
  const Geometry& g = tg.b;
  tg.rows = p.rows;
  tg.key_steps = g.d / 16;
  tg.side_steps = (g.rank + 15) / 16;
  tg.kq = 16 * (tg.key_steps + tg.side_steps);
  tg.bq_stride = tg.kq + kPad;
  tg.bv_stride = g.G + kPad;
  tg.zpairs = (g.ng + 1) * p.rows;
  tg.zslices = tg.zpairs >= kThreads ? 1 : kThreads / tg.zpairs;
  // Two tiles a warp where the four warps still all get work, and (readout) a value group
  // spans both.
  tg.kj = g.G >= 128 ? 2 : 1;
  tg.g_shift = g.G == 128 ? 7 : g.G == 64 ? 6 : 5;
  tg.vj = g.d >= 128 && g.value_group % 32 == 0 ? 2 : 1;
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += attend_math::RoundUp16(bytes);
    return o;
  };
  tg.sm_q = take(4 * p.rows * g.d);  // [d][rows]
  tg.sm_uq = take(4 * p.rows * g.rank);
  tg.sm_bq_hi = take(2 * p.rows * tg.bq_stride);  // [rows][bq_stride] bf16
  tg.sm_bq_lo = take(2 * p.rows * tg.bq_stride);
  tg.sm_zpart = take(4 * kBiasSlices * kRows);
  tg.sm_vz = take(4 * g.G * g.ng);
  tg.sm_width = take(4 * g.G);
  tg.sm_off = take(4 * (g.G + 1));
  tg.sm_part = take(4 * p.rows * g.G);  // raw scores [rows][G]
  tg.sm_p = take(4 * p.rows * g.G);     // logits [rows][G]
  tg.sm_w = take(4 * g.G * kRows);      // weights [G][kRows]
  tg.sm_pmax = take(4 * kThreads);
  tg.sm_m = take(4 * kRows);
  tg.sm_corr = take(4 * kRows);
  tg.sm_bv_hi = take(2 * g.ng * p.rows * tg.bv_stride);  // [ng][rows][bv_stride] bf16
  tg.sm_bv_lo = take(2 * g.ng * p.rows * tg.bv_stride);
  tg.sm_zt = take(4 * tg.zslices * tg.zpairs);  // [zslices][ng + 1][rows]
  tg.sm_o = take(4 * p.rows * g.d);             // the running output [rows][d]
  tg.sm_l = take(4 * kRows);
  tg.sm_stage = take(2 * g.stage_bytes);
  tg.sm_bytes = at;
  return tg;
}

// Why the tensor-core program cannot run these params (AttendUnsupported's checks aside), or
// null.
KVQ_HD const char* TcUnsupported(const AttendParams& p) {
  if (p.rows > kRows) return "rows: the tensor-core attend takes at most 8 query rows per item";
  if (p.codec.value_group % 16 != 0)
    return "value_group: the tensor-core attend needs a multiple of 16 (one scale per tile)";
  if (MakeTcGeometry(p).sm_bytes > 227 * 1024)
    return "head_dim x key_group: the tensor-core thread block's shared memory exceeds 227 KiB";
  return nullptr;
}

// Calls f(KJ, VJ) with tg's tilings as std::integral_constant values (one program each).
template <class F>
inline void WithTilings(const TcGeometry& tg, F&& f) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (tg.kj == 2) {
    if (tg.vj == 2)
      f(Two{}, Two{});
    else
      f(Two{}, One{});
  } else {
    if (tg.vj == 2)
      f(One{}, Two{});
    else
      f(One{}, One{});
  }
}

// Two bf16 at p (4-aligned) as one register.
KVQ_HD uint32_t LoadPair(const uint16_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

// The packed codes from bit `bit` of the row at `row` on, shifted down to bit 0 (at least 25
// bits of them; 32 when `bit` is a multiple of 8).
// On the GPU by two aligned 4-byte loads and one funnel shift from the row's aligned base.
KVQ_HD uint32_t WindowAt(const uint8_t* row, int bit) {
#ifdef __CUDA_ARCH__
  const int lo = static_cast<int>(reinterpret_cast<uintptr_t>(row) & 3u);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(row - lo);
  const int at = 8 * lo + bit;
  return __funnelshift_r(w[at >> 5], w[(at >> 5) + 1], at & 31);
#else
  return Window32(row + (bit >> 3)) >> (bit & 7);
#endif
}

// The low 16 bits of x, then those of y, as one register.
KVQ_HD uint32_t Halves(uint32_t x, uint32_t y) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, 0x5410);
#else
  return (x & 0xFFFFu) | (y << 16);
#endif
}

// The A fragments of J tiles from a lane's four windows w[e] (code k of window e at bit
// k bits[e]): a[j][r + 2h] pairs code 2j + r of windows 2h and 2h + 1 (the m16n8k16 A layout,
// warp_mma.h, once the caller has put the lane's rows g and g + 8 of tile j at codes 2j and
// 2j + 1 and its k columns 2t, 2t + 1, 2t + 8, 2t + 9 in windows 0..3). When every window has
// the same width and a pair of windows fits a register's halves, two codes a shift and a mask
// (bits_max: the widest code, for warp_mma::CodePair).
template <int J>
KVQ_HD void FragmentsFromWindows(const uint32_t (&w)[4], const int (&bits)[4], bool uniform,
                                 int bits_max, uint32_t (&a)[J][4]) {
  if (uniform && 2 * J * bits[0] <= 16) {
    const int b = bits[0];
    const uint32_t mask = ((1u << b) - 1u) * 0x10001u;
    const uint32_t p0 = Halves(w[0], w[1]), p1 = Halves(w[2], w[3]);
    KVQ_UNROLL
    for (int j = 0; j < J; ++j) {
      KVQ_UNROLL
      for (int r = 0; r < 2; ++r) {
        a[j][r] = warp_mma::CodePair((p0 >> ((2 * j + r) * b)) & mask, b);
        a[j][r + 2] = warp_mma::CodePair((p1 >> ((2 * j + r) * b)) & mask, b);
      }
    }
    return;
  }
  KVQ_UNROLL
  for (int j = 0; j < J; ++j) {
    KVQ_UNROLL
    for (int r = 0; r < 2; ++r) {
      KVQ_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int b0 = bits[2 * h], b1 = bits[2 * h + 1];
        const uint32_t lo = (w[2 * h] >> ((2 * j + r) * b0)) & ((1u << b0) - 1u);
        const uint32_t hi = (w[2 * h + 1] >> ((2 * j + r) * b1)) & ((1u << b1) - 1u);
        a[j][r + 2 * h] = warp_mma::CodePair(lo | (hi << 16), bits_max);
      }
    }
  }
}

// A lane's A fragments of J score tiles over the warp's 16 J tokens from tok0: the lane's 2J
// tokens tok0 + 2J (lane / 4) + 0 .. 2J - 1 sit next to each other in every channel's row (tile
// j's rows g and g + 8 take its tokens 2j and 2j + 1); k step ks: key channels 16 ks + 2 (lane
// % 4) + {0, 1, 8, 9}, or past key_steps the side coefficients (zero beyond rank).
template <int J>
KVQ_HD void KeyFragments(const TcGeometry& tg, const uint8_t* kb, int tok0, int ks, int lane,
                         uint32_t (&a)[J][4]) {
  const Geometry& g = tg.b;
  const bool side = ks >= tg.key_steps;
  const int bits = side ? g.side_bits : g.key_bits;
  const uint8_t* rows = side ? kb + g.s_codes : kb + g.k_codes;
  const int row_bytes = side ? g.side_row : g.key_row;
  const int c0 = 16 * (side ? ks - tg.key_steps : ks), limit = side ? g.rank : g.d;
  const int bit = (tok0 + 2 * J * (lane >> 2)) * bits;
  uint32_t w[4];
  KVQ_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int c = c0 + 2 * (lane & 3) + (e & 1) + 8 * (e >> 1);
    w[e] = c < limit ? WindowAt(rows + c * row_bytes, bit) : 0u;
  }
  const int widths[4] = {bits, bits, bits, bits};
  FragmentsFromWindows<J>(w, widths, true, bits, a);
}

// A lane's A fragments of J readout tiles over the warp's 16 J channels from ch0: the lane's 2J
// channels ch0 + 2J (lane / 4) + 0 .. 2J - 1 sit next to each other in every token's record
// (tile j's rows g and g + 8 take its channels 2j and 2j + 1); k step ks: tokens 16 ks +
// 2 (lane % 4) + {0, 1, 8, 9}, each record at off[t], width[t] bits.
template <int J>
KVQ_HD void ValueFragments(const TcGeometry& tg, const uint8_t* vb, const int* off,
                           const int* width, int ch0, int ks, int lane, uint32_t (&a)[J][4]) {
  const Geometry& g = tg.b;
  const int ch = ch0 + 2 * J * (lane >> 2);
  uint32_t w[4];
  int bits[4];
  KVQ_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int t = 16 * ks + 2 * (lane & 3) + (e & 1) + 8 * (e >> 1);
    bits[e] = width[t];
    w[e] = WindowAt(vb + off[t] + 4 * g.ng, ch * bits[e]);
  }
  FragmentsFromWindows<J>(w, bits, g.value_bits != 0, g.value_bits == 0 ? 4 : g.value_bits, a);
}

// The B row a lane reads (BFragments): its column n = lane / 4, or for n >= rows row n % rows
// (results never read; the same address as another lane's, so no bank conflict).
KVQ_HD int BRow(int lane, int rows) { return (lane >> 2) % rows; }

// A lane's B fragments (hi and lo) from rows [n][k] of bf16 at `stride`: row `row` (BRow),
// k = k0 + 2 (lane % 4) (+ 8).
KVQ_HD void BFragments(const uint16_t* hi, const uint16_t* lo, int stride, int row, int k0,
                       int lane, uint32_t (&bh)[2], uint32_t (&bl)[2]) {
  const int at = row * stride + k0 + 2 * (lane & 3);
  bh[0] = LoadPair(hi + at);
  bh[1] = LoadPair(hi + at + 8);
  bl[0] = LoadPair(lo + at);
  bl[1] = LoadPair(lo + at + 8);
}

// A thread's registers across blocks: which (value group, row, token slice) of the zero-point
// sums it adds (zpair_i < 0: none), found once rather than by a division per block.
struct TcState {
  int zpair_gr = 0, zpair_i = -1, zslice = 0;
};

// One thread block of the tensor-core attend: item `item`, blocks of range `split` of
// `splits`; sm: tg.sm_bytes of shared memory (16-aligned). Per block: Prep (the next block's
// copies; the scores' B and bias; per-token record offsets), Scores (warps over token tiles;
// the value scales to fp32), Logits, RowMax, Weights, ValueB (the readout's B and the zero
// point and denominator sums), Readout (warps over channel tiles).
template <int KJ, int VJ, class Cta>
KVQ_HD void TcAttendCta(Cta& cta, const AttendParams& p, const TcGeometry& tg, uint8_t* sm,
                        int item, int split, int splits) {
  const Geometry& g = tg.b;
  const int d = g.d, G = g.G, rows = tg.rows, T = kThreads, ng = g.ng;
  float* qs = reinterpret_cast<float*>(sm + tg.sm_q);
  float* uqs = reinterpret_cast<float*>(sm + tg.sm_uq);
  uint16_t* bq_hi = reinterpret_cast<uint16_t*>(sm + tg.sm_bq_hi);
  uint16_t* bq_lo = reinterpret_cast<uint16_t*>(sm + tg.sm_bq_lo);
  float* zpart = reinterpret_cast<float*>(sm + tg.sm_zpart);
  float* vz = reinterpret_cast<float*>(sm + tg.sm_vz);
  int* width = reinterpret_cast<int*>(sm + tg.sm_width);
  int* off = reinterpret_cast<int*>(sm + tg.sm_off);
  float* part = reinterpret_cast<float*>(sm + tg.sm_part);
  float* pr = reinterpret_cast<float*>(sm + tg.sm_p);
  float* pw = reinterpret_cast<float*>(sm + tg.sm_w);
  float* pmax = reinterpret_cast<float*>(sm + tg.sm_pmax);
  float* m = reinterpret_cast<float*>(sm + tg.sm_m);
  float* corr = reinterpret_cast<float*>(sm + tg.sm_corr);
  uint16_t* bv_hi = reinterpret_cast<uint16_t*>(sm + tg.sm_bv_hi);
  uint16_t* bv_lo = reinterpret_cast<uint16_t*>(sm + tg.sm_bv_lo);
  float* zt = reinterpret_cast<float*>(sm + tg.sm_zt);
  float* o = reinterpret_cast<float*>(sm + tg.sm_o);
  float* l = reinterpret_cast<float*>(sm + tg.sm_l);

  const attend_math::ItemRun run =
      attend_math::ItemRunOf(p, g, sm + tg.sm_stage, item, split, splits);
  const int b0 = run.b0, b1 = run.b1;
  const float *q = run.q, *uq = run.uq;
  auto stage = [&](int b, int tid) { run.Stage(g, b, tid, T); };

  cta.Phase([&](int tid, TcState& st) {
    if (b0 < b1) stage(b0, tid);
    if (tid < tg.zpairs * tg.zslices) {
      const int pair = tid % tg.zpairs;
      st.zslice = tid / tg.zpairs;
      st.zpair_gr = pair / rows;
      st.zpair_i = pair % rows;
    }
    for (int w = tid; w < rows * d; w += T) {
      qs[w] = q[w % rows * d + w / rows];
      o[w] = 0.0f;
    }
    for (int w = tid; w < rows * g.rank; w += T) uqs[w] = uq[w % rows * g.rank + w / rows];
    if (tid < kRows) {
      m[tid] = kNegInf;
      l[tid] = 0.0f;
    }
    for (int t = tid; g.value_bits != 0 && t <= G; t += T) {
      if (t < G) width[t] = g.value_bits;
      off[t] = format::kHeaderBytes + t * g.value_rec;
    }
    attend_math::WaitStaged();
  });

  for (int b = b0; b < b1; ++b) {
    const uint8_t* kb = run.Key(b);
    const uint8_t* vb = run.Value(b);
    cta.Phase([&](int tid, TcState&) {
      if (b + 1 < b1) stage(b + 1, tid);
      // The scores' B: bq[i][k] = q_ik s_k (k < d), uq_ij ss_j (k = d + j, j < rank).
      for (int k = tid; k < tg.kq; k += T) {
        const int j = k - d;
        const float s = k < d        ? LoadHalf(kb + g.k_scale + 2 * k)
                        : j < g.rank ? LoadHalf(kb + g.s_scale + 2 * j)
                                     : 0.0f;
        const float* qrow = k < d ? qs + k * rows : uqs + (j < g.rank ? j : 0) * rows;
        for (int i = 0; i < rows; ++i)
          warp_mma::SplitBf16(qrow[i] * s, bq_hi + i * tg.bq_stride + k,
                              bq_lo + i * tg.bq_stride + k);
      }
      // The zero points' part of the scores: zpart[sl][i] = sum_c q_ic z_c + side alike.
      for (int w = tid; w < rows * kBiasSlices; w += T) {
        const int i = w % rows, sl = w / rows;
        float a = 0.0f;
        for (int c = sl; c < d; c += kBiasSlices)
          a += qs[c * rows + i] * LoadHalf(kb + g.k_zero + 2 * c);
        for (int c = sl; c < g.rank; c += kBiasSlices)
          a += uqs[c * rows + i] * LoadHalf(kb + g.s_zero + 2 * c);
        zpart[sl * kRows + i] = a;
      }
      for (int t = tid; g.value_bits == 0 && t <= G; t += T) {
        if (t < G) width[t] = format::TagWidth(vb + format::kHeaderBytes, t);
        off[t] = format::kHeaderBytes + g.value_tags + t * 4 * ng +
                 d / 8 * (t + attend_math::TagSum(vb + format::kHeaderBytes, t));
      }
    });
    // Scores: warps over runs of 16 KJ tokens (KJ tiles sharing each B fragment).
    cta.WarpPhase([&](int warp, auto& wp) {
      constexpr int L = std::remove_reference_t<decltype(wp)>::kLanes;
      int brow[L];
      for (int x = 0; x < L; ++x) brow[x] = BRow(wp.Lane(x), rows);
      for (int run0 = 16 * KJ * warp; run0 < G; run0 += 16 * KJ * kWarps) {
        float c[KJ][L][4] = {};
        for (int ks = 0; ks < tg.key_steps + tg.side_steps; ++ks) {
          uint32_t a[KJ][L][4], bh[L][2], bl[L][2];
          for (int x = 0; x < L; ++x) {
            const int lane = wp.Lane(x);
            uint32_t ax[KJ][4];
            KeyFragments<KJ>(tg, kb, run0, ks, lane, ax);
            KVQ_UNROLL
            for (int j = 0; j < KJ; ++j) KVQ_UNROLL
            for (int r = 0; r < 4; ++r) a[j][x][r] = ax[j][r];
            BFragments(bq_hi, bq_lo, tg.bq_stride, brow[x], 16 * ks, lane, bh[x], bl[x]);
          }
          KVQ_UNROLL
          for (int j = 0; j < KJ; ++j) {
            wp.Mma(a[j], bh, c[j]);
            wp.Mma(a[j], bl, c[j]);
          }
        }
        // Tile j's row g (g + 8) is the lane's token 2j (2j + 1); columns 2t, 2t + 1 its rows.
        for (int x = 0; x < L; ++x) {
          const int lane = wp.Lane(x), tok = run0 + 2 * KJ * (lane >> 2), n = 2 * (lane & 3);
          KVQ_UNROLL
          for (int j = 0; j < KJ; ++j) KVQ_UNROLL
          for (int e = 0; e < 4; ++e)
            if (n + (e & 1) < rows) part[(n + (e & 1)) * G + tok + 2 * j + (e >> 1)] = c[j][x][e];
        }
      }
      for (int x = 0; x < L; ++x) {
        const int tid = 32 * warp + wp.Lane(x);
        if (tid == 0 && p.error_flags) {
          const bool ok = attend_math::HeaderMatches(kb, format::kKindKey, p.codec.rotate_keys,
                                                     g.key_bits, g.side_bits, G, d, g.rank) &&
                          attend_math::HeaderMatches(vb, format::kKindValue, p.codec.rotate_values,
                                                     g.value_bits, 0, G, d, g.value_group);
          if (!ok) {
#ifdef __CUDA_ARCH__
            atomicOr(p.error_flags, kAttendHeaderMismatch);
#else
            *p.error_flags |= kAttendHeaderMismatch;
#endif
          }
        }
        const int t = tid & (G - 1);
        const uint8_t* rec = vb + off[t];
        for (int gr = tid >> tg.g_shift; gr < ng; gr += T >> tg.g_shift)
          vz[t * ng + gr] = LoadHalf(rec + 2 * (ng + gr));
      }
    });
    const int masked = b == 0 ? p.masked_prefix : 0;
    cta.Phase([&](int tid, TcState&) {
      attend_math::LogitsPhase(tid, T, rows, G, G, 1, part, 0, p.scale, masked, pr, pmax, zpart,
                               kRows);
    });
    cta.Phase(
        [&](int tid, TcState&) { attend_math::RowMaxPhase(tid, rows, T / rows, pmax, m, corr); });
    cta.Phase(
        [&](int tid, TcState&) { attend_math::WeightsPhase(tid, T, rows, kRows, G, pr, m, pw); });
    // The readout's B: bv[grp][i][t] = p_it s_tg; and the sums over token slices of p_it z_tg
    // (group ng: of p_it, the denominator's terms).
    cta.Phase([&](int tid, TcState& st) {
      {
        const int t = tid & (G - 1);
        const uint8_t* rec = vb + off[t];
        float pt[kRows];
        attend_math::LoadRows<kRows>(pw + t * kRows, pt);
        for (int gr = tid >> tg.g_shift; gr < ng; gr += T >> tg.g_shift) {
          const float sc = LoadHalf(rec + 2 * gr);
          uint16_t* hi = bv_hi + gr * rows * tg.bv_stride + t;
          uint16_t* lo = bv_lo + gr * rows * tg.bv_stride + t;
          KVQ_UNROLL
          for (int i = 0; i < kRows; ++i)
            if (i < rows)
              warp_mma::SplitBf16(pt[i] * sc, hi + i * tg.bv_stride, lo + i * tg.bv_stride);
        }
      }
      if (st.zpair_i >= 0) {
        const int gr = st.zpair_gr, i = st.zpair_i;
        float a = 0.0f;
        if (gr < ng) {
          for (int t = st.zslice; t < G; t += tg.zslices) a += pw[t * kRows + i] * vz[t * ng + gr];
        } else {
          for (int t = st.zslice; t < G; t += tg.zslices) a += pw[t * kRows + i];
        }
        zt[st.zslice * tg.zpairs + gr * rows + i] = a;
      }
    });
    // Readout: warps over 16-channel tiles; o[i][c] = o[i][c] corr_i + this block's terms.
    cta.WarpPhase([&](int warp, auto& wp) {
      constexpr int L = std::remove_reference_t<decltype(wp)>::kLanes;
      int brow[L];
      for (int x = 0; x < L; ++x) brow[x] = BRow(wp.Lane(x), rows);
      auto zsum = [&](int pair) {
        float z = 0.0f;
        for (int sl = 0; sl < tg.zslices; ++sl) z += zt[sl * tg.zpairs + pair];
        return z;
      };
      for (int ch0 = 16 * VJ * warp; ch0 < d; ch0 += 16 * VJ * kWarps) {
        const int gr = ch0 / g.value_group;  // one group: value_group a multiple of 16 VJ
        // This lane's columns' zero-point terms (rows 2 (lane % 4) and the next).
        float z[L][2];
        for (int x = 0; x < L; ++x) {
          const int n = 2 * (wp.Lane(x) & 3);
          z[x][0] = n < rows ? zsum(gr * rows + n) : 0.0f;
          z[x][1] = n + 1 < rows ? zsum(gr * rows + n + 1) : 0.0f;
        }
        const uint16_t* hi = bv_hi + gr * rows * tg.bv_stride;
        const uint16_t* lo = bv_lo + gr * rows * tg.bv_stride;
        float c[VJ][L][4] = {};
        for (int ks = 0; ks < G / 16; ++ks) {
          uint32_t a[VJ][L][4], bh[L][2], bl[L][2];
          for (int x = 0; x < L; ++x) {
            const int lane = wp.Lane(x);
            uint32_t ax[VJ][4];
            ValueFragments<VJ>(tg, vb, off, width, ch0, ks, lane, ax);
            KVQ_UNROLL
            for (int j = 0; j < VJ; ++j) KVQ_UNROLL
            for (int r = 0; r < 4; ++r) a[j][x][r] = ax[j][r];
            BFragments(hi, lo, tg.bv_stride, brow[x], 16 * ks, lane, bh[x], bl[x]);
          }
          KVQ_UNROLL
          for (int j = 0; j < VJ; ++j) {
            wp.Mma(a[j], bh, c[j]);
            wp.Mma(a[j], bl, c[j]);
          }
        }
        // Tile j's row g (g + 8) is the lane's channel 2j (2j + 1); columns 2t, 2t + 1 its rows.
        for (int x = 0; x < L; ++x) {
          const int lane = wp.Lane(x), ch = ch0 + 2 * VJ * (lane >> 2), n = 2 * (lane & 3);
          KVQ_UNROLL
          for (int j = 0; j < VJ; ++j) KVQ_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int i = n + (e & 1), at = i * d + ch + 2 * j + (e >> 1);
            if (i < rows) o[at] = o[at] * corr[i] + c[j][x][e] + z[x][e & 1];
          }
        }
      }
      for (int x = 0; x < L; ++x) {
        const int tid = 32 * warp + wp.Lane(x);
        if (tid < rows) l[tid] = l[tid] * corr[tid] + zsum(ng * rows + tid);
        attend_math::WaitStaged();
      }
    });
  }
  const attend_math::Partials pt = attend_math::PartialsIn(p.workspace, p.items, splits, rows);
  const int64_t at = (static_cast<int64_t>(item) * splits + split) * rows;
  cta.Phase([&](int tid, TcState&) {
    attend_math::WritePartialPhase(tid, T, rows, d, 1, o, l, m, pt.m + at, pt.l + at,
                                   pt.o + at * d);
  });
}

}  // namespace kvq::kernels::cuda::tc_attend
