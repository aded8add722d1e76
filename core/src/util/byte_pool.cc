#include "kvq/core/byte_pool.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

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

SlabBytePool::SlabBytePool(kernels::Pool pool, size_t slab_bytes, CpuAccess access)
    : pool_(pool),
      cpu_readable_(pool != kernels::Pool::kGpu && access == CpuAccess::kDirect),
      slab_bytes_(std::bit_ceil(std::max(slab_bytes, kMinChunk * 8))),
      class_size_(SizeClasses(slab_bytes_ / 8)),
      n_classes_(static_cast<int>(class_size_.size())),
      free_(n_classes_) {}

SlabBytePool::~SlabBytePool() {
  MutexLock l(&mu_);
  for (void* s : slabs_) {
    if (pool_ != kernels::Pool::kGpu) KVQ_UNPOISON(s, slab_bytes_);
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
  if (pool_ != kernels::Pool::kGpu) KVQ_POISON(slab, slab_bytes_);
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
  // Classes are multiples of 64; device memory has no shadow to poison.
  if (p && cls >= 0 && pool_ != kernels::Pool::kGpu) KVQ_UNPOISON(p, ReadableBytes(n));
  if (p) return p;
  if (pool_ == kernels::Pool::kGpu) {  // no fallback: the GPU cannot read host memory
    usage_.requested_bytes -= static_cast<int64_t>(n);
    throw std::bad_alloc();
  }
  return FallbackLocked(n);
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
  if (pool_ != kernels::Pool::kGpu) KVQ_POISON(p, class_size_[cls]);
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
  static Mutex mu;
  static SlabBytePool* shared[3] ABSL_GUARDED_BY(mu) = {};
  MutexLock l(&mu);
  SlabBytePool*& slot = shared[static_cast<int>(pool)];
  if (slot == nullptr) {
    auto* p = new SlabBytePool(pool);
    if (absl::Status st = p->Probe(); !st.ok()) {
      delete p;
      return st;
    }
    slot = p;  // process-wide, never destroyed (blocks may outlive main)
  }
  return static_cast<BytePool*>(slot);
}

Bytes::Bytes(const Bytes& o) : pool_(o.pool_) {
  if (o.size_ == 0) return;
  Grow(o.size_);
  if (kernels::Copy(data_, pool_->pool(), o.data_, o.pool_->pool(), o.size_) != 0)
    throw std::bad_alloc();
  size_ = o.size_;
}

Bytes::Bytes(Bytes&& o) noexcept
    : pool_(o.pool_),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      cap_(std::exchange(o.cap_, 0)) {}

Bytes& Bytes::operator=(const Bytes& o) {
  if (this != &o) *this = Bytes(o);
  return *this;
}

Bytes& Bytes::operator=(Bytes&& o) noexcept {
  if (this == &o) return *this;
  Release();
  pool_ = o.pool_;
  data_ = std::exchange(o.data_, nullptr);
  size_ = std::exchange(o.size_, 0);
  cap_ = std::exchange(o.cap_, 0);
  return *this;
}

Bytes::~Bytes() { Release(); }

void Bytes::Release() {
  if (data_) pool_->Free(data_, cap_);
  data_ = nullptr;
  size_ = cap_ = 0;
}

void Bytes::Grow(size_t n) {
  auto* p = static_cast<uint8_t*>(pool_->Allocate(n));
  if (size_ > 0 && kernels::Copy(p, pool_->pool(), data_, pool_->pool(), size_) != 0) {
    pool_->Free(p, n);
    throw std::bad_alloc();
  }
  if (data_) pool_->Free(data_, cap_);
  data_ = p;
  cap_ = n;
}

void Bytes::reserve(size_t n) {
  if (n > cap_) Grow(n);
}

void Bytes::Fill(size_t at, size_t n, uint8_t value) {
  if (pool_->cpu_readable()) {
    std::memset(data_ + at, value, n);
    return;
  }
  const std::vector<uint8_t> chunk(std::min<size_t>(n, size_t{1} << 16), value);
  for (size_t done = 0; done < n; done += chunk.size()) {
    const size_t m = std::min(chunk.size(), n - done);
    if (kernels::Copy(data_ + at + done, pool_->pool(), chunk.data(), kernels::Pool::kHost, m) != 0)
      throw std::bad_alloc();
  }
}

void Bytes::resize(size_t n) {
  if (n > size_) {
    reserve(n);
    Fill(size_, n - size_, 0);
  }
  size_ = n;
}

void Bytes::assign(size_t n, uint8_t value) {
  size_ = 0;
  reserve(n);
  Fill(0, n, value);
  size_ = n;
}

uint8_t* Bytes::Extend(size_t n) {
  if (size_ + n > cap_) Grow(std::max(size_ + n, cap_ + cap_ / 2));
  uint8_t* at = data_ + size_;
  size_ += n;
  return at;
}

absl::Status Bytes::Append(const uint8_t* p, size_t n) {
  if (n == 0) return absl::OkStatus();
  uint8_t* at = Extend(n);
  if (kernels::Copy(at, pool_->pool(), p, kernels::Pool::kHost, n) != 0) {
    size_ -= n;
    return absl::InternalError(absl::StrCat("copy of ", n, " block bytes into memory pool '",
                                            kernels::PoolName(pool_->pool()), "' failed"));
  }
  return absl::OkStatus();
}

bool Bytes::operator==(const Bytes& o) const {
  return size_ == o.size_ && (size_ == 0 || std::memcmp(data_, o.data_, size_) == 0);
}

namespace {
std::atomic<int64_t> copied_back{0};
}  // namespace

absl::StatusOr<std::span<const uint8_t>> CpuView(const BytePool& pool,
                                                 std::span<const uint8_t> block,
                                                 std::vector<uint8_t>* scratch) {
  if (pool.cpu_readable()) return block;
  scratch->resize(block.size());
  if (kernels::Copy(scratch->data(), kernels::Pool::kHost, block.data(), pool.pool(),
                    block.size()) != 0)
    return absl::InternalError(absl::StrCat("copy of a ", block.size(),
                                            "-byte block out of memory pool '",
                                            kernels::PoolName(pool.pool()), "' failed"));
  copied_back.fetch_add(static_cast<int64_t>(block.size()), std::memory_order_relaxed);
  return std::span<const uint8_t>(scratch->data(), scratch->size());
}

int64_t CopiedBackBytes() { return copied_back.load(std::memory_order_relaxed); }

}  // namespace kvq::core
