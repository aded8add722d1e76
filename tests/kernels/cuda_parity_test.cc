// CUDA kernels against the CPU (the ggml test-backend-ops habit): one table of (op, shape,
// codec, split count) rows, each with its op's tolerance. Skips, saying why, where no CUDA
// device answers (this machine and CI build it, nvcc present), unless KVQ_REQUIRE_CUDA is set
// (the GPU machine's check: a missing device is then a failure); runs on a GPU machine.
//
//   score_codes   the kernel table's op against its scalar reference, random codes.
//   attend        the fused decode attend over real blocks (tests/kernels/cuda_attend_cases.h:
//                 the server's default codec, the legacy one, A^2, rotations, fp16 sinks, rank
//                 0, d 32..256, 1 to 33 blocks) at 1, 3 and automatic split counts, its
//                 partial merged with the CPU's over sinks and window against LayerCache's
//                 attend on the reference kernels; the header check must stay silent.
//   attend_tc     the same on the tensor-core program (warp_mma.h's mma.sync), every case of
//                 at most 8 rows: the real tensor cores against the fragment layouts that
//                 cuda_math_test emulates.
//   block_codec   encode, decode, scores and readout of blocks (tests/kernels/cuda_codec_cases.h)
//                 against their CPU stand-ins, bit for bit.
//   dense_attend  the fp16 baseline of kvq-bench-cuda against double-precision attention.
// VerifyBlocks, the batched checksum op, gets its own test: its verdicts over good and
// corrupted blocks of every version (tests/kernels/cuda_checksum_cases.h) at odd device addresses
// against VerifyBlocksOnHost's, byte for byte.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/kernels/cuda_checksum.h"
#include "kvq/kernels/device.h"
#include "kvq/kernels/kernels.h"
#include "tests/kernels/cuda_attend_cases.h"
#include "tests/kernels/cuda_checksum_cases.h"
#include "tests/kernels/cuda_codec_cases.h"

#ifdef KVQ_HAVE_CUDA
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/cuda_codec.h"
#endif

namespace kvq::kernels {
namespace {

#ifdef KVQ_HAVE_CUDA
// Device buffers freed at scope exit.
struct DeviceBuffers {
  std::vector<void*> held;
  std::string err;
  ~DeviceBuffers() {
    for (void* p : held) Free(Pool::kGpu, p);
  }
  template <class T>
  T* Alloc(size_t count) {
    void* p = Allocate(Pool::kGpu, count * sizeof(T) + 16, &err);
    if (p) held.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* Upload(const std::vector<T>& v) {
    T* p = Alloc<T>(v.size());
    if (p && !v.empty() && Copy(p, Pool::kGpu, v.data(), Pool::kHost, v.size() * sizeof(T)) != 0)
      return nullptr;
    return p;
  }
  template <class T>
  std::vector<T> Download(const T* p, size_t count) {
    std::vector<T> v(count);
    if (Copy(v.data(), Pool::kHost, p, Pool::kGpu, count * sizeof(T)) != 0) v.clear();
    return v;
  }
};

// One row of the table: what it runs and its worst error against its tolerance.
struct Row {
  std::string op, shape;
  std::function<void(float* worst, float* tolerance)> run;
};

void ScoreCodesRows(std::vector<Row>* rows) {
  for (int bits : {1, 2, 3, 4, 8})
    for (int d : {64, 80, 128})
      for (int n_q : {1, 3, 8})
        rows->push_back({"score_codes", absl::StrCat("b", bits, " d", d, " nq", n_q),
                         [=](float* worst, float* tol) {
                           std::mt19937 rng(1);
                           std::normal_distribution<float> nd;
                           const int tokens = 64;
                           std::vector<uint8_t> codes(static_cast<size_t>(tokens) * bits / 8 * d);
                           for (auto& c : codes) c = static_cast<uint8_t>(rng());
                           std::vector<uint16_t> sc(d), ze(d);
                           for (int c = 0; c < d; ++c) {
                             sc[c] = static_cast<uint16_t>(0x2c00 + rng() % 0x800);
                             ze[c] = static_cast<uint16_t>(0xb000 + rng() % 0x800);
                           }
                           std::vector<float> q(n_q * d), want(n_q * tokens);
                           for (auto& x : q) x = nd(rng);
                           Ref().score_codes(codes.data(), bits, d, tokens, sc.data(), ze.data(),
                                             q.data(), d, n_q, 0.125f, false, want.data(), tokens);
                           DeviceBuffers dev;
                           uint8_t* dc = dev.Upload(codes);
                           uint16_t *ds = dev.Upload(sc), *dz = dev.Upload(ze);
                           float *dq = dev.Upload(q), *dout = dev.Alloc<float>(want.size());
                           ASSERT_TRUE(dc && ds && dz && dq && dout) << dev.err;
                           ASSERT_EQ(cuda::ScoreCodes(dc, bits, d, tokens, ds, dz, dq, d, n_q,
                                                      0.125f, false, dout, tokens, nullptr),
                                     0);
                           const auto got = dev.Download(dout, want.size());
                           *worst = 0.0f;
                           for (size_t i = 0; i < want.size(); ++i)
                             *worst = std::max(
                                 *worst, std::fabs(got[i] - want[i]) / (1 + std::fabs(want[i])));
                           *tol = 1e-3f;
                         }});
}

// Every case on each program that runs it (the tensor-core one takes at most 8 rows).
void AttendRows(std::vector<Row>* rows) {
  for (const testing::AttendCase& cs : testing::AttendCases())
    for (int program : {cuda::kAttendCudaCores, cuda::kAttendTensorCores})
      for (int splits : {1, 3, 0}) {
        const bool tensor = program == cuda::kAttendTensorCores;
        if (tensor && cs.gq > 8) continue;
        rows->push_back({tensor ? "attend_tc" : "attend",
                         absl::StrCat(cs.name, " splits ", splits ? absl::StrCat(splits) : "auto"),
                         [cs, splits, program, tensor](float* worst, float* tol) {
                           const testing::PreparedAttend pa = testing::Prepare(cs);
                           ASSERT_FALSE(pa.want.empty());
                           DeviceBuffers dev;
                           const uint8_t* pool = dev.Upload(pa.pool);
                           ASSERT_TRUE(pool) << dev.err;
                           std::vector<const uint8_t*> kp(pa.key_at.size()), vp(pa.value_at.size());
                           for (size_t i = 0; i < kp.size(); ++i) {
                             kp[i] = pool + pa.key_at[i];
                             vp[i] = pool + pa.value_at[i];
                           }
                           const size_t R = static_cast<size_t>(cs.kv) * cs.gq, d = cs.o.head_dim;
                           auto** dkp = dev.Upload(kp);
                           auto** dvp = dev.Upload(vp);
                           float *dq = dev.Upload(pa.q_base), *duq = dev.Upload(pa.uq);
                           float *dout = dev.Alloc<float>(R * d), *dmx = dev.Alloc<float>(R),
                                 *dsum = dev.Alloc<float>(R);
                           int* flags = dev.Upload(std::vector<int>{0});
                           ASSERT_TRUE(dkp && dvp && dq && duq && dout && dmx && dsum && flags)
                               << dev.err;
                           cuda::AttendParams p =
                               testing::ParamsFor(pa, dkp, dvp, dq, duq, dout, dmx, dsum);
                           p.splits = splits;
                           p.program = program;
                           p.error_flags = flags;
                           ASSERT_EQ(cuda::AttendUnsupported(p), nullptr);
                           p.workspace_bytes = cuda::AttendWorkspaceBytes(p);
                           p.workspace = dev.Alloc<uint8_t>(p.workspace_bytes);
                           ASSERT_TRUE(p.workspace) << dev.err;
                           ASSERT_EQ(cuda::Attend(p, nullptr), 0);
                           const auto out = dev.Download(dout, R * d), mx = dev.Download(dmx, R),
                                      sum = dev.Download(dsum, R);
                           EXPECT_EQ(dev.Download(flags, 1).at(0), 0) << "a header check failed";
                           const auto got = testing::CompleteOnCpu(pa, out, mx, sum);
                           *worst = testing::WorstError(got, pa.want) / pa.vmax;
                           // FMA contraction and the device's expf against the host's: a few times
                           // the CPU program's worst (cuda_math_test prints it; 2.6e-6 at most for
                           // the CUDA-core program, 7.6e-6 for the tensor-core one, whose tensor
                           // cores also sum in an order of their own).
                           *tol = tensor ? 6e-5f : 2e-5f;
                         }});
      }
}

// The block codec's six ops (encode keys and values, decode both, scores, readout) on the
// device against their CPU stand-ins (which cuda_codec_test holds to core's codec): the same
// bytes and the same floats, bit for bit (codec.cu builds with -fmad=false). worst: the number
// of differing bytes and floats.
void BlockCodecRows(std::vector<Row>* rows) {
  for (const core::CodecOptions& o : testing::BlockCodecCases())
    rows->push_back(
        {"block_codec", testing::CaseName(o), [o](float* worst, float* tol) {
           const testing::CodecCase cs = testing::PrepareCodecCase(o, 61);
           const testing::CodecResults want = testing::RunStandIns(cs);
           testing::CodecCaseBuffers buf(cs);
           DeviceBuffers dev;
           int* flags = dev.Upload(std::vector<int>{0});
           const testing::CodecCaseAddresses a{dev.Upload(cs.keys),
                                               dev.Upload(cs.values),
                                               dev.Upload(cs.basis_t),
                                               dev.Upload(cs.basis),
                                               dev.Upload(cs.hq),
                                               dev.Upload(cs.uq),
                                               dev.Upload(cs.probs),
                                               dev.Upload(cs.widths),
                                               dev.Upload(buf.key_out),
                                               dev.Upload(buf.value_out),
                                               dev.Upload(buf.key_in),
                                               dev.Upload(buf.value_in),
                                               dev.Upload(buf.dec_k),
                                               dev.Upload(buf.dec_v),
                                               dev.Upload(buf.scores),
                                               dev.Upload(buf.readout),
                                               flags};
           ASSERT_TRUE(a.keys && a.values && a.key_out && a.value_out && a.key_in && a.value_in &&
                       a.dec_k && a.dec_v && a.scores && a.readout && flags)
               << dev.err;
           const void* const* arrays = dev.Upload(testing::PointerArrays(cs, buf, a));
           ASSERT_TRUE(arrays) << dev.err;
           testing::CodecCaseParams p = testing::ParamsOf(cs, a, arrays);
           p.ek.workspace_bytes = cuda::EncodeKeyWorkspaceBytes(p.ek);
           p.ek.workspace = dev.Alloc<uint8_t>(p.ek.workspace_bytes);
           p.ev.workspace_bytes = cuda::EncodeValueWorkspaceBytes(p.ev);
           p.ev.workspace = dev.Alloc<uint8_t>(p.ev.workspace_bytes);
           ASSERT_EQ(cuda::EncodeKeys(p.ek, nullptr), 0);
           ASSERT_EQ(cuda::EncodeValues(p.ev, nullptr), 0);
           ASSERT_EQ(cuda::DecodeKeys(p.dk, nullptr), 0);
           ASSERT_EQ(cuda::DecodeValues(p.dv, nullptr), 0);
           ASSERT_EQ(cuda::ScoreBlocks(p.sc, nullptr), 0);
           ASSERT_EQ(cuda::ReadoutBlocks(p.ro, nullptr), 0);
           buf.key_out = dev.Download(a.key_out, buf.key_out.size());
           buf.value_out = dev.Download(a.value_out, buf.value_out.size());
           buf.dec_k = dev.Download(a.dec_k, buf.dec_k.size());
           buf.dec_v = dev.Download(a.dec_v, buf.dec_v.size());
           buf.scores = dev.Download(a.scores, buf.scores.size());
           buf.readout = dev.Download(a.readout, buf.readout.size());
           const testing::CodecResults got =
               testing::Collect(cs, buf, dev.Download(flags, 1).at(0));
           EXPECT_EQ(got.flags, 0);
           int64_t differ = 0;
           auto count_bytes = [&](const auto& x, const auto& y) {
             for (size_t b = 0; b < x.size(); ++b)
               for (size_t i = 0; i < x[b].size(); ++i) differ += x[b][i] != y[b][i];
           };
           auto count_floats = [&](const std::vector<float>& x, const std::vector<float>& y) {
             ASSERT_EQ(x.size(), y.size());
             for (size_t i = 0; i < x.size(); ++i) differ += std::memcmp(&x[i], &y[i], 4) != 0;
           };
           count_bytes(got.key_blocks, want.key_blocks);
           count_bytes(got.value_blocks, want.value_blocks);
           count_floats(got.keys, want.keys);
           count_floats(got.values, want.values);
           count_floats(got.scores, want.scores);
           count_floats(got.readout, want.readout);
           *worst = static_cast<float>(differ);
           *tol = 0.0f;
         }});
}

void DenseRows(std::vector<Row>* rows) {
  for (int d : {64, 128})
    for (int64_t tokens : {1, 45, 1000, 4133})
      for (int splits : {1, 4, 0})
        rows->push_back({"dense_attend", absl::StrCat("d", d, " t", tokens, " s", splits),
                         [=](float* worst, float* tol) {
                           const int items = 3, rows_per = 4;
                           auto kf = testing::Gaussian(items * tokens * d, 1),
                                vf = testing::Gaussian(items * tokens * d, 2);
                           std::vector<uint16_t> kh(kf.size()), vh(vf.size());
                           core::FromFloat(core::DType::kF16, kf.data(), kh.data(), kf.size());
                           core::FromFloat(core::DType::kF16, vf.data(), vh.data(), vf.size());
                           core::ToFloat(core::DType::kF16, kh.data(), kf.data(), kf.size());
                           core::ToFloat(core::DType::kF16, vh.data(), vf.data(), vf.size());
                           const auto q = testing::Gaussian(items * rows_per * d, 3);
                           const auto want = testing::DenseAttend(kf, vf, q, items,
                                                                  items * rows_per, 1, tokens, d);
                           DeviceBuffers dev;
                           cuda::DenseAttendParams p;
                           p.head_dim = d;
                           p.items = items;
                           p.rows = rows_per;
                           p.tokens = tokens;
                           p.k = dev.Upload(kh);
                           p.v = dev.Upload(vh);
                           p.q = dev.Upload(q);
                           p.scale = 1.0f / std::sqrt(static_cast<float>(d));
                           p.splits = splits;
                           p.out = dev.Alloc<float>(want.size());
                           p.workspace_bytes = cuda::DenseAttendWorkspaceBytes(p);
                           p.workspace = dev.Alloc<uint8_t>(p.workspace_bytes);
                           ASSERT_TRUE(p.k && p.v && p.q && p.out && p.workspace) << dev.err;
                           ASSERT_EQ(cuda::DenseAttend(p, nullptr), 0);
                           *worst = testing::WorstError(dev.Download(p.out, want.size()), want);
                           *tol = 2e-5f;
                         }});
}
#endif

TEST(CudaParity, EveryOpShapeAndCodec) {
#ifndef KVQ_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!CudaAvailable()) {
    std::string why;
    BestPool(&why);  // says what the runtime answered
    // On the GPU machine a skip would hide a broken driver or runtime: KVQ_REQUIRE_CUDA=1 there.
    if (std::getenv("KVQ_REQUIRE_CUDA") != nullptr) FAIL() << "KVQ_REQUIRE_CUDA set; " << why;
    GTEST_SKIP() << why;
  }
  std::vector<Row> rows;
  ScoreCodesRows(&rows);
  AttendRows(&rows);
  BlockCodecRows(&rows);
  DenseRows(&rows);
  for (const Row& row : rows) {
    SCOPED_TRACE(row.op + " " + row.shape);
    float worst = -1.0f, tol = 0.0f;
    row.run(&worst, &tol);
    EXPECT_LE(worst, tol);
    EXPECT_GE(worst, 0.0f) << "the row did not run to its comparison";
    printf("%-13s %-52s worst %.3g (tolerance %.3g)\n", row.op.c_str(), row.shape.c_str(), worst,
           tol);
  }
#endif
}

// The launcher refuses what the kernel does not support, naming the field.
TEST(CudaParity, UnsupportedParamsAreNamed) {
#ifndef KVQ_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const testing::PreparedAttend pa = testing::Prepare(testing::AttendCases()[0]);
  float dummy = 0.0f;
  const uint8_t* ptr = nullptr;
  cuda::AttendParams p = testing::ParamsFor(pa, &ptr, &ptr, &dummy, &dummy, &dummy, &dummy, &dummy);
  EXPECT_EQ(cuda::AttendUnsupported(p), nullptr);
  p.rows = 17;
  ASSERT_NE(cuda::AttendUnsupported(p), nullptr);
  EXPECT_NE(std::string(cuda::AttendUnsupported(p)).find("rows"), std::string::npos);
  p.rows = 3;
  p.codec.head_dim = 80;
  EXPECT_NE(std::string(cuda::AttendUnsupported(p)).find("head_dim"), std::string::npos);
  p.codec.head_dim = 128;
  p.masked_prefix = p.codec.key_group;
  EXPECT_NE(std::string(cuda::AttendUnsupported(p)).find("masked_prefix"), std::string::npos);
#endif
}

// The checksum op on the device gives the host run's verdicts, which are the cases' own.
TEST(CudaParity, VerifyBlocksMatchesHost) {
#ifndef KVQ_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  std::string no_device;
  if (!CudaAvailable()) {
    BestPool(&no_device);
    if (std::getenv("KVQ_REQUIRE_CUDA") != nullptr) FAIL() << "KVQ_REQUIRE_CUDA set; " << no_device;
    GTEST_SKIP() << no_device;
  }
  const std::vector<testing::ChecksumCase> cases = testing::VerifyCases();
  const testing::PackedBlocks packed = testing::Pack(cases);
  const int n = static_cast<int>(cases.size());
  DeviceBuffers dev;
  const uint8_t* pool = dev.Upload(packed.bytes);
  ASSERT_TRUE(pool) << dev.err;
  std::vector<const uint8_t*> on_device(n), on_host(n);
  for (int i = 0; i < n; ++i) {
    on_device[i] = pool + packed.offsets[i];
    on_host[i] = packed.bytes.data() + packed.offsets[i];
  }
  auto** ptrs = dev.Upload(on_device);
  const uint64_t* sizes = dev.Upload(packed.sizes);
  uint8_t* verdicts = dev.Upload(std::vector<uint8_t>(n, 0xEE));
  ASSERT_TRUE(ptrs && sizes && verdicts) << dev.err;
  ASSERT_EQ(cuda::VerifyBlocks({n, ptrs, sizes, verdicts}, nullptr), 0);
  const std::vector<uint8_t> got = dev.Download(verdicts, n);
  std::vector<uint8_t> want(n, 0xEE);
  ASSERT_EQ(cuda::VerifyBlocksOnHost({n, on_host.data(), packed.sizes.data(), want.data()}), 0);
  ASSERT_EQ(got.size(), want.size());
  int verified = 0;
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(static_cast<int>(got[i]), static_cast<int>(want[i])) << cases[i].name;
    EXPECT_EQ(static_cast<int>(want[i]), static_cast<int>(cases[i].verdict)) << cases[i].name;
    verified += got[i] == cuda::kVerifyOk;
  }
  printf("verify_blocks %d blocks, %d verified, the rest flagged as the host flags them\n", n,
         verified);
  // No blocks: nothing launched; arrays missing: refused, nothing written.
  EXPECT_EQ(cuda::VerifyBlocks({0, nullptr, nullptr, nullptr}, nullptr), 0);
  EXPECT_EQ(cuda::VerifyBlocks({n, nullptr, sizes, verdicts}, nullptr), 1);
#endif
}

}  // namespace
}  // namespace kvq::kernels
