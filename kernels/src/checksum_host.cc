// The batched block verification on the CPU: xxh3_math's per-thread program for every thread
// of every thread block of the grid VerifyBlocks launches, the GPU's stand-in in every build.
#include "../cuda/xxh3_math.h"
#include "kvq/kernels/cuda_checksum.h"

namespace kvq::kernels::cuda {

int VerifyBlocksOnHost(const VerifyParams& p) {
  if (!VerifyParamsValid(p)) return 1;
  for (int b = 0; b < xxh3_math::VerifyGrid(p.blocks); ++b)
    for (int t = 0; t < xxh3_math::kVerifyThreads; ++t) xxh3_math::VerifyThread(p, b, t);
  return 0;
}

}  // namespace kvq::kernels::cuda
