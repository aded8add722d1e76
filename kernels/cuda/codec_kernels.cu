// CUDA versions of the score hot loop (dot_channels), same contract as kernels.h: raw
// pointers in device memory, sizes, strides and a stream; returns a cudaError_t code.
// Parity against the CPU reference runs only where a GPU is present.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvq::kernels::cuda {

// One thread per (query, token): out[i*os + t] += sum_c w[i*ws + c] * code(c, t).
__global__ void DotChannelsKernel(const uint8_t* codes, int bits, int n_ch, int tokens,
                                  const float* w, int n_q, int64_t ws, float* out, int64_t os) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int i = blockIdx.y;
  if (t >= tokens || i >= n_q) return;
  const int64_t rb = (static_cast<int64_t>(tokens) * bits + 7) / 8;
  const int64_t bit = static_cast<int64_t>(t) * bits;
  float acc = 0.f;
  for (int c = 0; c < n_ch; ++c) {
    const uint8_t* row = codes + c * rb + (bit >> 3);
    uint32_t v = row[0] | (bits + (bit & 7) > 8 ? static_cast<uint32_t>(row[1]) << 8 : 0u);
    acc += w[i * ws + c] * static_cast<float>((v >> (bit & 7)) & ((1u << bits) - 1));
  }
  out[i * os + t] += acc;
}

int DotChannels(const uint8_t* codes, int bits, int n_ch, int tokens, const float* w, int n_q,
                int64_t ws, float* out, int64_t os, cudaStream_t stream) {
  dim3 block(128), grid((tokens + 127) / 128, n_q);
  DotChannelsKernel<<<grid, block, 0, stream>>>(codes, bits, n_ch, tokens, w, n_q, ws, out, os);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvq::kernels::cuda
