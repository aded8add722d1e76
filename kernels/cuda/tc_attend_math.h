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
// Query rows are the mma's n: up to 8 rows per item (GQA groups of 1-8); rows beyond `rows`
// carry zero queries and weights.
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
  int sm_q, sm_uq, sm_bq_hi, sm_bq_lo, sm_zpart, sm_vs, sm_vz, sm_width, sm_off, sm_part, sm_p,
      sm_w, sm_pmax, sm_m, sm_corr, sm_bv_hi, sm_bv_lo, sm_zt, sm_o, sm_l, sm_stage, sm_bytes;
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
  tg.zpairs = (g.ng + 1) * kRows;
  tg.zslices = tg.zpairs >= kThreads ? 1 : kThreads / tg.zpairs;
  int at = 0;
  auto take = [&at](int bytes) {
    const int o = at;
    at += attend_math::RoundUp16(bytes);
    return o;
  };
  tg.sm_q = take(4 * kRows * g.d);  // [d][kRows]
  tg.sm_uq = take(4 * kRows * g.rank);
  tg.sm_bq_hi = take(2 * kRows * tg.bq_stride);  // [kRows][bq_stride] bf16
  tg.sm_bq_lo = take(2 * kRows * tg.bq_stride);
  tg.sm_zpart = take(4 * kBiasSlices * kRows);
  tg.sm_vs = take(4 * g.G * g.ng);  // [G][ng]: raw value scales, zero points
  tg.sm_vz = take(4 * g.G * g.ng);
  tg.sm_width = take(4 * g.G);
  tg.sm_off = take(4 * (g.G + 1));
  tg.sm_part = take(4 * kRows * g.G);  // raw scores [rows][G]
  tg.sm_p = take(4 * kRows * g.G);     // logits [rows][G]
  tg.sm_w = take(4 * g.G * kRows);     // weights [G][kRows]
  tg.sm_pmax = take(4 * kThreads);
  tg.sm_m = take(4 * kRows);
  tg.sm_corr = take(4 * kRows);
  tg.sm_bv_hi = take(2 * g.ng * kRows * tg.bv_stride);  // [ng][kRows][bv_stride] bf16
  tg.sm_bv_lo = take(2 * g.ng * kRows * tg.bv_stride);
  tg.sm_zt = take(4 * tg.zslices * tg.zpairs);  // [zslices][ng + 1][kRows]
  tg.sm_o = take(4 * kRows * g.d);              // the running output [kRows][d]
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

// Two adjacent codes of `bits` from bit `bit` of the packed row at `row`.
KVQ_HD void CodesAt(const uint8_t* row, int bit, int bits, uint32_t* c0, uint32_t* c1) {
  const uint32_t w = Window32(row + (bit >> 3)) >> (bit & 7), mask = (1u << bits) - 1u;
  *c0 = w & mask;
  *c1 = (w >> bits) & mask;
}

// A lane's A fragment of the scores: token tile `tile` (tokens 16 tile + 2 (lane / 4) and the
// next in rows g and g + 8), k step ks (key channels 16 ks.., or side coefficients past
// key_steps; those beyond rank are zero).
KVQ_HD void KeyFragment(const TcGeometry& tg, const uint8_t* kb, int tile, int ks, int lane,
                        uint32_t (&a)[4]) {
  const Geometry& g = tg.b;
  const int gq = lane >> 2, t4 = lane & 3, tok = 16 * tile + 2 * gq;
  const bool side = ks >= tg.key_steps;
  const int bits = side ? g.side_bits : g.key_bits;
  uint32_t c[4][2];
  KVQ_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int kk = 2 * t4 + (e & 1) + 8 * (e >> 1);
    if (!side) {
      CodesAt(kb + g.k_codes + (16 * ks + kk) * g.key_row, tok * bits, bits, &c[e][0], &c[e][1]);
    } else if (const int j = 16 * (ks - tg.key_steps) + kk; j < g.rank) {
      CodesAt(kb + g.s_codes + j * g.side_row, tok * bits, bits, &c[e][0], &c[e][1]);
    } else {
      c[e][0] = c[e][1] = 0;
    }
  }
  a[0] = warp_mma::CodePair(c[0][0], c[1][0], bits);  // token tok, channels 2t4, 2t4 + 1
  a[1] = warp_mma::CodePair(c[0][1], c[1][1], bits);  // token tok + 1
  a[2] = warp_mma::CodePair(c[2][0], c[3][0], bits);  // channels 2t4 + 8, 2t4 + 9
  a[3] = warp_mma::CodePair(c[2][1], c[3][1], bits);
}

// A lane's A fragment of the readout: channels c0 + 2 (lane / 4) and the next in rows g and
// g + 8, tokens 16 ks + 2 (lane % 4) + {0, 1, 8, 9} (each record at off[t], width[t] bits).
KVQ_HD void ValueFragment(const TcGeometry& tg, const uint8_t* vb, const int* off, const int* width,
                          int c0, int ks, int lane, uint32_t (&a)[4]) {
  const Geometry& g = tg.b;
  const int gq = lane >> 2, t4 = lane & 3, ch = c0 + 2 * gq;
  uint32_t c[4][2];
  KVQ_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int t = 16 * ks + 2 * t4 + (e & 1) + 8 * (e >> 1), bits = width[t];
    CodesAt(vb + off[t] + 4 * g.ng, ch * bits, bits, &c[e][0], &c[e][1]);
  }
  const int bits = g.value_bits == 0 ? 4 : g.value_bits;  // per-token widths: at most 4
  a[0] = warp_mma::CodePair(c[0][0], c[1][0], bits);      // channel ch, tokens t, t + 1
  a[1] = warp_mma::CodePair(c[0][1], c[1][1], bits);      // channel ch + 1
  a[2] = warp_mma::CodePair(c[2][0], c[3][0], bits);      // tokens t + 8, t + 9
  a[3] = warp_mma::CodePair(c[2][1], c[3][1], bits);
}

// A lane's B fragments (hi and lo) from rows [n][k] of bf16 at `stride`: n = lane / 4,
// k = k0 + 2 (lane % 4) (+ 8).
KVQ_HD void BFragments(const uint16_t* hi, const uint16_t* lo, int stride, int k0, int lane,
                       uint32_t (&bh)[2], uint32_t (&bl)[2]) {
  const int at = (lane >> 2) * stride + k0 + 2 * (lane & 3);
  bh[0] = LoadPair(hi + at);
  bh[1] = LoadPair(hi + at + 8);
  bl[0] = LoadPair(lo + at);
  bl[1] = LoadPair(lo + at + 8);
}

struct NoState {};

// One thread block of the tensor-core attend: item `item`, blocks of range `split` of
// `splits`; sm: tg.sm_bytes of shared memory (16-aligned). Per block: Prep (the next block's
// copies; the scores' B and bias; per-token record offsets), Scores (warps over token tiles;
// the value scales to fp32), Logits, RowMax, Weights, ValueB (the readout's B and the zero
// point and denominator sums), Readout (warps over channel tiles).
template <class Cta>
KVQ_HD void TcAttendCta(Cta& cta, const AttendParams& p, const TcGeometry& tg, uint8_t* sm,
                        int item, int split, int splits) {
  const Geometry& g = tg.b;
  const int d = g.d, G = g.G, rows = tg.rows, T = kThreads, ng = g.ng;
  float* qs = reinterpret_cast<float*>(sm + tg.sm_q);
  float* uqs = reinterpret_cast<float*>(sm + tg.sm_uq);
  uint16_t* bq_hi = reinterpret_cast<uint16_t*>(sm + tg.sm_bq_hi);
  uint16_t* bq_lo = reinterpret_cast<uint16_t*>(sm + tg.sm_bq_lo);
  float* zpart = reinterpret_cast<float*>(sm + tg.sm_zpart);
  float* vs = reinterpret_cast<float*>(sm + tg.sm_vs);
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

  cta.Phase([&](int tid, NoState&) {
    if (b0 < b1) stage(b0, tid);
    for (int w = tid; w < kRows * d; w += T) {
      const int c = w / kRows, i = w % kRows;
      qs[w] = i < rows ? q[i * d + c] : 0.0f;
      o[w] = 0.0f;
    }
    for (int w = tid; w < kRows * g.rank; w += T) {
      const int c = w / kRows, i = w % kRows;
      uqs[w] = i < rows ? p.side_sign * uq[i * g.rank + c] : 0.0f;
    }
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
    cta.Phase([&](int tid, NoState&) {
      if (b + 1 < b1) stage(b + 1, tid);
      // The scores' B: bq[i][k] = q_ik s_k (k < d), side_sign uq_ij ss_j (k = d + j, j < rank).
      for (int w = tid; w < kRows * tg.kq; w += T) {
        const int i = w / tg.kq, k = w % tg.kq, j = k - d;
        float x = 0.0f;
        if (k < d)
          x = qs[k * kRows + i] * LoadHalf(kb + g.k_scale + 2 * k);
        else if (j < g.rank)
          x = uqs[j * kRows + i] * LoadHalf(kb + g.s_scale + 2 * j);
        warp_mma::SplitBf16(x, bq_hi + i * tg.bq_stride + k, bq_lo + i * tg.bq_stride + k);
      }
      // The zero points' part of the scores: zpart[sl][i] = sum_c q_ic z_c + side alike.
      for (int w = tid; w < kRows * kBiasSlices; w += T) {
        const int i = w % kRows, sl = w / kRows;
        float a = 0.0f;
        for (int c = sl; c < d; c += kBiasSlices)
          a += qs[c * kRows + i] * LoadHalf(kb + g.k_zero + 2 * c);
        for (int c = sl; c < g.rank; c += kBiasSlices)
          a += uqs[c * kRows + i] * LoadHalf(kb + g.s_zero + 2 * c);
        zpart[w] = a;
      }
      for (int t = tid; g.value_bits == 0 && t <= G; t += T) {
        if (t < G) width[t] = format::TagWidth(vb + format::kHeaderBytes, t);
        off[t] = format::kHeaderBytes + g.value_tags + t * 4 * ng +
                 d / 8 * (t + attend_math::TagSum(vb + format::kHeaderBytes, t));
      }
    });
    cta.WarpPhase([&](int warp, auto& wp) {
      constexpr int L = std::remove_reference_t<decltype(wp)>::kLanes;
      for (int tile = warp; tile < G / 16; tile += kWarps) {
        float c[L][4] = {};
        for (int ks = 0; ks < tg.key_steps + tg.side_steps; ++ks) {
          uint32_t a[L][4], bh[L][2], bl[L][2];
          for (int x = 0; x < L; ++x) {
            const int lane = wp.Lane(x);
            KeyFragment(tg, kb, tile, ks, lane, a[x]);
            BFragments(bq_hi, bq_lo, tg.bq_stride, 16 * ks, lane, bh[x], bl[x]);
          }
          wp.Mma(a, bh, c);
          wp.Mma(a, bl, c);
        }
        for (int x = 0; x < L; ++x) {
          const int lane = wp.Lane(x), tok = 16 * tile + 2 * (lane >> 2), n = 2 * (lane & 3);
          KVQ_UNROLL
          for (int e = 0; e < 4; ++e)
            if (n + (e & 1) < rows) part[(n + (e & 1)) * G + tok + (e >> 1)] = c[x][e];
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
        for (int w = tid; w < G * ng; w += T) {
          const uint8_t* rec = vb + off[w / ng];
          vs[w] = LoadHalf(rec + 2 * (w % ng));
          vz[w] = LoadHalf(rec + 2 * (ng + w % ng));
        }
      }
    });
    const int masked = b == 0 ? p.masked_prefix : 0;
    cta.Phase([&](int tid, NoState&) {
      attend_math::LogitsPhase(tid, T, rows, G, G, 1, part, 0, p.scale, masked, pr, pmax, zpart,
                               kRows);
    });
    cta.Phase(
        [&](int tid, NoState&) { attend_math::RowMaxPhase(tid, rows, T / rows, pmax, m, corr); });
    cta.Phase(
        [&](int tid, NoState&) { attend_math::WeightsPhase(tid, T, rows, kRows, G, pr, m, pw); });
    // The readout's B: bv[grp][i][t] = p_it s_tg; and the sums over token slices of p_it z_tg
    // (group ng: of p_it, the denominator's terms).
    cta.Phase([&](int tid, NoState&) {
      for (int w = tid; w < ng * kRows * G; w += T) {
        const int gr = w / (kRows * G), i = w / G % kRows, t = w % G;
        const int at = (gr * kRows + i) * tg.bv_stride + t;
        warp_mma::SplitBf16(pw[t * kRows + i] * vs[t * ng + gr], bv_hi + at, bv_lo + at);
      }
      for (int w = tid; w < tg.zpairs * tg.zslices; w += T) {
        const int pair = w % tg.zpairs, sl = w / tg.zpairs, gr = pair / kRows, i = pair % kRows;
        float a = 0.0f;
        for (int t = sl; t < G; t += tg.zslices)
          a += pw[t * kRows + i] * (gr < ng ? vz[t * ng + gr] : 1.0f);
        zt[w] = a;
      }
    });
    // Readout: warps over 16-channel tiles; o[i][c] = o[i][c] corr_i + this block's terms.
    cta.WarpPhase([&](int warp, auto& wp) {
      constexpr int L = std::remove_reference_t<decltype(wp)>::kLanes;
      auto zsum = [&](int pair) {
        float z = 0.0f;
        for (int sl = 0; sl < tg.zslices; ++sl) z += zt[sl * tg.zpairs + pair];
        return z;
      };
      for (int ct = warp; ct < d / 16; ct += kWarps) {
        const int c0 = 16 * ct, gr = c0 / g.value_group;
        const uint16_t* hi = bv_hi + gr * kRows * tg.bv_stride;
        const uint16_t* lo = bv_lo + gr * kRows * tg.bv_stride;
        float c[L][4] = {};
        for (int ks = 0; ks < G / 16; ++ks) {
          uint32_t a[L][4], bh[L][2], bl[L][2];
          for (int x = 0; x < L; ++x) {
            const int lane = wp.Lane(x);
            ValueFragment(tg, vb, off, width, c0, ks, lane, a[x]);
            BFragments(hi, lo, tg.bv_stride, 16 * ks, lane, bh[x], bl[x]);
          }
          wp.Mma(a, bh, c);
          wp.Mma(a, bl, c);
        }
        for (int x = 0; x < L; ++x) {
          const int lane = wp.Lane(x), ch = c0 + 2 * (lane >> 2), n = 2 * (lane & 3);
          KVQ_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int i = n + (e & 1), at = i * d + ch + (e >> 1);
            if (i < rows) o[at] = o[at] * corr[i] + c[x][e] + zsum(gr * kRows + i);
          }
        }
      }
      for (int x = 0; x < L; ++x) {
        const int tid = 32 * warp + wp.Lane(x);
        if (tid < rows) l[tid] = l[tid] * corr[tid] + zsum(ng * kRows + tid);
        attend_math::WaitStaged();
      }
    });
  }
  const attend_math::Partials pt = attend_math::PartialsIn(p.workspace, p.items, splits, rows);
  const int64_t at = (static_cast<int64_t>(item) * splits + split) * rows;
  cta.Phase([&](int tid, NoState&) {
    attend_math::WritePartialPhase(tid, T, rows, d, 1, o, l, m, pt.m + at, pt.l + at,
                                   pt.o + at * d);
  });
}

}  // namespace kvq::kernels::cuda::tc_attend
