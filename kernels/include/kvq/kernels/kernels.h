// The hot loops of the codec behind one small table of raw-pointer functions. Every table
// (scalar reference, AVX2, AVX-512, and the CUDA launchers in kernels/cuda with the same
// file stems) computes the same thing; parity tests hold the optimized ones to the
// reference. Nothing here knows about blocks, caches or Abseil.
//
// Code layout: b-bit codes packed LSB-first in rows; code i of a row occupies bits
// [i*b, i*b+b). Channel-major rows hold one channel over `tokens` tokens
// (tokens*b/8 bytes, tokens a multiple of 32); token rows hold one token's channels.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::kernels {

struct KernelTable {
  const char* name;

  // Per-channel asymmetric quantization over tokens. x: [tokens][ld] fp32 (first n_ch
  // columns used). Writes fp16 scale[n_ch], zero[n_ch] (zero = min, scale = range/(2^b-1),
  // both rounded to fp16 before the codes are computed) and codes[n_ch][tokens*bits/8].
  // Optionally writes the dequantized values to deq [tokens][n_ch] (null: skip).
  void (*quantize_channels)(const float* x, int64_t ld, int tokens, int n_ch, int bits,
                            uint16_t* scale, uint16_t* zero, uint8_t* codes, float* deq);

  // Asymmetric quantization of one token row of n values in groups of `group` channels.
  // Writes fp16 scale[ng], zero[ng] and codes[ceil(n*bits/8)].
  void (*quantize_row)(const float* x, int n, int group, int bits, uint16_t* scale, uint16_t* zero,
                       uint8_t* codes);

  // quantize_row over n_rows rows of x [n_rows][ld] with one width: row t's record at
  // rec + t * rec_bytes receives fp16 scale[ng] | fp16 zero[ng] | codes[ceil(n*bits/8)].
  void (*quantize_rows)(const float* x, int64_t ld, int n_rows, int n, int group, int bits,
                        uint8_t* rec, int64_t rec_bytes);

  // Scores over channel-major codes (keys, or HeadQ side coefficients):
  //   out[i*os + t] = (accumulate ? out[i*os + t] : 0)
  //                   + mult * sum_c q[i*qs + c] * (scale_c * code(c, t) + zero_c)
  // for t < tokens (a multiple of 32), c < n_ch, i < n_q; scale/zero are fp16 [n_ch].
  void (*score_codes)(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
                      const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
                      bool accumulate, float* out, int64_t os);

  // Readout over token rows: out[i*out_stride + c] += sum_t p[i*p_stride + t] * v_hat_t[c].
  // rows: n_rows consecutive records, each fp16 scale[ng] | fp16 zero[ng] | codes of
  // row_bits[t] bits for n channels (ng = ceil(n / group)); v_hat = scale_g * code + zero_g.
  void (*readout_rows)(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n, int group,
                       const float* p, int64_t p_stride, int n_q, float* out, int64_t out_stride);

  // Dense baselines over fp16 data: out[i*os + t] = sum_c q[i*d + c] * k[t*d + c] and
  // out[i*os + c] += sum_t p[i*ps + t] * v[t*d + c].
  void (*dense_scores_f16)(const uint16_t* k, int tokens, int d, const float* q, int n_q,
                           float* out, int64_t out_stride);
  void (*dense_readout_f16)(const uint16_t* v, int tokens, int d, const float* p, int64_t p_stride,
                            int n_q, float* out, int64_t out_stride);

  // HeadQ side coefficients: out[t*r + j] = sum_c (x[t*ld + c] - deq[t*d + c]) * ut[j*d + c]
  // (the residual of the base code projected on U, given transposed as ut [r][d]).
  void (*project_residual)(const float* x, int64_t ld, const float* deq, int tokens, int d,
                           const float* ut, int r, float* out);

  // XXH3-64 with a seed (block checksums). Every table returns the same value; the SIMD
  // tables inline libxxhash's header with their vector width.
  uint64_t (*xxh3)(const void* data, size_t len, uint64_t seed);

  // x[t] = exp(x[t] - shift) for t < n; returns the sum (the softmax denominator).
  float (*exp_sum)(float* x, int64_t n, float shift);

  // In-place softmax of x[0..n) (n >= 1): max, exp and normalization.
  void (*softmax)(float* x, int64_t n);

  // dense_scores_f16 over fp32 rows (the full-precision window, converted).
  void (*dense_scores_f32)(const float* k, int tokens, int d, const float* q, int n_q, float* out,
                           int64_t out_stride);

  // max_t x[t] over n >= 1 values (the shift of a partial softmax, partial_attention.h).
  float (*max_value)(const float* x, int64_t n);

  // Dequantize (decode for reads that return K/V, e.g. GetBlocks), every table bit-identical
  // to the reference (products and sums in the same order, no FMA contraction):
  // channel-major codes [n_ch][tokens*bits/8] to token rows,
  //   out[t*ld + c] = zero_c + scale_c * code(c, t)   (t < tokens, a multiple of 32),
  // or with by_channel to channel rows, out[c*ld + t] (the same values);
  void (*dequantize_channels)(const uint8_t* codes, int bits, int n_ch, int tokens,
                              const uint16_t* scale, const uint16_t* zero, float* out, int64_t ld,
                              bool by_channel);
  // a low-rank term added to token rows (HeadQ's side code times the basis [d][r]):
  //   z_j(t) = sign * (zero_j + scale_j * code(j, t)),
  //   out[t*ld + c] += sum_{j = 0..r-1, in order} basis[c*r + j] * z_j(t),
  // or with by_channel to channel rows, out[c*ld + t];
  void (*add_low_rank)(const uint8_t* codes, int bits, int r, int tokens, const uint16_t* scale,
                       const uint16_t* zero, float sign, const float* basis, int d, float* out,
                       int64_t ld, bool by_channel);
  // token-row records as readout_rows reads them (fp16 scale[ng] | zero[ng] | codes of
  // row_bits[t] bits), out[t*ld + c] = zero_g + scale_g * code_t(c), g = c / group.
  void (*dequantize_rows)(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n,
                          int group, float* out, int64_t ld);

  // Every table gives the reference's bits for these two (the scalar loops, products and sums
  // in order, no contraction): their results feed the next layer's keys and values, whose 2-bit
  // codes turn a last-bit difference into a whole quantization step, so a measured perplexity
  // would move with the CPU a read ran on (a vectorized window readout moved a 2 x 256 decode
  // through the server by 0.8%).
  // Queries projected on a head's basis U [d][r] (HeadQ's U^T q, computed once per read):
  //   out[i*r + j] = sum_{c = 0..d-1, in order} q[i*d + c] * basis[c*r + j].
  void (*project_queries)(const float* q, int n_q, int d, const float* basis, int r, float* out);
  // dense_readout_f16 over fp32 rows (the full-precision window):
  //   out[i*os + c] += sum_{t in order} p[i*ps + t] * v[t*d + c].
  void (*dense_readout_f32)(const float* v, int tokens, int d, const float* p, int64_t p_stride,
                            int n_q, float* out, int64_t out_stride);
};

// The scalar reference (*_ref): plain loops, the definition of correct.
const KernelTable& Ref();
// The best table this CPU supports (AVX-512 > AVX2 > reference), chosen once at run time.
// KVQ_KERNELS=ref|avx2|avx512 in the environment forces one (if supported).
const KernelTable& Best();
// The table the codec uses: Best() unless overridden. SetActive(&Ref()) lets benchmarks and
// tests run the codec on the reference loops; SetActive(nullptr) restores Best().
const KernelTable& Active();
void SetActive(const KernelTable* table);
// Asks the quantizers (quantize_channels, quantize_rows) to fetch [begin, begin + bytes) a
// few cache lines at a time as they run, so that the rows an encoder reads next arrive while
// it computes instead of stalling its next read (a burst of prefetches stalls the core until
// they drain). Replaces the calling thread's previous request; what the quantizers leave is
// fetched by the next checksum (xxh3).
void PrefetchWhileEncoding(const void* begin, size_t bytes);
// A specific table, or null when this CPU (or build) lacks it.
const KernelTable* Avx2();
const KernelTable* Avx512();

}  // namespace kvq::kernels
