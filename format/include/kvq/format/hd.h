// Qualifiers for code that both the CUDA kernels and their CPU stand-ins compile.
#pragma once

#ifdef __CUDACC__
#define KVQ_HD __host__ __device__ inline
#else
#define KVQ_HD inline
#endif
#ifdef __CUDA_ARCH__
#define KVQ_UNROLL _Pragma("unroll")
#else
#define KVQ_UNROLL
#endif
