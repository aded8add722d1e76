// Picks OpenBLAS's vector kernels for this CPU when its own detection falls back to SSE3.
#ifndef KVQ_FRONTEND_BLAS_KERNELS_H_
#define KVQ_FRONTEND_BLAS_KERNELS_H_

namespace kvq::frontend {

// Debian 12's OpenBLAS (0.3.21, DYNAMIC_ARCH) does not know some newer Xeon models and then
// runs its Prescott (SSE3) sgemm kernel, 3x slower than the AVX-512 one on this project's
// machine. OpenBLAS chooses its kernel when the library loads, from OPENBLAS_CORETYPE, so
// the only fix from inside the process is to set that variable and exec the program again.
// Call first thing in main(). Does nothing when OPENBLAS_CORETYPE is already set (the
// user's choice, and the guard against a second exec), when OpenBLAS found a vector kernel,
// or when the CPU has neither AVX-512 nor AVX2+FMA. Returns only when it did not exec.
// The kernel changes float rounding in the last bits (a perplexity's 4th or 5th digit), not
// results: OPENBLAS_CORETYPE=Prescott reproduces figures measured with the fallback.
void PreferNativeBlasKernels(char** argv);

// The OpenBLAS kernel in use ("SkylakeX", "Haswell", "Prescott", ...), for logs and JSON.
const char* BlasKernelName();

}  // namespace kvq::frontend

#endif  // KVQ_FRONTEND_BLAS_KERNELS_H_
