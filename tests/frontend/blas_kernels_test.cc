// The OpenBLAS kernel choice: a CPU with AVX2 or AVX-512 never runs the SSE3 fallback.
#include "kvq/frontend/blas_kernels.h"

#include <strings.h>

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvq::frontend {
namespace {

// ctest unsets OPENBLAS_CORETYPE for this test (CMakeLists.txt), so the kernel in use is what
// OpenBLAS detected or what PreferNativeBlasKernels (in this binary's main) exec'd with.
TEST(BlasKernels, VectorCpuGetsAVectorKernel) {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    GTEST_SKIP() << "CPU without AVX2+FMA: the SSE3 kernel is the right one";
  }
  const char* name = BlasKernelName();
  EXPECT_NE(strcasecmp(name, "prescott"), 0) << name;
  EXPECT_NE(strcasecmp(name, "core2"), 0) << name;
  EXPECT_NE(strcasecmp(name, "nehalem"), 0) << name;
}

TEST(BlasKernels, ReexecLeavesTheChoiceVisible) {
  // When main exec'd, the variable it set is what the kernel came from; a second call is a
  // no-op (the loop guard), so this returns.
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  char* argv[] = {const_cast<char*>("/nonexistent"), nullptr};
  if (set != nullptr) {
    PreferNativeBlasKernels(argv);  // would exec /proc/self/exe if the guard were broken
    EXPECT_EQ(strcasecmp(BlasKernelName(), set), 0) << BlasKernelName() << " vs " << set;
  }
}

}  // namespace
}  // namespace kvq::frontend
