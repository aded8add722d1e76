// The normalized Walsh-Hadamard transform of rotated codecs (CodecOptions::rotate_keys,
// rotate_values): Scalar is its definition; the vector paths give its bits.
#pragma once

#include <cstdint>

namespace kvq::core::hadamard {

// x <- H x for the normalized Walsh-Hadamard matrix H (d a power of two): H is symmetric and
// orthogonal, so the same call also undoes it. Butterfly strides 1, 2, 4, ... d / 2, then one
// pass of scaling by 1 / sqrt(d).
void Scalar(float* x, int d);

// The fastest path this CPU has for d (the bits of Scalar on every path).
void Rotate(float* x, int d);
// Rotate of each of n rows held by channel: x [d][n], row t's channel c at x[c * n + t]; the
// same butterflies per element in the same order, so Scalar's bits.
void RotateColumns(float* x, int d, int64_t n);

// The vector paths, for tests: false (x untouched) where this CPU or d does not allow the path.
bool Avx2(float* x, int d);
bool Avx512(float* x, int d);

}  // namespace kvq::core::hadamard
