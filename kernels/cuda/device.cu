// Device-memory API on the CUDA runtime. Without a driver or device every CUDA call fails
// cleanly and BestPool falls back to host memory.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "kvq/kernels/device.h"

namespace kvq::kernels {

const char* PoolName(Pool p) {
  switch (p) {
    case Pool::kHost:
      return "host";
    case Pool::kPinned:
      return "pinned";
    case Pool::kGpu:
      return "gpu";
  }
  return "?";
}

bool CudaAvailable() {
  static const bool ok = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return ok;
}

Pool BestPool(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) {
    if (why) *why = std::to_string(n) + " CUDA device(s): pinned host memory for the store";
    return Pool::kPinned;
  }
  if (why) *why = std::string("no CUDA device (") + cudaGetErrorString(e) + "): host memory";
  return Pool::kHost;
}

void* Allocate(Pool pool, size_t bytes, std::string* err) {
  void* p = nullptr;
  cudaError_t e = cudaSuccess;
  switch (pool) {
    case Pool::kHost:
      p = std::malloc(bytes ? bytes : 1);
      if (!p && err) *err = "out of host memory";
      return p;
    case Pool::kPinned:
      e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
      break;
    case Pool::kGpu:
      e = cudaMalloc(&p, bytes ? bytes : 1);
      break;
  }
  if (e != cudaSuccess) {
    if (err) *err = std::string(PoolName(pool)) + " allocation failed: " + cudaGetErrorString(e);
    return nullptr;
  }
  return p;
}

void Free(Pool pool, void* p) {
  if (!p) return;
  switch (pool) {
    case Pool::kHost:
      std::free(p);
      return;
    case Pool::kPinned:
      cudaFreeHost(p);
      return;
    case Pool::kGpu:
      cudaFree(p);
      return;
  }
}

int Copy(void* dst, Pool dst_pool, const void* src, Pool src_pool, size_t bytes) {
  if (dst_pool != Pool::kGpu && src_pool != Pool::kGpu) {
    std::memcpy(dst, src, bytes);
    return 0;
  }
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess ? 0 : -1;
}

}  // namespace kvq::kernels
