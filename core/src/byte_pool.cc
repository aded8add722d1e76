#include "kvq/core/byte_pool.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"

// Under AddressSanitizer, chunks on the free lists and the unused rest of a slab are
// poisoned, so a read of a freed block (or past a block into its neighbour's chunk) is
// reported as it would be for operator new memory. No-ops otherwise.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KVQ_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define KVQ_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define KVQ_POISON(p, n) ((void)(p), (void)(n))
#define KVQ_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace kvq::core {
namespace {

class HostPool final : public BytePool {
 public:
  kernels::Pool pool() const override { return kernels::Pool::kHost; }
  void* Allocate(size_t n) override {
    void* p = ::operator new(ReadableBytes(n));
    requested_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    return p;
  }
  void Free(void* p, size_t n) override {
    if (!p) return;
    ::operator delete(p);
    requested_.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  }
  Usage usage() const override {
    Usage u;
    u.requested_bytes = u.held_bytes = u.reserved_bytes =
        requested_.load(std::memory_order_relaxed);
    return u;
  }

 private:
  std::atomic<int64_t> requested_{0};
};

}  // namespace

BytePool* HostBytePool() {
  static HostPool* const pool = new HostPool;  // never destroyed: blocks may outlive main
  return pool;
}

namespace {

// Size classes: multiples of kMinChunk, eight per power of two from 512 bytes on (64, 128,
// ..., 512, 576, 640, ..., 1024, 1152, ...), so a request wastes under an eighth of its size
// (about 6% on average) instead of up to half with powers of two.
std::vector<size_t> SizeClasses(size_t largest) {
  std::vector<size_t> c;
  for (size_t s = SlabBytePool::kMinChunk; s <= largest;
       s += std::max(SlabBytePool::kMinChunk, std::bit_floor(s) / 8)) {
    c.push_back(s);
  }
  return c;
}

}  // namespace

SlabBytePool::SlabBytePool(kernels::Pool pool, size_t slab_bytes)
    : pool_(pool),
      slab_bytes_(std::bit_ceil(std::max(slab_bytes, kMinChunk * 8))),
      class_size_(SizeClasses(slab_bytes_ / 8)),
      n_classes_(static_cast<int>(class_size_.size())),
      free_(n_classes_) {}

SlabBytePool::~SlabBytePool() {
  MutexLock l(&mu_);
  for (void* s : slabs_) {
    KVQ_UNPOISON(s, slab_bytes_);
    kernels::Free(pool_, s);
  }
}

int SlabBytePool::ClassOf(size_t n) const {
  auto it = std::lower_bound(class_size_.begin(), class_size_.end(), n);
  return it == class_size_.end() ? -1 : static_cast<int>(it - class_size_.begin());
}

bool SlabBytePool::AddSlabLocked(std::string* err) {
  void* slab = kernels::Allocate(pool_, slab_bytes_, err);
  if (!slab) return false;
  slabs_.push_back(slab);
  usage_.reserved_bytes += static_cast<int64_t>(slab_bytes_);
  // Chunks are kMinChunk-aligned (pinned and device memory come page-aligned; host slabs
  // from malloc may not).
  const uintptr_t a = reinterpret_cast<uintptr_t>(slab);
  const size_t skip = (kMinChunk - a % kMinChunk) % kMinChunk;
  cur_ = static_cast<char*>(slab) + skip;
  cur_left_ = slab_bytes_ - skip;
  KVQ_POISON(slab, slab_bytes_);
  return true;
}

void SlabBytePool::SplitLocked(char* p, size_t bytes) {
  // Largest pieces first; every offset stays a multiple of kMinChunk, so every piece is
  // 64-byte aligned, and any multiple of kMinChunk splits without a remainder.
  for (int c = n_classes_ - 1; c >= 0 && bytes >= kMinChunk; --c) {
    while (bytes >= class_size_[c]) {
      free_[c].push_back(p);
      p += class_size_[c];
      bytes -= class_size_[c];
    }
  }
}

void* SlabBytePool::CarveLocked(int cls) {
  const size_t size = class_size_[cls];
  if (cur_left_ < size) {
    // The rest of the current slab goes to the free lists. Before taking a new slab, a free
    // chunk of a larger class is split (chunks are never merged again, but memory already
    // reserved serves before more is asked of the driver).
    SplitLocked(cur_, cur_left_);
    cur_ = nullptr;
    cur_left_ = 0;
    for (int c = cls + 1; c < n_classes_; ++c) {
      if (free_[c].empty()) continue;
      char* p = static_cast<char*>(free_[c].back());
      free_[c].pop_back();
      SplitLocked(p + size, class_size_[c] - size);
      return p;
    }
    if (!AddSlabLocked(nullptr)) return nullptr;
  }
  void* p = cur_;
  cur_ += size;
  cur_left_ -= size;
  return p;
}

void* SlabBytePool::FallbackLocked(size_t n) {
  void* p = ::operator new(ReadableBytes(n));
  fallback_.insert(p);
  usage_.fallback_bytes += static_cast<int64_t>(n);
  return p;
}

void* SlabBytePool::Allocate(size_t n) {
  MutexLock l(&mu_);
  usage_.requested_bytes += static_cast<int64_t>(n);
  const int cls = ClassOf(n);
  void* p = nullptr;
  if (cls < 0) {
    p = kernels::Allocate(pool_, ReadableBytes(n), nullptr);
    if (p) {
      usage_.reserved_bytes += static_cast<int64_t>(n);
      usage_.held_bytes += static_cast<int64_t>(n);
    }
  } else if (!free_[cls].empty()) {
    p = free_[cls].back();
    free_[cls].pop_back();
    usage_.held_bytes += static_cast<int64_t>(class_size_[cls]);
  } else if ((p = CarveLocked(cls)) != nullptr) {
    usage_.held_bytes += static_cast<int64_t>(class_size_[cls]);
  }
  if (p && cls >= 0) KVQ_UNPOISON(p, ReadableBytes(n));  // classes are multiples of 64
  return p ? p : FallbackLocked(n);
}

void SlabBytePool::Free(void* p, size_t n) {
  if (!p) return;
  MutexLock l(&mu_);
  usage_.requested_bytes -= static_cast<int64_t>(n);
  if (auto it = fallback_.find(p); it != fallback_.end()) {
    fallback_.erase(it);
    usage_.fallback_bytes -= static_cast<int64_t>(n);
    ::operator delete(p);
    return;
  }
  const int cls = ClassOf(n);
  if (cls < 0) {
    kernels::Free(pool_, p);
    usage_.reserved_bytes -= static_cast<int64_t>(n);
    usage_.held_bytes -= static_cast<int64_t>(n);
    return;
  }
  KVQ_POISON(p, class_size_[cls]);
  free_[cls].push_back(p);
  usage_.held_bytes -= static_cast<int64_t>(class_size_[cls]);
}

BytePool::Usage SlabBytePool::usage() const {
  MutexLock l(&mu_);
  return usage_;
}

absl::Status SlabBytePool::Probe() {
  MutexLock l(&mu_);
  if (!slabs_.empty()) return absl::OkStatus();
  std::string err;
  if (!AddSlabLocked(&err))
    return absl::FailedPreconditionError(
        absl::StrCat("memory pool '", kernels::PoolName(pool_), "': ", err));
  return absl::OkStatus();
}

absl::StatusOr<BytePool*> SharedBytePool(kernels::Pool pool) {
  if (pool == kernels::Pool::kHost) return HostBytePool();
  if (pool == kernels::Pool::kGpu)
    return absl::FailedPreconditionError(
        "memory pool 'gpu': codes in device memory need CUDA readout and attend kernels, which "
        "this version does not have; use 'pinned' (host memory a GPU copies at bus speed)");
  static Mutex mu;
  static SlabBytePool* pinned ABSL_GUARDED_BY(mu) = nullptr;
  MutexLock l(&mu);
  if (pinned == nullptr) {
    auto* p = new SlabBytePool(pool);
    if (absl::Status st = p->Probe(); !st.ok()) {
      delete p;
      return st;
    }
    pinned = p;  // process-wide, never destroyed (blocks may outlive main)
  }
  return static_cast<BytePool*>(pinned);
}

}  // namespace kvq::core
