// Where encoded blocks live. A BytePool hands out the memory behind every block vector of
// a LayerCache (and of its sealed blocks): plain host memory by default, or pinned host or
// device memory carved from large slabs (page-locking and cudaMalloc are driver calls costing
// far more than a malloc, so a pool of slabs pays once per slab, not once per block vector).
//
// Pinned memory is ordinary host memory to the CPU: every kernel reads it as it reads any
// other, and a GPU can copy from it at full bus speed. Device memory the CPU reaches only by
// copies (BytePool::cpu_readable, Bytes, CpuView). When the driver refuses a new slab
// (page-locked memory exhausted), the pool falls back to host memory for that request
// rather than fail a write already admitted by the store's capacity check; the fallback
// bytes are reported (Usage::fallback_bytes). A gpu pool has no such fallback (its blocks
// must be where the GPU reads them): a refused slab is std::bad_alloc, which fails the
// append with RESOURCE_EXHAUSTED.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
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
  // Never returns null: throws std::bad_alloc when host memory itself is exhausted, or when
  // the device refuses a pool that has no host fallback (gpu). The memory is 16-byte aligned and
  // readable up to the 16-byte boundary at or after its end (ReadableBytes): the GPU attend reads
  // blocks by aligned 16-byte words, so the last word of a block may reach past its allocation's
  // end (kernels/cuda.h, AttendParams).
  virtual void* Allocate(size_t n) = 0;
  // `n` must be the size given to Allocate.
  virtual void Free(void* p, size_t n) = 0;
  virtual Usage usage() const = 0;
  // Whether the CPU reads and writes the memory in place; false for device memory (and its
  // stand-in), which the CPU reaches only by copies (Bytes, CpuView).
  virtual bool cpu_readable() const { return pool() != kernels::Pool::kGpu; }
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
  // kByCopy: the CPU reaches the memory only by copies, as it must device memory; host slabs
  // so made stand in for the gpu pool where there is no GPU (every copy then a memcpy), so
  // that tests take the gpu store's every path. Device memory is always kByCopy.
  enum class CpuAccess { kDirect, kByCopy };
  SlabBytePool(kernels::Pool pool, size_t slab_bytes = size_t{32} << 20,
               CpuAccess access = CpuAccess::kDirect);
  ~SlabBytePool() override;
  SlabBytePool(const SlabBytePool&) = delete;
  SlabBytePool& operator=(const SlabBytePool&) = delete;

  kernels::Pool pool() const override { return pool_; }
  bool cpu_readable() const override { return cpu_readable_; }
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
  const bool cpu_readable_;
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
// (no CUDA build, no driver, no device, ...). The gpu pool's memory is device memory
// (cudaMalloc slabs): a store keeping blocks there attends on the CUDA backend
// (attend_backend.h) and copies blocks back for its CPU paths (CpuView).
absl::StatusOr<BytePool*> SharedBytePool(kernels::Pool pool);

// Encoded block bytes in a BytePool: a growable byte array (what the caches use of
// std::vector<uint8_t>). Its memory may be memory the CPU does not read (device memory, or
// its stand-in: BytePool::cpu_readable() false): bytes then come in only by Append (one copy
// from host memory) and go out only through CpuView; data() is an address for the GPU, and
// growth copies within the pool. Element access, iteration and == are for CPU-readable pools
// only (tests, fault injection). Allocation failures throw std::bad_alloc, as
// BytePool::Allocate does (a copy the device refuses while growing, too).
class Bytes {
 public:
  using value_type = uint8_t;
  using iterator = uint8_t*;
  using const_iterator = const uint8_t*;

  explicit Bytes(BytePool* pool = nullptr) : pool_(pool ? pool : HostBytePool()) {}
  Bytes(const Bytes& o);
  Bytes(Bytes&& o) noexcept;
  Bytes& operator=(const Bytes& o);
  Bytes& operator=(Bytes&& o) noexcept;
  ~Bytes();

  BytePool* pool() const { return pool_; }
  size_t size() const { return size_; }
  size_t capacity() const { return cap_; }
  bool empty() const { return size_ == 0; }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  // Room for n bytes in all (exactly n when it grows).
  void reserve(size_t n);
  // Shrinks, or grows by zero bytes.
  void resize(size_t n);
  // n bytes of `value`.
  void assign(size_t n, uint8_t value);
  // Appends n bytes from host memory (growing by at least half the capacity when it must).
  // An error when the device refuses the copy.
  absl::Status Append(const uint8_t* p, size_t n);
  // Grows by n bytes left unwritten, as Append grows, and returns where they start: for a
  // writer in the pool's own memory (the device's encoder), with nothing copied in.
  uint8_t* Extend(size_t n);

  uint8_t& operator[](size_t i) { return data_[i]; }
  const uint8_t& operator[](size_t i) const { return data_[i]; }
  uint8_t* begin() { return data_; }
  uint8_t* end() { return data_ + size_; }
  const uint8_t* begin() const { return data_; }
  const uint8_t* end() const { return data_ + size_; }
  bool operator==(const Bytes& o) const;

 private:
  void Grow(size_t n);  // capacity to exactly n (> cap_)
  void Fill(size_t at, size_t n, uint8_t value);
  void Release();

  BytePool* pool_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0, cap_ = 0;
};

// Bytes of `block` (in `pool`'s memory) that the CPU may read: the block itself where the CPU
// reads the pool's memory, else a copy in *scratch. The one place the CPU paths of a store
// whose blocks are in device memory copy them back, for what the device's ops do not take
// (LayerCache::set_block_ops: a codec with dense-and-sparse lists, GetBlocks in codes, an
// attend the backend cannot take, the header checks of attached prefix blocks; docs/CODEC.md,
// "Attend backends"). INTERNAL when the device refuses the copy.
absl::StatusOr<std::span<const uint8_t>> CpuView(const BytePool& pool,
                                                 std::span<const uint8_t> block,
                                                 std::vector<uint8_t>* scratch);
// Bytes CpuView has copied so far, process-wide (for metrics).
int64_t CopiedBackBytes();

}  // namespace kvq::core
