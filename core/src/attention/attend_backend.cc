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

absl::Status AttendBackend::Outcome(int code, const char* op) const {
  if (code == 0) return absl::OkStatus();
  if (code == kernels::cuda::kErrorNoDevice)
    return absl::UnavailableError(absl::StrCat("attend backend '", name(), "': no CUDA device"));
  if (code == 1)  // cudaErrorInvalidValue: params the op refuses
    return absl::InvalidArgumentError(
        absl::StrCat("attend backend '", name(), "': ", op, ": params not supported"));
  return absl::InternalError(absl::StrCat("attend backend '", name(), "': ", op, " error ", code));
}

absl::Status AttendBackend::AttendBlocks(const kernels::cuda::AttendParams& p) const {
  if (const char* why = kernels::cuda::AttendUnsupported(p))
    return absl::InvalidArgumentError(absl::StrCat("attend backend '", name(), "': ", why));
  calls_.fetch_add(1, std::memory_order_relaxed);
  const int e = Run(p);
  if (e == 0 || e == kernels::cuda::kErrorNoDevice) return Outcome(e, "attend");
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
  if (e == 0 || e == kernels::cuda::kErrorNoDevice) return Outcome(e, "verify");
  return absl::InternalError(absl::StrCat("attend backend '", name(), "': verify error ", e));
}

absl::Status AttendBackend::EncodeKeys(const kernels::cuda::EncodeKeyParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunEncodeKeys(p), "encode keys");
}
absl::Status AttendBackend::EncodeValues(const kernels::cuda::EncodeValueParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunEncodeValues(p), "encode values");
}
absl::Status AttendBackend::DecodeKeys(const kernels::cuda::DecodeKeyParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunDecodeKeys(p), "decode keys");
}
absl::Status AttendBackend::DecodeValues(const kernels::cuda::DecodeValueParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunDecodeValues(p), "decode values");
}
absl::Status AttendBackend::ScoreBlocks(const kernels::cuda::ScoreBlocksParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunScore(p), "score");
}
absl::Status AttendBackend::ReadoutBlocks(const kernels::cuda::ReadoutBlocksParams& p) const {
  block_op_calls_.fetch_add(1, std::memory_order_relaxed);
  return Outcome(RunReadout(p), "readout");
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
  int RunEncodeKeys(const kernels::cuda::EncodeKeyParams& p) const override {
    return kernels::cuda::EncodeKeysFromHost(p);
  }
  int RunEncodeValues(const kernels::cuda::EncodeValueParams& p) const override {
    return kernels::cuda::EncodeValuesFromHost(p);
  }
  int RunDecodeKeys(const kernels::cuda::DecodeKeyParams& p) const override {
    return kernels::cuda::DecodeKeysFromHost(p);
  }
  int RunDecodeValues(const kernels::cuda::DecodeValueParams& p) const override {
    return kernels::cuda::DecodeValuesFromHost(p);
  }
  int RunScore(const kernels::cuda::ScoreBlocksParams& p) const override {
    return kernels::cuda::ScoreBlocksFromHost(p);
  }
  int RunReadout(const kernels::cuda::ReadoutBlocksParams& p) const override {
    return kernels::cuda::ReadoutBlocksFromHost(p);
  }
};

}  // namespace

const AttendBackend* CudaAttendBackend() {
  static const CudaBackend* const b = new CudaBackend;
  return b;
}

const char* HostStandInBackend::name() const { return "cuda-host"; }
bool HostStandInBackend::CanRead(kernels::Pool pool) const { return pool != kernels::Pool::kGpu; }
int HostStandInBackend::Run(const kernels::cuda::AttendParams& p) const {
  return kernels::cuda::AttendOnHost(p);
}
int HostStandInBackend::RunVerify(const kernels::cuda::VerifyParams& p) const {
  return kernels::cuda::VerifyBlocksOnHost(p);
}
int HostStandInBackend::RunEncodeKeys(const kernels::cuda::EncodeKeyParams& p) const {
  return kernels::cuda::EncodeKeysOnHost(p);
}
int HostStandInBackend::RunEncodeValues(const kernels::cuda::EncodeValueParams& p) const {
  return kernels::cuda::EncodeValuesOnHost(p);
}
int HostStandInBackend::RunDecodeKeys(const kernels::cuda::DecodeKeyParams& p) const {
  return kernels::cuda::DecodeKeysOnHost(p);
}
int HostStandInBackend::RunDecodeValues(const kernels::cuda::DecodeValueParams& p) const {
  return kernels::cuda::DecodeValuesOnHost(p);
}
int HostStandInBackend::RunScore(const kernels::cuda::ScoreBlocksParams& p) const {
  return kernels::cuda::ScoreBlocksOnHost(p);
}
int HostStandInBackend::RunReadout(const kernels::cuda::ReadoutBlocksParams& p) const {
  return kernels::cuda::ReadoutBlocksOnHost(p);
}

const AttendBackend* HostAttendBackend() {
  static const HostStandInBackend* const b = new HostStandInBackend;
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
  // What a store runs on the backend where the CPU reads the pool only by copies
  // (LayerCache::set_block_ops): the same layer encoded on it, then scored and decoded on it,
  // against the CPU-encoded layer's reads through copies (scores within 1e-3 of their largest
  // magnitude, decoded rows within 1e-5 of theirs: the backend's ops are core's codec bit for
  // bit on the reference kernels).
  if (pool->cpu_readable()) return absl::OkStatus();
  const int64_t ops_before = backend.block_op_calls();
  LayerCache on_ops(o, kv, basis.u.data(), pool);
  on_ops.set_block_ops(&backend);
  if (absl::Status st = on_ops.Append(kt, vt, 0); !st.ok()) return st;
  std::vector<float> s_cpu(static_cast<size_t>(kv) * gq * T), s_dev(s_cpu.size());
  std::vector<float> k_cpu, v_cpu, k_dev, v_dev;
  if (absl::Status st = cache.Score(q.data(), kv * gq, 1, s_cpu.data()); !st.ok()) return st;
  if (absl::Status st = cache.Decode(&k_cpu, &v_cpu); !st.ok()) return st;
  if (absl::Status st = on_ops.Score(q.data(), kv * gq, 1, s_dev.data()); !st.ok()) return st;
  if (absl::Status st = on_ops.Decode(&k_dev, &v_dev); !st.ok()) return st;
  if (backend.block_op_calls() == ops_before)
    return absl::InternalError(absl::StrCat("attend backend '", backend.name(),
                                            "': the probe's encode and reads did not use it"));
  auto differs = [](const std::vector<float>& a, const std::vector<float>& b, float rel) {
    float scale = 0.0f, worst = a.size() == b.size() ? 0.0f : INFINITY;
    for (float x : a) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      worst = std::isfinite(b[i]) ? std::max(worst, std::fabs(a[i] - b[i])) : INFINITY;
    return !(worst <= rel * scale);
  };
  if (differs(s_cpu, s_dev, 1e-3f) || differs(k_cpu, k_dev, 1e-5f) || differs(v_cpu, v_dev, 1e-5f))
    return absl::InternalError(absl::StrCat("attend backend '", backend.name(),
                                            "': the probe's encode, score or decode on it "
                                            "differs from the CPU's"));
  return absl::OkStatus();
}

}  // namespace kvq::core
