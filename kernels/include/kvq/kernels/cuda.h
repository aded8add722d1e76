// CUDA launchers with the contracts of kernels.h, on device pointers and a stream. Each
// returns a cudaError_t value (0 on success). Declared only in CUDA builds (KVQ_HAVE_CUDA).
#pragma once

#include <cstdint>

namespace kvq::kernels::cuda {

// score_codes of kernels.h: out[i*os + t] = (accumulate ? out : 0)
//   + mult * sum_c q[i*qs + c] * (scale_c * code(c, t) + zero_c); scale/zero fp16 [n_ch].
int ScoreCodes(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
               const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
               bool accumulate, float* out, int64_t os, void* stream);

}  // namespace kvq::kernels::cuda
