// RoPE as the Llama-family models here apply it: pair j of each head rotated by the angle
// position * inv_freq[j]. Shared by the forward pass (llama.cc) and the evaluation lever that
// quantizes keys before RoPE (eval_levers.h), which undoes and redoes the same rotation.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::frontend {

struct Rope {
  bool halves = false;          // pair j is (x[j], x[j + P]); else (x[2j], x[2j + 1])
  std::vector<float> inv_freq;  // P = rotated dimensions / 2 entries
};

// Rotates one head's row e by the angles whose cosines and sines are c[j], s[j] (j < P), or
// by their negatives when `inverse`.
inline void RotatePairs(float* e, const float* c, const float* s, int P, bool halves,
                        bool inverse) {
  const int stride = halves ? 1 : 2, off = halves ? P : 1;
  for (int j = 0; j < P; ++j) {
    float* pa = e + stride * j;
    float* pb = pa + off;
    const float a = *pa, b = *pb;
    const float sj = inverse ? -s[j] : s[j];
    *pa = a * c[j] - b * sj;
    *pb = a * sj + b * c[j];
  }
}

// cos / sin of positions [start, start + n) for every pair: [n][P] each.
void RopeAngles(const Rope& r, int64_t start, int n, std::vector<float>* cos_out,
                std::vector<float>* sin_out);

// Rotates rows [n][heads][head_dim] at positions [start, start + n) (inverse: back).
void RotateRows(const Rope& r, int64_t start, int n, int heads, int head_dim, float* rows,
                bool inverse);

}  // namespace kvq::frontend
