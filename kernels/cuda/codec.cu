// The block codec ops on the GPU: each of codec_math.h's launches becomes one grid-stride
// kernel over its (outer, inner) indices, the launches of an op queued in order on one
// stream. Built with -fmad=false (kernels/CMakeLists.txt) so that the arithmetic is the CPU
// reference's, operation for operation.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "codec_math.h"
#include "host_call_scratch.h"
#include "kvq/kernels/cuda.h"
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

namespace {

// One FromHost call: its device arrays laid out in the calling thread's scratch (Take, then
// Reserve), copies queued on cudaStreamPerThread, the first error kept and every later step
// skipped.
class HostCall {
 public:
  size_t Take(size_t n) { return at_.Take(n); }
  bool Reserve() {
    thread_local HostCallScratch scratch;
    error_ = scratch.Reserve(at_.total);
    base_ = static_cast<uint8_t*>(scratch.p);
    return error_ == cudaSuccess;
  }
  template <class T>
  T* At(size_t off) const {
    return reinterpret_cast<T*>(base_ + off);
  }
  // rows rows of `width` bytes, host pitch hp, device pitch dp (bytes).
  void Up(size_t off, const void* src, size_t width, size_t rows = 1, size_t hp = 0,
          size_t dp = 0) {
    if (error_ == cudaSuccess && width * rows > 0)
      error_ = cudaMemcpy2DAsync(base_ + off, dp ? dp : width, src, hp ? hp : width, width, rows,
                                 cudaMemcpyHostToDevice, stream_);
  }
  void Down(void* dst, size_t off, size_t width, size_t rows = 1, size_t hp = 0, size_t dp = 0) {
    if (error_ == cudaSuccess && width * rows > 0)
      error_ = cudaMemcpy2DAsync(dst, hp ? hp : width, base_ + off, dp ? dp : width, width, rows,
                                 cudaMemcpyDeviceToHost, stream_);
  }
  void Launched(int e) {
    if (error_ == cudaSuccess) error_ = static_cast<cudaError_t>(e);
  }
  cudaStream_t stream() const { return stream_; }
  int Finish() {
    if (error_ == cudaSuccess) error_ = cudaStreamSynchronize(stream_);
    return static_cast<int>(error_);
  }

 private:
  ScratchLayout at_;
  uint8_t* base_ = nullptr;
  cudaStream_t stream_ = cudaStreamPerThread;
  cudaError_t error_ = cudaSuccess;
};

bool HasDevice() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

// Copies each distinct host array of `bytes` bytes that ptrs[0..n) point at into the scratch
// at `at` (laid out by the caller: distinct.size() * bytes), giving each entry its device
// address in dev[0..n). Null entries stay null.
template <class T>
void UpDistinct(HostCall& c, const T* const* ptrs, size_t n, size_t bytes, size_t at,
                const std::vector<const T*>& distinct, std::vector<const T*>* dev) {
  dev->assign(n, nullptr);
  for (size_t i = 0; i < distinct.size(); ++i) c.Up(at + i * bytes, distinct[i], bytes);
  for (size_t b = 0; b < n; ++b) {
    if (ptrs[b] == nullptr) continue;
    const size_t i = std::find(distinct.begin(), distinct.end(), ptrs[b]) - distinct.begin();
    (*dev)[b] = c.At<const T>(at + i * bytes);
  }
}
template <class T>
std::vector<const T*> Distinct(const T* const* ptrs, size_t n) {
  std::vector<const T*> out;
  for (size_t b = 0; b < n; ++b)
    if (ptrs[b] != nullptr && std::find(out.begin(), out.end(), ptrs[b]) == out.end())
      out.push_back(ptrs[b]);
  return out;
}

// DecodeKeysFromHost and DecodeValuesFromHost: the blocks' rows decoded into device scratch,
// then copied into each out[b] (d columns of its G rows of stride ld). Key bases: each distinct
// host pointer copied once.
template <class P, class Launcher>
int DecodeFromHost(const P& hp, Launcher launch) {
  if (!HasDevice()) return kErrorNoDevice;
  if (cm::Reason(hp) != nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (hp.blocks == 0) return 0;
  const size_t n = static_cast<size_t>(hp.blocks), G = hp.codec.key_group, d = hp.codec.head_dim;
  const size_t rows_bytes = 4 * G * d;
  HostCall c;
  const size_t in_at = c.Take(n * sizeof(void*)), out_ptr_at = c.Take(n * sizeof(void*));
  const size_t rows_at = c.Take(n * rows_bytes), flags_at = c.Take(4);
  constexpr bool kKeys = std::is_same_v<P, DecodeKeyParams>;
  std::vector<const float*> bases, basis_ptrs;  // key bases: distinct host arrays
  size_t basis_ptr_at = 0, basis_at = 0, basis_bytes = 0;
  if constexpr (kKeys) {
    if (hp.codec.rank > 0 && hp.basis != nullptr) {
      bases = Distinct(hp.basis, n);
      basis_bytes = 4 * d * static_cast<size_t>(hp.codec.rank);
      basis_ptr_at = c.Take(n * sizeof(void*));
      basis_at = c.Take(bases.size() * basis_bytes);
    }
  }
  if (!c.Reserve()) return c.Finish();
  P dp = hp;
  std::vector<float*> out_ptrs(n);
  for (size_t b = 0; b < n; ++b) out_ptrs[b] = c.At<float>(rows_at + b * rows_bytes);
  c.Up(in_at, hp.in, n * sizeof(void*));
  c.Up(out_ptr_at, out_ptrs.data(), n * sizeof(void*));
  if constexpr (kKeys) {
    if (basis_bytes > 0) {
      UpDistinct(c, hp.basis, n, basis_bytes, basis_at, bases, &basis_ptrs);
      c.Up(basis_ptr_at, basis_ptrs.data(), n * sizeof(void*));
      dp.basis = c.At<const float* const>(basis_ptr_at);
    }
  }
  const int no_flags = 0;
  c.Up(flags_at, hp.error_flags ? hp.error_flags : &no_flags, 4);
  dp.in = c.At<const uint8_t* const>(in_at);
  dp.out = c.At<float* const>(out_ptr_at);
  dp.ld = static_cast<int64_t>(d);
  dp.error_flags = c.At<int>(flags_at);
  c.Launched(launch(dp, c.stream()));
  for (size_t b = 0; b < n; ++b)
    c.Down(hp.out[b], rows_at + b * rows_bytes, 4 * d, G, 4 * static_cast<size_t>(hp.ld));
  if (hp.error_flags) c.Down(hp.error_flags, flags_at, 4);
  return c.Finish();
}

// EncodeKeysFromHost and EncodeValuesFromHost: each block's G rows (stride ld) copied into
// device scratch and encoded there into the device blocks hp.out points at. Key bases: each
// distinct host array copied once; values' A^2 widths (value_bits 0): each block's copied.
template <class P, class Launcher>
int EncodeFromHost(const P& hp, size_t workspace_bytes, Launcher launch) {
  if (!HasDevice()) return kErrorNoDevice;
  P dp = hp;
  dp.workspace_bytes = workspace_bytes;
  dp.workspace = &dp;  // any address for this check; the scratch's below, checked again at launch
  if (cm::Reason(dp) != nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (hp.blocks == 0) return 0;
  constexpr bool kKeys = std::is_same_v<P, EncodeKeyParams>;
  const float* const* rows;
  if constexpr (kKeys)
    rows = hp.keys;
  else
    rows = hp.values;
  const size_t n = static_cast<size_t>(hp.blocks), G = hp.codec.key_group, d = hp.codec.head_dim;
  const size_t row_bytes = 4 * d, ptrs = n * sizeof(void*);
  HostCall c;
  const size_t rows_at = c.Take(n * G * row_bytes), row_ptr_at = c.Take(ptrs);
  const size_t out_ptr_at = c.Take(ptrs), ws_at = c.Take(dp.workspace_bytes);
  std::vector<const float*> bases;                      // keys: the distinct host bases
  size_t side_at = 0, side_ptr_at = 0, side_bytes = 0;  // keys' bases or values' widths
  if constexpr (kKeys) {
    if (hp.codec.rank > 0 && hp.basis_t != nullptr) {
      bases = Distinct(hp.basis_t, n);
      side_bytes = 4 * static_cast<size_t>(hp.codec.rank) * d;
      side_at = c.Take(bases.size() * side_bytes);
      side_ptr_at = c.Take(ptrs);
    }
  } else if (hp.codec.value_bits == 0) {
    side_bytes = G;
    side_at = c.Take(n * side_bytes);
    side_ptr_at = c.Take(ptrs);
  }
  if (!c.Reserve()) return c.Finish();
  std::vector<const float*> row_ptrs(n);
  for (size_t b = 0; b < n; ++b) {
    c.Up(rows_at + b * G * row_bytes, rows[b], row_bytes, G, 4 * static_cast<size_t>(hp.ld));
    row_ptrs[b] = c.At<const float>(rows_at + b * G * row_bytes);
  }
  c.Up(row_ptr_at, row_ptrs.data(), ptrs);
  c.Up(out_ptr_at, hp.out, ptrs);
  if constexpr (kKeys) {
    if (side_bytes > 0) {
      std::vector<const float*> basis_ptrs;
      UpDistinct(c, hp.basis_t, n, side_bytes, side_at, bases, &basis_ptrs);
      c.Up(side_ptr_at, basis_ptrs.data(), ptrs);
      dp.basis_t = c.At<const float* const>(side_ptr_at);
    }
    dp.keys = c.At<const float* const>(row_ptr_at);
  } else {
    if (side_bytes > 0) {
      std::vector<const uint8_t*> width_ptrs(n);
      for (size_t b = 0; b < n; ++b) {
        c.Up(side_at + b * side_bytes, hp.widths[b], side_bytes);
        width_ptrs[b] = c.At<const uint8_t>(side_at + b * side_bytes);
      }
      c.Up(side_ptr_at, width_ptrs.data(), ptrs);
      dp.widths = c.At<const uint8_t* const>(side_ptr_at);
    }
    dp.values = c.At<const float* const>(row_ptr_at);
  }
  dp.ld = static_cast<int64_t>(d);
  dp.out = c.At<uint8_t* const>(out_ptr_at);
  dp.workspace = c.At<void>(ws_at);
  c.Launched(launch(dp, c.stream()));
  return c.Finish();
}

}  // namespace

int EncodeKeysFromHost(const EncodeKeyParams& p) {
  return EncodeFromHost(p, EncodeKeyWorkspaceBytes(p),
                        [](const EncodeKeyParams& q, void* s) { return EncodeKeys(q, s); });
}
int EncodeValuesFromHost(const EncodeValueParams& p) {
  return EncodeFromHost(p, EncodeValueWorkspaceBytes(p),
                        [](const EncodeValueParams& q, void* s) { return EncodeValues(q, s); });
}

int DecodeKeysFromHost(const DecodeKeyParams& p) {
  return DecodeFromHost(p, [](const DecodeKeyParams& q, void* s) { return DecodeKeys(q, s); });
}
int DecodeValuesFromHost(const DecodeValueParams& p) {
  return DecodeFromHost(p, [](const DecodeValueParams& q, void* s) { return DecodeValues(q, s); });
}

int ScoreBlocksFromHost(const ScoreBlocksParams& hp) {
  if (!HasDevice()) return kErrorNoDevice;
  if (cm::Reason(hp) != nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (hp.blocks == 0 || hp.n_q == 0) return 0;
  const size_t n = static_cast<size_t>(hp.blocks), nq = static_cast<size_t>(hp.n_q);
  const size_t d = hp.codec.head_dim, r = hp.uq ? static_cast<size_t>(hp.codec.rank) : 0;
  const size_t cols = n * hp.codec.key_group;  // the scores' columns a launch writes
  HostCall c;
  const size_t k_at = c.Take(n * sizeof(void*)), q_at = c.Take(4 * nq * d),
               uq_at = c.Take(4 * nq * r), out_at = c.Take(4 * nq * cols), flags_at = c.Take(4);
  if (!c.Reserve()) return c.Finish();
  const int no_flags = 0;
  c.Up(k_at, hp.key_blocks, n * sizeof(void*));
  c.Up(q_at, hp.q, 4 * nq * d);
  c.Up(uq_at, hp.uq, 4 * nq * r);
  c.Up(flags_at, hp.error_flags ? hp.error_flags : &no_flags, 4);
  ScoreBlocksParams dp = hp;
  dp.key_blocks = c.At<const uint8_t* const>(k_at);
  dp.q = c.At<const float>(q_at);
  dp.uq = r > 0 ? c.At<const float>(uq_at) : nullptr;
  dp.out = c.At<float>(out_at);
  dp.out_stride = static_cast<int64_t>(cols);
  dp.error_flags = c.At<int>(flags_at);
  c.Launched(ScoreBlocks(dp, c.stream()));
  c.Down(hp.out, out_at, 4 * cols, nq, 4 * static_cast<size_t>(hp.out_stride));
  if (hp.error_flags) c.Down(hp.error_flags, flags_at, 4);
  return c.Finish();
}

int ReadoutBlocksFromHost(const ReadoutBlocksParams& hp) {
  if (!HasDevice()) return kErrorNoDevice;
  if (cm::Reason(hp) != nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (hp.blocks == 0 || hp.n_q == 0) return 0;
  const size_t n = static_cast<size_t>(hp.blocks), nq = static_cast<size_t>(hp.n_q);
  const size_t d = hp.codec.head_dim, cols = n * hp.codec.key_group;
  HostCall c;
  const size_t v_at = c.Take(n * sizeof(void*)), p_at = c.Take(4 * nq * cols),
               out_at = c.Take(4 * nq * d), flags_at = c.Take(4);
  if (!c.Reserve()) return c.Finish();
  const int no_flags = 0;
  c.Up(v_at, hp.value_blocks, n * sizeof(void*));
  c.Up(p_at, hp.p, 4 * cols, nq, 4 * static_cast<size_t>(hp.p_stride));
  c.Up(out_at, hp.out, 4 * d, nq, 4 * static_cast<size_t>(hp.out_stride));  // accumulated into
  c.Up(flags_at, hp.error_flags ? hp.error_flags : &no_flags, 4);
  ReadoutBlocksParams dp = hp;
  dp.value_blocks = c.At<const uint8_t* const>(v_at);
  dp.p = c.At<const float>(p_at);
  dp.p_stride = static_cast<int64_t>(cols);
  dp.out = c.At<float>(out_at);
  dp.out_stride = static_cast<int64_t>(d);
  dp.error_flags = c.At<int>(flags_at);
  c.Launched(ReadoutBlocks(dp, c.stream()));
  c.Down(hp.out, out_at, 4 * d, nq, 4 * static_cast<size_t>(hp.out_stride));
  if (hp.error_flags) c.Down(hp.error_flags, flags_at, 4);
  return c.Finish();
}

}  // namespace kvq::kernels::cuda
