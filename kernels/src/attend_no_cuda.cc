// The GPU attend's entry points in builds without CUDA: there is no device to run them on.
#include "kvq/kernels/cuda.h"

namespace kvq::kernels::cuda {

int AttendFromHost(const AttendParams&) { return kErrorNoDevice; }

}  // namespace kvq::kernels::cuda
