// OpenBLAS kernel choice: re-exec with OPENBLAS_CORETYPE when OpenBLAS fell back to SSE3.
#include "kvq/frontend/blas_kernels.h"

#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvq::frontend {
namespace {

// The kernel OpenBLAS would have chosen had it known the CPU model, or nullptr to keep its own.
const char* BetterKernel() {
  const char* name = openblas_get_corename();
  // Only the generic fallbacks are replaced; a named modern kernel is OpenBLAS's own choice.
  if (name == nullptr || (strcasecmp(name, "prescott") != 0 && strcasecmp(name, "core2") != 0 &&
                          strcasecmp(name, "nehalem") != 0)) {
    return nullptr;
  }
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

}  // namespace

void PreferNativeBlasKernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const char* kernel = BetterKernel();
  if (kernel == nullptr) return;
  if (setenv("OPENBLAS_CORETYPE", kernel, 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: exec failed (no /proc?); run on with the slow kernel rather than not at all.
  std::fprintf(stderr, "note: could not re-exec with OPENBLAS_CORETYPE=%s (%s); slow BLAS kernel\n",
               kernel, std::strerror(errno));
}

const char* BlasKernelName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

}  // namespace kvq::frontend
