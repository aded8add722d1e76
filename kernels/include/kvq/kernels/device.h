// The thin device-memory API: core/ never calls the CUDA runtime itself.
#pragma once

#include <cstddef>
#include <string>

namespace kvq::kernels {

enum class Pool { kHost = 0, kPinned = 1, kGpu = 2 };

const char* PoolName(Pool p);
// True when the build has CUDA and a driver with at least one device answers.
bool CudaAvailable();
// The best pool that works here: gpu, then pinned, then host. `why` says what was found.
Pool BestPool(std::string* why);
// Allocates `bytes` in `pool`; null on failure (and `err` says why).
void* Allocate(Pool pool, size_t bytes, std::string* err);
void Free(Pool pool, void* p);
// Copies between any two pools (host <-> device handled by the runtime). 0 on success.
int Copy(void* dst, Pool dst_pool, const void* src, Pool src_pool, size_t bytes);

}  // namespace kvq::kernels
