// The block codec ops on the GPU: each of codec_math.h's launches becomes one grid-stride
// kernel over its (outer, inner) indices, the launches of an op queued in order on one
// stream. Built with -fmad=false (kernels/CMakeLists.txt) so that the arithmetic is the CPU
// reference's, operation for operation.
#include <cuda_runtime.h>

#include <algorithm>

#include "codec_math.h"
#include "kvq/kernels/cuda_codec.h"

namespace kvq::kernels::cuda {
namespace cm = codec_math;

namespace {

template <auto F, class P>
__global__ void GridKernel(P p, int outer, int inner) {
  const int64_t n = static_cast<int64_t>(outer) * inner;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < n;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x)
    F(p, static_cast<int>(w / inner), static_cast<int>(w % inner));
}

// Queues each step as a kernel; the first launch error stops the rest.
struct DeviceRun {
  cudaStream_t stream;
  int error = 0;
  template <auto F, class P>
  void Step(const P& p, int outer, int inner) {
    const int64_t n = static_cast<int64_t>(outer) * inner;
    if (error != 0 || n == 0) return;
    constexpr int kThreads = 128;
    const int grid = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
    GridKernel<F, P><<<grid, kThreads, 0, stream>>>(p, outer, inner);
    error = static_cast<int>(cudaGetLastError());
  }
};

template <class P, class Steps>
int Launch(const P& p, void* stream, Steps steps) {
  if (cm::Reason(p) != nullptr) return static_cast<int>(cudaErrorInvalidValue);
  DeviceRun run{static_cast<cudaStream_t>(stream)};
  steps(p, run);
  return run.error;
}

}  // namespace

int EncodeKeys(const EncodeKeyParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::EncodeKeySteps(q, r); });
}
int EncodeValues(const EncodeValueParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::EncodeValueSteps(q, r); });
}
int DecodeKeys(const DecodeKeyParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::DecodeKeySteps(q, r); });
}
int DecodeValues(const DecodeValueParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::DecodeValueSteps(q, r); });
}
int ScoreBlocks(const ScoreBlocksParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::ScoreSteps(q, r); });
}
int ReadoutBlocks(const ReadoutBlocksParams& p, void* stream) {
  return Launch(p, stream, [](const auto& q, DeviceRun& r) { cm::ReadoutSteps(q, r); });
}

}  // namespace kvq::kernels::cuda
