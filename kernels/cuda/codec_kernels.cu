// CUDA version of the score hot loop (score_codes in kernels.h, same contract): raw pointers
// in device memory, sizes, strides and a stream; returns a cudaError_t code.
// Parity against the CPU reference runs only where a GPU is present.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/kernels/cuda.h"

namespace kvq::kernels::cuda {

// One thread per (query, token): out = (accumulate ? out : 0)
//   + mult * sum_c q[i*qs + c] * (scale_c * code(c, t) + zero_c).
__global__ void ScoreCodesKernel(const uint8_t* codes, int bits, int n_ch, int tokens,
                                 const __half* scale, const __half* zero, const float* q,
                                 int64_t qs, int n_q, float mult, bool accumulate, float* out,
                                 int64_t os) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int i = blockIdx.y;
  if (t >= tokens || i >= n_q) return;
  const int64_t rb = (static_cast<int64_t>(tokens) * bits + 7) / 8;
  const int64_t bit = static_cast<int64_t>(t) * bits;
  float acc = 0.f;
  for (int c = 0; c < n_ch; ++c) {
    const uint8_t* row = codes + c * rb + (bit >> 3);
    uint32_t v = row[0] | (bits + (bit & 7) > 8 ? static_cast<uint32_t>(row[1]) << 8 : 0u);
    const float code = static_cast<float>((v >> (bit & 7)) & ((1u << bits) - 1));
    acc += q[i * qs + c] * (__half2float(scale[c]) * code + __half2float(zero[c]));
  }
  out[i * os + t] = (accumulate ? out[i * os + t] : 0.f) + mult * acc;
}

int ScoreCodes(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
               const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
               bool accumulate, float* out, int64_t os, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dim3 block(128), grid((tokens + 127) / 128, n_q);
  ScoreCodesKernel<<<grid, block, 0, stream>>>(
      codes, bits, n_ch, tokens, reinterpret_cast<const __half*>(scale),
      reinterpret_cast<const __half*>(zero), q, qs, n_q, mult, accumulate, out, os);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvq::kernels::cuda
