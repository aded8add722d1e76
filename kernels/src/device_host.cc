// Device-memory API without CUDA: host memory only; pinned and gpu report why not.
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

bool CudaAvailable() { return false; }

Pool BestPool(std::string* why) {
  if (why) *why = "built without CUDA: host memory";
  return Pool::kHost;
}

void* Allocate(Pool pool, size_t bytes, std::string* err) {
  if (pool != Pool::kHost) {
    if (err) *err = std::string("pool '") + PoolName(pool) + "' needs a CUDA build and driver";
    return nullptr;
  }
  void* p = std::malloc(bytes ? bytes : 1);
  if (!p && err) *err = "out of host memory";
  return p;
}

void Free(Pool pool, void* p) {
  if (pool == Pool::kHost) std::free(p);
}

int Copy(void* dst, Pool dst_pool, const void* src, Pool src_pool, size_t bytes) {
  if (dst_pool != Pool::kHost || src_pool != Pool::kHost) return -1;
  std::memcpy(dst, src, bytes);
  return 0;
}

}  // namespace kvq::kernels
