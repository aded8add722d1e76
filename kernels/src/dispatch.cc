// Run-time choice of the kernel table.
#include <cstdlib>
#include <cstring>

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

}  // namespace kvq::kernels
