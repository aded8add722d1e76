#include "kvq/core/attend_backend.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/kernels/kernels.h"

namespace kvq::core {

absl::Status AttendBackend::AttendBlocks(const kernels::cuda::AttendParams& p) const {
  if (const char* why = kernels::cuda::AttendUnsupported(p))
    return absl::InvalidArgumentError(absl::StrCat("attend backend '", name(), "': ", why));
  calls_.fetch_add(1, std::memory_order_relaxed);
  const int e = Run(p);
  if (e == 0) return absl::OkStatus();
  if (e == kernels::cuda::kErrorNoDevice)
    return absl::UnavailableError(absl::StrCat("attend backend '", name(), "': no CUDA device"));
  return absl::InternalError(absl::StrCat("attend backend '", name(), "': error ", e));
}

absl::Status AttendBackend::VerifyBlocks(std::span<const uint8_t* const> blocks,
                                         std::span<const uint64_t> sizes, uint8_t* verdicts) const {
  if (blocks.size() != sizes.size() || blocks.size() > size_t{1} << 30)
    return absl::InvalidArgumentError(absl::StrCat("attend backend '", name(), "': ", blocks.size(),
                                                   " blocks, ", sizes.size(),
                                                   " sizes (at most 2^30, one each)"));
  verify_calls_.fetch_add(1, std::memory_order_relaxed);
  kernels::cuda::VerifyParams p;
  p.blocks = static_cast<int>(blocks.size());
  p.block_ptrs = blocks.data();
  p.sizes = sizes.data();
  p.verdicts = verdicts;
  const int e = RunVerify(p);
  if (e == 0) return absl::OkStatus();
  if (e == kernels::cuda::kErrorNoDevice)
    return absl::UnavailableError(absl::StrCat("attend backend '", name(), "': no CUDA device"));
  return absl::InternalError(absl::StrCat("attend backend '", name(), "': verify error ", e));
}

namespace {

class CudaBackend final : public AttendBackend {
 public:
  const char* name() const override { return "cuda"; }
  bool CanRead(kernels::Pool pool) const override { return pool != kernels::Pool::kHost; }

 protected:
  int Run(const kernels::cuda::AttendParams& p) const override {
    return kernels::cuda::AttendFromHost(p);
  }
  int RunVerify(const kernels::cuda::VerifyParams& p) const override {
    return kernels::cuda::VerifyBlocksFromHost(p);
  }
};

class HostBackend final : public AttendBackend {
 public:
  const char* name() const override { return "cuda-host"; }
  bool CanRead(kernels::Pool pool) const override { return pool != kernels::Pool::kGpu; }

 protected:
  int Run(const kernels::cuda::AttendParams& p) const override {
    return kernels::cuda::AttendOnHost(p);
  }
  int RunVerify(const kernels::cuda::VerifyParams& p) const override {
    return kernels::cuda::VerifyBlocksOnHost(p);
  }
};

}  // namespace

const AttendBackend* CudaAttendBackend() {
  static const CudaBackend* const b = new CudaBackend;
  return b;
}

const AttendBackend* HostAttendBackend() {
  static const HostBackend* const b = new HostBackend;
  return b;
}

absl::Status ProbeAttendBackend(const AttendBackend& backend, BytePool* pool) {
  CodecOptions o;
  o.head_dim = 32;
  o.key_group = 32;
  o.key_bits = 3;
  o.rank = 2;
  o.side_bits = 4;
  o.value_bits = 2;
  o.value_group = 16;
  constexpr int kv = 2, gq = 3, d = 32;
  constexpr int64_t T = 3 * 32 + 5;
  const ModelBasis basis = RandomBasis({"probe", 1, 1, kv, kv * gq, d, o.rank}, 7);
  LayerCache cache(o, kv, basis.u.data(), pool);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> k(kv * T * d), v(k.size()), q(kv * gq * d);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = 2 * nd(rng);
  const TensorView kt = TensorView::Contiguous(k.data(), DType::kF32, {kv, T, d});
  const TensorView vt = TensorView::Contiguous(v.data(), DType::kF32, {kv, T, d});
  if (absl::Status st = cache.Append(kt, vt, 0); !st.ok())
    return absl::InternalError(absl::StrCat("attend backend probe: append: ", st.message()));
  AttendOptions ao;
  ao.observe = false;
  std::vector<float> want(q.size()), got(q.size());
  if (absl::Status st = cache.Attend(q.data(), kv * gq, 1, ao, want.data()); !st.ok())
    return absl::InternalError(absl::StrCat("attend backend probe: CPU attend: ", st.message()));
  ao.backend = &backend;
  const int64_t before = backend.calls();
  if (absl::Status st = cache.Attend(q.data(), kv * gq, 1, ao, got.data()); !st.ok()) return st;
  if (backend.calls() == before)
    return absl::InternalError(
        absl::StrCat("attend backend '", backend.name(), "': the probe's attend did not use it"));
  float vmax = 0.0f, worst = 0.0f;
  for (float x : v) vmax = std::max(vmax, std::fabs(x));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::isfinite(got[i]) ? std::max(worst, std::fabs(got[i] - want[i])) : INFINITY;
  if (!(worst <= 1e-3f * vmax))
    return absl::InternalError(absl::StrCat("attend backend '", backend.name(),
                                            "': the probe's attend differs from the CPU's by ",
                                            worst, " (max|v| ", vmax, ")"));
  return absl::OkStatus();
}

}  // namespace kvq::core
