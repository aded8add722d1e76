// Where encoded blocks live. A BytePool hands out the memory behind every block vector of
// a LayerCache (and of its sealed blocks): plain host memory by default, or pinned host
// memory carved from large slabs (page-locking is a driver call costing far more than a
// malloc, so a pool of slabs pays it once per slab, not once per block vector).
//
// Pinned memory is ordinary host memory to the CPU: every kernel reads it as it reads any
// other, and a GPU can copy from it at full bus speed. When the driver refuses a new slab
// (page-locked memory exhausted), the pool falls back to host memory for that request
// rather than fail a write already admitted by the store's capacity check; the fallback
// bytes are reported (Usage::fallback_bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "kvq/core/mutex.h"
#include "kvq/kernels/device.h"

namespace kvq::core {

class BytePool {
 public:
  struct Usage {
    int64_t requested_bytes = 0;  // bytes of live allocations as asked for
    int64_t held_bytes = 0;       // of the pool's memory, bytes handed out (size classes)
    int64_t reserved_bytes = 0;   // slabs and dedicated allocations taken from the pool
    int64_t fallback_bytes = 0;   // live bytes in host memory because the pool refused
  };
  virtual ~BytePool() = default;
  virtual kernels::Pool pool() const = 0;
  // Never returns null: throws std::bad_alloc only when host memory itself is exhausted.
  // The memory is 16-byte aligned and readable up to the 16-byte boundary at or after its
  // end (ReadableBytes): the GPU attend reads blocks by aligned 16-byte words, so the last
  // word of a block may reach past its allocation's end (kernels/cuda.h, AttendParams).
  virtual void* Allocate(size_t n) = 0;
  // `n` must be the size given to Allocate.
  virtual void Free(void* p, size_t n) = 0;
  virtual Usage usage() const = 0;
};

// Bytes an allocation of n bytes may be read at: n rounded up to a multiple of 16.
constexpr size_t ReadableBytes(size_t n) { return (n + 15) & ~size_t{15}; }

// Host memory through operator new; the default of every cache. Process-wide.
BytePool* HostBytePool();

// Sub-allocates slabs of `slab_bytes` taken from `pool` with kernels::Allocate: requests up
// to slab_bytes / 8 are rounded up to a size class (multiples of 64 bytes, eight per power of
// two, so every chunk is 64-byte aligned and wastes under an eighth of its size) and served
// from per-class free lists; larger ones get a dedicated allocation. Freed chunks go back to
// their list and are never merged; when the current slab cannot serve a request, a free
// chunk of a larger class is split before a new slab is taken. Slabs go back to the pool only
// when the SlabBytePool is destroyed (after every allocation was freed). Thread-safe.
class SlabBytePool final : public BytePool {
 public:
  static constexpr size_t kMinChunk = 64;
  SlabBytePool(kernels::Pool pool, size_t slab_bytes = size_t{32} << 20);
  ~SlabBytePool() override;
  SlabBytePool(const SlabBytePool&) = delete;
  SlabBytePool& operator=(const SlabBytePool&) = delete;

  kernels::Pool pool() const override { return pool_; }
  void* Allocate(size_t n) override;
  void Free(void* p, size_t n) override;
  Usage usage() const override;
  // Takes one slab now, so that a pool which cannot work here fails at start-up with the
  // device API's reason rather than silently falling back on the first write.
  absl::Status Probe();

 private:
  int ClassOf(size_t n) const;  // -1: dedicated
  void* CarveLocked(int cls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SplitLocked(char* p, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AddSlabLocked(std::string* err) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void* FallbackLocked(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const kernels::Pool pool_;
  const size_t slab_bytes_;
  const std::vector<size_t> class_size_;  // ascending
  const int n_classes_;
  mutable Mutex mu_;
  std::vector<std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);  // per class
  std::vector<void*> slabs_ ABSL_GUARDED_BY(mu_);
  char* cur_ ABSL_GUARDED_BY(mu_) = nullptr;  // bump pointer in the newest slab
  size_t cur_left_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<void*> fallback_ ABSL_GUARDED_BY(mu_);
  Usage usage_ ABSL_GUARDED_BY(mu_);
};

// The process-wide pool for `pool`: HostBytePool() for host memory, one SlabBytePool per
// other pool, made (and probed) on first use. An error says why the pool cannot work here
// (no CUDA build, no driver, ...). The gpu pool is refused: codes must be readable by the
// CPU kernels, and this version has no CUDA readout / attend.
absl::StatusOr<BytePool*> SharedBytePool(kernels::Pool pool);

// A std::allocator stand-in drawing from a BytePool (host memory when default-made).
template <class T>
class PoolAllocator {
 public:
  using value_type = T;
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;

  PoolAllocator() noexcept : pool_(HostBytePool()) {}
  explicit PoolAllocator(BytePool* pool) noexcept : pool_(pool ? pool : HostBytePool()) {}
  template <class U>
  PoolAllocator(const PoolAllocator<U>& o) noexcept : pool_(o.pool()) {}  // NOLINT

  T* allocate(size_t n) { return static_cast<T*>(pool_->Allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { pool_->Free(p, n * sizeof(T)); }
  BytePool* pool() const noexcept { return pool_; }

  template <class U>
  bool operator==(const PoolAllocator<U>& o) const noexcept {
    return pool_ == o.pool();
  }

 private:
  BytePool* pool_;
};

// Encoded block bytes in a BytePool.
using Bytes = std::vector<uint8_t, PoolAllocator<uint8_t>>;

}  // namespace kvq::core
