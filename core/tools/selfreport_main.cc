// kvq-selfreport: encodes a built-in synthetic KV example with the default codec and prints
// sizes, bits per element, score/attention error and the kernel table in use.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/core/cache.h"
#include "kvq/core/metrics.h"
#include "kvq/kernels/kernels.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf(
          "usage: kvq-selfreport\nEncodes a built-in example (3 KV heads, 9 query heads, "
          "head_dim 64, 1000 tokens) and reports bits/element and errors.\n");
      return 0;
    }
  using namespace kvq::core;
  const int kv = 3, qh = 9, d = 64, n = 1000;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> k(kv * n * d), v(kv * n * d), q(qh * d);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  CodecOptions o;
  LayerCache cache(o, kv, nullptr);
  auto st = cache.Append(TensorView::Contiguous(k.data(), DType::kF32, {kv, n, d}),
                         TensorView::Contiguous(v.data(), DType::kF32, {kv, n, d}), 0);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  std::vector<float> s(qh * n);
  if (auto e = cache.Score(q.data(), qh, 1, s.data()); !e.ok()) {
    std::fprintf(stderr, "error: %s\n", e.ToString().c_str());
    return 1;
  }
  double kl = 0;
  for (int h = 0; h < qh; ++h) {
    std::vector<float> exact(n);
    for (int t = 0; t < n; ++t) {
      float acc = 0;
      for (int c = 0; c < d; ++c) acc += q[h * d + c] * k[((h / 3) * n + t) * d + c];
      exact[t] = acc / 8.0f;
    }
    kl += AttentionKL(exact.data(), s.data() + h * n, n) / qh;
  }
  SizeReport r = cache.Size();
  std::printf(
      "kvq codec self-report\n  kernels: %s\n  codec: %s\n  tokens: %lld (%lld encoded, "
      "%lld in window)\n  K bits/element: %.3f steady, %.3f at this context\n  V "
      "bits/element: %.3f steady, %.3f at this context\n  bytes stored: %lld (fp16 would "
      "be %lld)\n  mean attention KL vs exact: %.5f\n",
      kvq::kernels::Best().name, o.ToString().c_str(), (long long)r.tokens,
      (long long)r.encoded_tokens, (long long)r.window_tokens, r.k_bits_steady(),
      r.k_bits_effective(), r.v_bits_steady(), r.v_bits_effective(), (long long)r.total_bytes(),
      (long long)(2LL * kv * n * d * 2), kl);
  return 0;
}
