// The CUDA attend's thread-block programs (kernels/cuda/attend_math.h) on the CPU
// (kernels::cuda::AttendOnHost, and a loop like it for the dense baseline): every phase for
// every thread of every thread block of the grid, then the merge for every output element,
// exactly the code the GPU runs between its barriers. Needs no GPU (runs in CI), so the
// kernel's block parsing, index mapping, online softmax and log-sum-exp merge are held to
// core's CPU attend on every commit; cuda_parity_test repeats the comparison on a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cuda/attend_math.h"
#include "kernels/cuda/host_cta.h"
#include "kernels/cuda/tc_attend_math.h"
#include "kvq/core/partial_attention.h"
#include "tests/kernels/cuda_attend_cases.h"

namespace kvq::testing {
namespace {

namespace am = kernels::cuda::attend_math;
using kernels::cuda::AttendParams;
using kernels::cuda::HostCta;

// Shared memory as the GPU leaves it between launches: garbage (NaN bytes), so that a read of
// anything no phase wrote shows in the result.
std::vector<am::Vec16> GarbageSmem(int bytes) {
  std::vector<am::Vec16> sm((bytes + 15) / 16);
  std::memset(sm.data(), 0xFF, sm.size() * sizeof(am::Vec16));
  return sm;
}

struct HostRun {
  std::vector<float> out, mx, sum;
  int error_flags = 0;
};

HostRun RunCase(const PreparedAttend& pa, int splits, std::vector<uint8_t>* pool = nullptr,
                int program = kernels::cuda::kAttendAuto) {
  const int items = pa.cs.kv, rows = pa.rows(), d = pa.cs.o.head_dim;
  const uint8_t* base = pool ? pool->data() : pa.pool.data();
  std::vector<const uint8_t*> kp(pa.key_at.size()), vp(pa.value_at.size());
  for (size_t i = 0; i < kp.size(); ++i) {
    kp[i] = base + pa.key_at[i];
    vp[i] = base + pa.value_at[i];
  }
  HostRun r;
  r.out.assign(static_cast<size_t>(items) * rows * d, std::nanf(""));
  r.mx.assign(static_cast<size_t>(items) * rows, std::nanf(""));
  r.sum = r.mx;
  AttendParams p = ParamsFor(pa, kp.data(), vp.data(), pa.q_base.data(), pa.uq.data(), r.out.data(),
                             r.mx.data(), r.sum.data());
  p.splits = splits;
  p.program = program;
  p.error_flags = &r.error_flags;
  EXPECT_EQ(kernels::cuda::AttendOnHost(p), 0);
  return r;
}

// Within fp32 rounding of core's attend: the kernel sums in other orders (channel slices,
// token slices, split ranges) and folds scales and zero points (z + s code as
// (s 2^b)(1 + code/2^b) + (z - s 2^b): terms a few times |v| whose rounding shows in the
// difference). Observed up to 2.6e-6 * max|v| (legacy d128 gq7, one split over 33 blocks);
// a wrong sign of the score bias fails it by far.
constexpr float kTolerance = 4e-6f;
// The tensor-core program (kAttendTensorCores) carries the folded queries and weights as two
// bf16 each (2^-17 relative) and sums in fp32. Observed up to 7.6e-6 * max|v| (d32 v1g16); a
// wrong fragment index or a lost zero-point term fails it by far.
constexpr float kTensorTolerance = 2e-5f;

TEST(CudaAttendMath, MatchesCoreAttendOnEveryCaseAndSplitCount) {
  for (const AttendCase& cs : AttendCases())
    for (int program : {kernels::cuda::kAttendCudaCores, kernels::cuda::kAttendTensorCores}) {
      const bool tensor = program == kernels::cuda::kAttendTensorCores;
      SCOPED_TRACE(cs.name + (tensor ? " tensor cores" : " cuda cores"));
      const PreparedAttend pa = Prepare(cs);
      ASSERT_EQ(pa.cache->sealed().size(), static_cast<size_t>(cs.nb));
      ASSERT_FALSE(pa.want.empty());
      if (tensor) {
        std::vector<float> none(1);
        AttendParams p = ParamsFor(pa, nullptr, nullptr, pa.q_base.data(), pa.uq.data(),
                                   none.data(), none.data(), none.data());
        p.blocks = 0;
        if (const char* why = kernels::cuda::tc_attend::TcUnsupported(p)) {
          printf("%-40s tensor cores: not run (%s)\n", cs.name.c_str(), why);
          continue;
        }
      }
      for (int splits : {1, 3, 7, cs.nb + 2}) {  // more ranges than blocks: some are empty
        SCOPED_TRACE(::testing::Message() << splits << " splits");
        const HostRun r = RunCase(pa, splits, nullptr, program);
        EXPECT_EQ(r.error_flags, 0);
        for (size_t i = 0; i < r.mx.size(); ++i) {
          EXPECT_TRUE(std::isfinite(r.mx[i]));
          EXPECT_GT(r.sum[i], 0.0f);
        }
        const std::vector<float> got = CompleteOnCpu(pa, r.out, r.mx, r.sum);
        const float worst = WorstError(got, pa.want);
        EXPECT_LE(worst, (tensor ? kTensorTolerance : kTolerance) * pa.vmax);
        printf("%-40s %s splits %2d: worst %.3g of max|v|\n", cs.name.c_str(),
               tensor ? "tensor" : "cuda  ", splits, worst / pa.vmax);
      }
    }
}

// The A^2 case really has mixed widths (else its per-token offsets would go untested).
TEST(CudaAttendMath, A2CasesMixWidths) {
  for (const AttendCase& cs : AttendCases()) {
    if (!cs.o.per_token_value_bits()) continue;
    SCOPED_TRACE(cs.name);
    const PreparedAttend pa = Prepare(cs);
    bool seen[5] = {};
    for (size_t at : pa.value_at)
      for (int t = 0; t < cs.o.key_group; ++t)
        seen[format::TagWidth(pa.pool.data() + at + format::kHeaderBytes, t)] = true;
    EXPECT_GE(seen[1] + seen[2] + seen[3] + seen[4], 2);
  }
}

// A block whose header disagrees with the params raises the flag; the same blocks with the
// right params do not (checked above).
TEST(CudaAttendMath, HeaderMismatchSetsTheErrorFlag) {
  const AttendCase cs = AttendCases()[2];
  const PreparedAttend pa = Prepare(cs);
  for (int field : {0, 2, 3, 4, 6}) {  // magic, version, kind, bits, tokens
    SCOPED_TRACE(field);
    std::vector<uint8_t> pool = pa.pool;
    pool[pa.key_at[pa.key_at.size() - 1] + field] ^= 0x40;
    EXPECT_EQ(RunCase(pa, 3, &pool).error_flags, kernels::cuda::kAttendHeaderMismatch);
  }
  std::vector<uint8_t> pool = pa.pool;
  pool[pa.value_at[0] + 10] ^= 1;  // value_group
  EXPECT_EQ(RunCase(pa, 1, &pool).error_flags, kernels::cuda::kAttendHeaderMismatch);
}

// What the tensor-core program cannot run is refused naming the field and its limit (and
// AttendOnHost answers 1, as Attend answers cudaErrorInvalidValue); the CUDA-core program
// runs the same params.
TEST(CudaAttendMath, TensorCoreLimitsAreNamed) {
  const PreparedAttend pa = Prepare(AttendCases()[5]);  // a2 d64 gq12: 12 rows
  std::vector<const uint8_t*> kp(pa.key_at.size()), vp(pa.value_at.size());
  for (size_t i = 0; i < kp.size(); ++i) {
    kp[i] = pa.pool.data() + pa.key_at[i];
    vp[i] = pa.pool.data() + pa.value_at[i];
  }
  std::vector<float> out(pa.q.size()), mx(pa.q.size() / pa.cs.o.head_dim), sum(mx.size());
  AttendParams p = ParamsFor(pa, kp.data(), vp.data(), pa.q_base.data(), pa.uq.data(), out.data(),
                             mx.data(), sum.data());
  auto names = [](const AttendParams& q, const char* field) {
    const char* why = kernels::cuda::AttendUnsupported(q);
    return why != nullptr && std::strncmp(why, field, std::strlen(field)) == 0;
  };
  p.program = kernels::cuda::kAttendTensorCores;
  EXPECT_TRUE(names(p, "rows:")) << kernels::cuda::AttendUnsupported(p);
  EXPECT_EQ(kernels::cuda::AttendOnHost(p), 1);
  p.program = 7;
  EXPECT_TRUE(names(p, "program:"));
  p.program = kernels::cuda::kAttendCudaCores;
  EXPECT_EQ(kernels::cuda::AttendUnsupported(p), nullptr);
  EXPECT_EQ(kernels::cuda::AttendOnHost(p), 0);
  p.rows = 8;
  p.items = 1;
  p.codec.value_group = 8;  // a block's header then disagrees; only the check is asked here
  p.program = kernels::cuda::kAttendTensorCores;
  EXPECT_TRUE(names(p, "value_group:")) << kernels::cuda::AttendUnsupported(p);
}

// An item with no blocks (item_blocks) is a row no part saw: m = -inf, l = 0, output 0; the
// other item is unaffected by its neighbour's shorter run.
TEST(CudaAttendMath, ItemWithoutBlocksGivesAnEmptyPartial) {
  const AttendCase cs = AttendCases()[2];  // kv 3
  const PreparedAttend pa = Prepare(cs);
  const HostRun full = RunCase(pa, 3);
  std::vector<const uint8_t*> kp(pa.key_at.size()), vp(pa.value_at.size());
  for (size_t i = 0; i < kp.size(); ++i) {
    kp[i] = pa.pool.data() + pa.key_at[i];
    vp[i] = pa.pool.data() + pa.value_at[i];
  }
  const int d = cs.o.head_dim, rows = cs.gq;
  std::vector<float> out(full.out.size()), mx(full.mx.size()), sum(full.sum.size());
  AttendParams p = ParamsFor(pa, kp.data(), vp.data(), pa.q_base.data(), pa.uq.data(), out.data(),
                             mx.data(), sum.data());
  const std::vector<int> counts = {cs.nb, 0, cs.nb};
  p.item_blocks = counts.data();
  p.splits = 3;
  ASSERT_EQ(kernels::cuda::AttendOnHost(p), 0);
  for (int i = 0; i < rows; ++i) {
    EXPECT_EQ(mx[rows + i], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(sum[rows + i], 0.0f);
    for (int c = 0; c < d; ++c) EXPECT_EQ(out[(rows + i) * d + c], 0.0f);
  }
  for (int item : {0, 2})
    for (int i = 0; i < rows; ++i) {
      const size_t row = static_cast<size_t>(item) * rows + i;
      EXPECT_EQ(mx[row], full.mx[row]);
      EXPECT_EQ(sum[row], full.sum[row]);
      for (int c = 0; c < d; ++c) EXPECT_EQ(out[row * d + c], full.out[row * d + c]);
    }
}

// The merge element by element is core's MergePartials (same order of operations), parts that
// saw nothing included.
TEST(CudaAttendMath, MergeElementIsCoresMerge) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int parts = 5, rows = 3, d = 4;
  std::vector<float> m(parts * rows), l(m.size()), o(m.size() * d);
  for (size_t i = 0; i < m.size(); ++i) {
    m[i] = i % 4 == 1 ? -std::numeric_limits<float>::infinity() : 3 * nd(rng);
    l[i] = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : 1 + std::fabs(nd(rng));
  }
  for (float& x : o) x = nd(rng);
  for (int i = 0; i < 3; ++i) m[i * rows + 2] = -std::numeric_limits<float>::infinity();
  std::vector<float> want(rows * d);
  core::MergePartials(m.data(), l.data(), o.data(), parts, rows, d, want.data());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; ++c) {
      float got, mx, sum;
      am::MergeElement(m.data() + r, l.data() + r, rows, o.data() + r * d + c, rows * d, parts,
                       &got, &mx, &sum);
      EXPECT_FLOAT_EQ(got, want[r * d + c]);
    }
}

// The dense fp16 baseline's program against a double-precision attention over the same fp16
// rows, odd token counts (a partial last chunk) and several split counts.
TEST(CudaAttendMath, DenseBaselineMatchesDenseAttention) {
  for (int d : {64, 128})
    for (int64_t tokens : {1, 45, 1000, 4133})
      for (int splits : {1, 4}) {
        SCOPED_TRACE(::testing::Message() << d << " " << tokens << " " << splits);
        const int items = 2, rows = 3;
        auto kf = Gaussian(items * tokens * d, 1), vf = Gaussian(items * tokens * d, 2);
        std::vector<uint16_t> kh(kf.size()), vh(vf.size());
        core::FromFloat(core::DType::kF16, kf.data(), kh.data(), kf.size());
        core::FromFloat(core::DType::kF16, vf.data(), vh.data(), vf.size());
        core::ToFloat(core::DType::kF16, kh.data(), kf.data(), kf.size());
        core::ToFloat(core::DType::kF16, vh.data(), vf.data(), vf.size());
        const auto q = Gaussian(items * rows * d, 3);
        const auto want = DenseAttend(kf, vf, q, items, items * rows, 1, tokens, d);
        kernels::cuda::DenseAttendParams p;
        p.head_dim = d;
        p.items = items;
        p.rows = rows;
        p.tokens = tokens;
        p.k = kh.data();
        p.v = vh.data();
        p.q = q.data();
        p.scale = 1.0f / std::sqrt(static_cast<float>(d));
        const int chunk = am::DenseChunk(d);
        const int chunks = static_cast<int>((tokens + chunk - 1) / chunk);
        const int s = std::min(splits, chunks);
        std::vector<float> ws(static_cast<size_t>(items) * s * rows * (d + 2));
        std::vector<float> out(static_cast<size_t>(items) * rows * d, std::nanf(""));
        p.workspace = ws.data();
        p.out = out.data();
        const am::DenseGeometry g = am::MakeDenseGeometry(p);
        for (int item = 0; item < items; ++item)
          for (int k = 0; k < s; ++k) {
            auto sm = GarbageSmem(g.sm_bytes);
            HostCta<am::DenseState<4>> cta(g.threads);
            am::DenseCta<4>(cta, p, g, reinterpret_cast<uint8_t*>(sm.data()), item, k, s);
          }
        for (int64_t w = 0; w < static_cast<int64_t>(items) * rows * d; ++w)
          am::MergeOne(ws.data(), items, rows, d, s, w, out.data(), nullptr, nullptr);
        EXPECT_LE(WorstError(out, want), 2e-6f);  // observed below 4.2e-7
      }
}

}  // namespace
}  // namespace kvq::testing
