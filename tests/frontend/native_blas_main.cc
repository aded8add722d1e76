// GoogleTest main for the frontend tests: OpenBLAS's vector kernel first (see blas_kernels.h),
// so the real-model tests run at the speed the tools do.
#include "gtest/gtest.h"
#include "kvq/frontend/blas_kernels.h"

int main(int argc, char** argv) {
  kvq::frontend::PreferNativeBlasKernels(argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
