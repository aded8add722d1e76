// Device scratch for the launchers that take host arrays (AttendFromHost,
// VerifyBlocksFromHost): the arrays are copied into it before a launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace kvq::kernels::cuda {

// A calling thread's device scratch: one allocation, grown as needed and kept for the thread's
// life (a decode step's calls repeat the same sizes). Each entry point keeps its own.
struct HostCallScratch {
  void* p = nullptr;
  size_t bytes = 0;
  ~HostCallScratch() {
    if (p) cudaFree(p);
  }
  cudaError_t Reserve(size_t n) {
    if (n <= bytes) return cudaSuccess;
    if (p) cudaFree(p);
    p = nullptr;
    bytes = 0;
    if (cudaError_t e = cudaMalloc(&p, n); e != cudaSuccess) return e;
    bytes = n;
    return cudaSuccess;
  }
};

// Offsets of the arrays in the scratch, each 256-byte aligned.
struct ScratchLayout {
  size_t total = 0;
  size_t Take(size_t n) {
    const size_t at = total;
    total += (n + 255) & ~size_t{255};
    return at;
  }
};

}  // namespace kvq::kernels::cuda
