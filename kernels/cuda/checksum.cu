// The batched block verification on the GPU: a launch of xxh3_math's per-thread program, one
// thread per block.
#include <cuda_runtime.h>

#include "host_call_scratch.h"
#include "kvq/kernels/cuda.h"
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

int VerifyBlocksFromHost(const VerifyParams& hp) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return kErrorNoDevice;
  if (!VerifyParamsValid(hp)) return cudaErrorInvalidValue;
  if (hp.blocks == 0) return cudaSuccess;
  const size_t n = static_cast<size_t>(hp.blocks);
  ScratchLayout at;
  const size_t ptr_at = at.Take(n * sizeof(void*)), size_at = at.Take(n * 8),
               verdict_at = at.Take(n);
  thread_local HostCallScratch scratch;
  if (cudaError_t e = scratch.Reserve(at.total); e != cudaSuccess) return e;
  uint8_t* base = static_cast<uint8_t*>(scratch.p);
  cudaStream_t s = cudaStreamPerThread;
  cudaError_t e =
      cudaMemcpyAsync(base + ptr_at, hp.block_ptrs, n * sizeof(void*), cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(base + size_at, hp.sizes, n * 8, cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) return e;
  VerifyParams dp;
  dp.blocks = hp.blocks;
  dp.block_ptrs = reinterpret_cast<const uint8_t* const*>(base + ptr_at);
  dp.sizes = reinterpret_cast<const uint64_t*>(base + size_at);
  dp.verdicts = base + verdict_at;
  if (int r = VerifyBlocks(dp, s); r != 0) return r;
  if ((e = cudaMemcpyAsync(hp.verdicts, dp.verdicts, n, cudaMemcpyDeviceToHost, s)) != cudaSuccess)
    return e;
  return cudaStreamSynchronize(s);
}

}  // namespace kvq::kernels::cuda
