// Shared helpers for the core tests: seeded random tensors and a double-precision reference.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "kvq/core/cache.h"
#include "kvq/core/registry.h"

namespace kvq::testing {

// The default codec before the quality frontier (kvq-eval's headq-kv2: 2-bit keys in groups of
// 32, rank min(4, basis rank) with an 8-bit side code, 2-bit values), for tests whose token
// counts are written around 32-token groups.
inline core::CodecOptions K2G32Codec(const core::BasisManifest& m, bool has_basis) {
  core::CodecOptions c = core::Registry::DefaultCodec(m, has_basis);
  c.key_bits = 2;
  c.key_group = 32;
  c.side_bits = 8;
  return c;
}

inline std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(mean, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Dense attention in double over keys/values [kv][T][d], queries [qh][nq][d].
inline std::vector<float> DenseAttend(const std::vector<float>& k, const std::vector<float>& v,
                                      const std::vector<float>& q, int kv, int qh, int nq,
                                      int64_t T, int d, int64_t causal_offset = -1) {
  std::vector<float> out(static_cast<size_t>(qh) * nq * d, 0.0f);
  const int gq = qh / kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int h = 0; h < qh; ++h)
    for (int i = 0; i < nq; ++i) {
      const int kh = h / gq;
      const int64_t vis = causal_offset < 0 ? T : std::min<int64_t>(T, causal_offset + i + 1);
      std::vector<double> s(vis);
      double mx = -1e300;
      for (int64_t t = 0; t < vis; ++t) {
        double acc = 0;
        for (int c = 0; c < d; ++c)
          acc += double(q[(static_cast<size_t>(h) * nq + i) * d + c]) * k[(kh * T + t) * d + c];
        s[t] = acc * scale;
        mx = std::max(mx, s[t]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t t = 0; t < vis; ++t)
        for (int c = 0; c < d; ++c)
          out[(static_cast<size_t>(h) * nq + i) * d + c] +=
              static_cast<float>(s[t] / sum * v[(kh * T + t) * d + c]);
    }
  return out;
}

inline core::TensorView View3(const std::vector<float>& x, int a, int64_t b, int c) {
  return core::TensorView::Contiguous(x.data(), core::DType::kF32, {a, b, c});
}

}  // namespace kvq::testing
