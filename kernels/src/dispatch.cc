// Run-time choice of the kernel table.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "kvq/kernels/kernels.h"

namespace kvq::kernels {

const KernelTable& Best() {
  static const KernelTable* best = [] {
    const char* force = std::getenv("KVQ_KERNELS");
    if (force && std::strcmp(force, "ref") == 0) return &Ref();
    if (force && std::strcmp(force, "avx2") == 0 && Avx2()) return Avx2();
    if (Avx512()) return Avx512();
    if (Avx2()) return Avx2();
    return &Ref();
  }();
  return *best;
}

namespace {
std::atomic<const KernelTable*> g_active{nullptr};
}  // namespace

const KernelTable& Active() {
  const KernelTable* t = g_active.load(std::memory_order_relaxed);
  return t ? *t : Best();
}

void SetActive(const KernelTable* table) { g_active.store(table, std::memory_order_relaxed); }

// Here, compiled for every CPU: the AVX2 and AVX-512 tables' checksums both use it.
internal::PrefetchAhead& internal::Ahead() {
  thread_local PrefetchAhead ahead;
  return ahead;
}

void PrefetchWhileEncoding(const void* begin, size_t bytes) {
  internal::PrefetchAhead& ahead = internal::Ahead();
  ahead.next = static_cast<const char*>(begin);
  ahead.end = ahead.next + bytes;
}

}  // namespace kvq::kernels
