// The scalar reference kernels: plain loops that define what every other table computes.
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "kvq/kernels/kernels.h"

namespace kvq::kernels {
using namespace internal;

void internal::QuantizeChannelRange(const float* x, int64_t ld, int tokens, int n_ch, int c0,
                                    int c1, int bits, uint16_t* scale, uint16_t* zero,
                                    uint8_t* codes, float* deq) {
  const int64_t rb = RowBytes(tokens, bits);
  const int maxq = (1 << bits) - 1;
  for (int c = c0; c < c1; ++c) {
    float lo = x[c], hi = x[c];
    for (int t = 1; t < tokens; ++t) {
      lo = std::min(lo, x[t * ld + c]);
      hi = std::max(hi, x[t * ld + c]);
    }
    QParams p = MakeParams(lo, hi, bits, &scale[c], &zero[c]);
    for (int t = 0; t < tokens; ++t) {
      int q = QuantizeOne(x[t * ld + c], p, maxq);
      PutCode(codes + c * rb, bits, t, q);
      if (deq) deq[static_cast<int64_t>(t) * n_ch + c] = p.zero + p.scale * q;
    }
  }
}

namespace {

void quantize_channels_ref(const float* x, int64_t ld, int tokens, int n_ch, int bits,
                           uint16_t* scale, uint16_t* zero, uint8_t* codes, float* deq) {
  std::memset(codes, 0, RowBytes(tokens, bits) * n_ch);
  QuantizeChannelRange(x, ld, tokens, n_ch, 0, n_ch, bits, scale, zero, codes, deq);
}

}  // namespace

void internal::QuantizeRowScalar(const float* x, int n, int group, int bits, uint16_t* scale,
                                 uint16_t* zero, uint8_t* codes) {
  const int maxq = (1 << bits) - 1;
  std::memset(codes, 0, RowBytes(n, bits));
  for (int g = 0, c0 = 0; c0 < n; ++g, c0 += group) {
    const int c1 = std::min(n, c0 + group);
    float lo = x[c0], hi = x[c0];
    for (int c = c0 + 1; c < c1; ++c) {
      lo = std::min(lo, x[c]);
      hi = std::max(hi, x[c]);
    }
    QParams p = MakeParams(lo, hi, bits, &scale[g], &zero[g]);
    for (int c = c0; c < c1; ++c) PutCode(codes, bits, c, QuantizeOne(x[c], p, maxq));
  }
}

namespace {

void quantize_row_ref(const float* x, int n, int group, int bits, uint16_t* scale, uint16_t* zero,
                      uint8_t* codes) {
  QuantizeRowScalar(x, n, group, bits, scale, zero, codes);
}

void quantize_rows_ref(const float* x, int64_t ld, int n_rows, int n, int group, int bits,
                       uint8_t* rec, int64_t rec_bytes) {
  const int ng = (n + group - 1) / group;
  std::vector<uint16_t> sz(2 * ng);
  for (int t = 0; t < n_rows; ++t, rec += rec_bytes) {
    QuantizeRowScalar(x + t * ld, n, group, bits, sz.data(), sz.data() + ng, rec + 4 * ng);
    std::memcpy(rec, sz.data(), 4 * ng);
  }
}

void score_codes_ref(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
                     const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
                     bool accumulate, float* out, int64_t os) {
  const int64_t rb = RowBytes(tokens, bits);
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < tokens; ++t) {
      float acc = 0;
      for (int c = 0; c < n_ch; ++c)
        acc += q[i * qs + c] *
               (HalfToFloat(scale[c]) * GetCode(codes + c * rb, bits, t) + HalfToFloat(zero[c]));
      out[i * os + t] = (accumulate ? out[i * os + t] : 0.0f) + mult * acc;
    }
}

void readout_rows_ref(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n, int group,
                      const float* p, int64_t p_stride, int n_q, float* out, int64_t out_stride) {
  const int ng = (n + group - 1) / group;
  std::vector<uint16_t> sz(2 * ng);  // copied out: a record may sit at an odd address
  for (int t = 0; t < n_rows; ++t) {
    std::memcpy(sz.data(), rows, 4 * ng);
    const uint8_t* codes = rows + 4 * ng;
    for (int i = 0; i < n_q; ++i) {
      const float pt = p[i * p_stride + t];
      for (int c = 0; c < n; ++c) {
        float v = HalfToFloat(sz[c / group]) * GetCode(codes, row_bits[t], c) +
                  HalfToFloat(sz[ng + c / group]);
        out[i * out_stride + c] += pt * v;
      }
    }
    rows += 4 * ng + RowBytes(n, row_bits[t]);
  }
}

void dense_scores_f16_ref(const uint16_t* k, int tokens, int d, const float* q, int n_q, float* out,
                          int64_t out_stride) {
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < tokens; ++t) {
      float s = 0;
      for (int c = 0; c < d; ++c)
        s += q[i * d + c] * HalfToFloat(k[static_cast<int64_t>(t) * d + c]);
      out[i * out_stride + t] = s;
    }
}

void dense_readout_f16_ref(const uint16_t* v, int tokens, int d, const float* p, int64_t p_stride,
                           int n_q, float* out, int64_t out_stride) {
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < tokens; ++t) {
      const float pt = p[i * p_stride + t];
      for (int c = 0; c < d; ++c)
        out[i * out_stride + c] += pt * HalfToFloat(v[static_cast<int64_t>(t) * d + c]);
    }
}

void project_residual_ref(const float* x, int64_t ld, const float* deq, int tokens, int d,
                          const float* ut, int r, float* out) {
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < r; ++j) {
      float acc = 0;
      for (int c = 0; c < d; ++c)
        acc += (x[t * ld + c] - deq[static_cast<int64_t>(t) * d + c]) * ut[j * d + c];
      out[t * r + j] = acc;
    }
}

uint64_t xxh3_ref(const void* data, size_t len, uint64_t seed) {
  return XXH3_64bits_withSeed(data, len, seed);
}

float exp_sum_ref(float* x, int64_t n, float shift) {
  double sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    x[t] = std::exp(x[t] - shift);
    sum += x[t];
  }
  return static_cast<float>(sum);
}

void softmax_ref(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, x[t]);
  const float inv = 1.0f / exp_sum_ref(x, n, mx);
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

void dense_scores_f32_ref(const float* k, int tokens, int d, const float* q, int n_q, float* out,
                          int64_t out_stride) {
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < tokens; ++t) {
      float s = 0;
      for (int c = 0; c < d; ++c) s += q[i * d + c] * k[static_cast<int64_t>(t) * d + c];
      out[i * out_stride + t] = s;
    }
}

float max_value_ref(const float* x, int64_t n) {
  float mx = x[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

void dequantize_channels_ref(const uint8_t* codes, int bits, int n_ch, int tokens,
                             const uint16_t* scale, const uint16_t* zero, float* out, int64_t ld,
                             bool by_channel) {
  const int64_t rb = RowBytes(tokens, bits);
  for (int c = 0; c < n_ch; ++c) {
    const float s = HalfToFloat(scale[c]), z = HalfToFloat(zero[c]);
    const uint8_t* row = codes + c * rb;
    for (int t = 0; t < tokens; ++t)
      out[by_channel ? c * ld + t : t * ld + c] = z + s * static_cast<float>(GetCode(row, bits, t));
  }
}

void add_low_rank_ref(const uint8_t* codes, int bits, int r, int tokens, const uint16_t* scale,
                      const uint16_t* zero, float sign, const float* basis, int d, float* out,
                      int64_t ld, bool by_channel) {
  const int64_t rb = RowBytes(tokens, bits);
  std::vector<float> z(r);
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < r; ++j)
      z[j] = sign * (HalfToFloat(zero[j]) +
                     HalfToFloat(scale[j]) * static_cast<float>(GetCode(codes + j * rb, bits, t)));
    for (int c = 0; c < d; ++c) {
      float acc = 0;
      for (int j = 0; j < r; ++j) acc += basis[static_cast<int64_t>(c) * r + j] * z[j];
      out[by_channel ? c * ld + t : t * ld + c] += acc;
    }
  }
}

void dequantize_rows_ref(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n, int group,
                         float* out, int64_t ld) {
  const int ng = (n + group - 1) / group;
  const uint8_t* rec = rows;
  std::vector<uint16_t> sz(2 * ng);  // copied out: records may sit at odd addresses
  for (int t = 0; t < n_rows; ++t) {
    std::memcpy(sz.data(), rec, 4 * ng);
    const uint8_t* codes = rec + 4 * ng;
    for (int c = 0; c < n; ++c) {
      const int g = c / group;
      out[t * ld + c] = HalfToFloat(sz[ng + g]) +
                        HalfToFloat(sz[g]) * static_cast<float>(GetCode(codes, row_bits[t], c));
    }
    rec += 4 * ng + RowBytes(n, row_bits[t]);
  }
}

}  // namespace

void internal::DenseReadoutF32(const float* v, int tokens, int d, const float* p, int64_t p_stride,
                               int n_q, float* out, int64_t out_stride) {
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < tokens; ++t) {
      const float pt = p[i * p_stride + t];
      for (int c = 0; c < d; ++c)
        out[i * out_stride + c] += pt * v[static_cast<int64_t>(t) * d + c];
    }
}

void internal::ProjectQueries(const float* q, int n_q, int d, const float* basis, int r,
                              float* out) {
  for (int i = 0; i < n_q; ++i)
    for (int j = 0; j < r; ++j) {
      float acc = 0;
      for (int c = 0; c < d; ++c) acc += q[i * d + c] * basis[c * r + j];
      out[i * r + j] = acc;
    }
}

const KernelTable& Ref() {
  static const KernelTable t{"ref",
                             quantize_channels_ref,
                             quantize_row_ref,
                             quantize_rows_ref,
                             score_codes_ref,
                             readout_rows_ref,
                             dense_scores_f16_ref,
                             dense_readout_f16_ref,
                             project_residual_ref,
                             xxh3_ref,
                             exp_sum_ref,
                             softmax_ref,
                             dense_scores_f32_ref,
                             max_value_ref,
                             dequantize_channels_ref,
                             add_low_rank_ref,
                             dequantize_rows_ref,
                             internal::ProjectQueries,
                             internal::DenseReadoutF32};
  return t;
}

}  // namespace kvq::kernels
