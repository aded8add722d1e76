// The GPU entry points that take host arrays, in builds without CUDA: there is no device to run
// them on.
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/cuda_checksum.h"
#include "kvq/kernels/cuda_codec.h"

namespace kvq::kernels::cuda {

int AttendFromHost(const AttendParams&) { return kErrorNoDevice; }
int VerifyBlocksFromHost(const VerifyParams&) { return kErrorNoDevice; }
int EncodeKeysFromHost(const EncodeKeyParams&) { return kErrorNoDevice; }
int EncodeValuesFromHost(const EncodeValueParams&) { return kErrorNoDevice; }
int DecodeKeysFromHost(const DecodeKeyParams&) { return kErrorNoDevice; }
int DecodeValuesFromHost(const DecodeValueParams&) { return kErrorNoDevice; }
int ScoreBlocksFromHost(const ScoreBlocksParams&) { return kErrorNoDevice; }
int ReadoutBlocksFromHost(const ReadoutBlocksParams&) { return kErrorNoDevice; }

}  // namespace kvq::kernels::cuda
