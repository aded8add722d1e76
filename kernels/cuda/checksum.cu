// The batched block verification on the GPU: a launch of xxh3_math's per-thread program, one
// thread per block.
#include <cuda_runtime.h>

#include "kvq/kernels/cuda_checksum.h"
#include "xxh3_math.h"

namespace kvq::kernels::cuda {
namespace {

__global__ void VerifyKernel(VerifyParams p) {
  xxh3_math::VerifyThread(p, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x));
}

}  // namespace

int VerifyBlocks(const VerifyParams& p, void* stream) {
  if (!VerifyParamsValid(p)) return cudaErrorInvalidValue;
  if (p.blocks == 0) return cudaSuccess;
  VerifyKernel<<<xxh3_math::VerifyGrid(p.blocks), xxh3_math::kVerifyThreads, 0,
                 static_cast<cudaStream_t>(stream)>>>(p);
  return cudaGetLastError();
}

}  // namespace kvq::kernels::cuda
