// Memory-pool choice by name and the capacity default (core/include/kvq/core/memory_pool.h);
// the choice of gpu runs on the host stand-in of a GPU where there is none.
#include "kvq/core/memory_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "kvq/kernels/device.h"

namespace kvq::core {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(MemoryPoolTest, HostIsAlwaysHostMemory) {
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("host");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->pool, HostBytePool());
  EXPECT_EQ(c->name, "host");
  EXPECT_EQ(c->explanation, "host; encoded blocks and windows in host memory");
}

TEST(MemoryPoolTest, AutoNeverFailsAndSaysWhatItChose) {
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("auto");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_NE(c->pool, nullptr);
  EXPECT_EQ(c->name, kernels::PoolName(c->pool->pool()));
  EXPECT_THAT(c->explanation, StartsWith("auto -> " + c->name + "; "));
  // Device memory only with the attend that reads it there; on the GPU machine's check
  // (KVQ_REQUIRE_CUDA, scripts/device-check.sh) the device must be chosen.
  EXPECT_EQ(c->name == "gpu", c->backend == CudaAttendBackend());
  if (std::getenv("KVQ_REQUIRE_CUDA") != nullptr) {
    EXPECT_EQ(c->name, "gpu") << c->explanation;
  }
  if (!kernels::CudaAvailable()) {
    EXPECT_EQ(c->pool, HostBytePool());
    EXPECT_EQ(c->backend, nullptr);
    EXPECT_THAT(c->explanation, HasSubstr(" [not gpu: memory pool 'gpu'"));  // why not gpu
  }
}

// The host stand-in of a GPU (a slab pool the CPU reads by copies, the attend's programs run
// on the CPU), so that auto's choice of gpu runs here as it would on a GPU.
struct StandIn {
  SlabBytePool pool{kernels::Pool::kHost, size_t{1} << 20, SlabBytePool::CpuAccess::kByCopy};
  GpuCandidate gpu{[this] { return absl::StatusOr<BytePool*>(&pool); }, HostAttendBackend()};
};

TEST(MemoryPoolTest, AutoPicksGpuWhereItsAttendAnswersItsProbe) {
  StandIn s;
  for (const char* want : {"auto", "gpu"}) {
    absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool(want, "--memory", &s.gpu);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->pool, &s.pool);
    EXPECT_EQ(c->backend, HostAttendBackend());
    EXPECT_EQ(c->name, "gpu");
    EXPECT_EQ(c->explanation,
              std::string(want == std::string("auto") ? "auto -> " : "") +
                  "gpu; encoded blocks in device memory, attended on the GPU; windows in host "
                  "memory [the 'cuda-host' attend answered its probe]");
  }
}

// An attend that runs but answers wrongly (a broken kernel, a device computing garbage).
class WrongAttend final : public HostStandInBackend {
 public:
  const char* name() const override { return "wrong"; }
  bool CanRead(kernels::Pool pool) const override { return true; }

 protected:
  int Run(const kernels::cuda::AttendParams& p) const override {
    const int e = HostStandInBackend::Run(p);
    p.out[0] += 1.0f;
    return e;
  }
};

TEST(MemoryPoolTest, AGpuWhoseAttendFailsItsProbeIsPassedByAndSaysWhy) {
  StandIn s;
  WrongAttend wrong;
  s.gpu.backend = &wrong;
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("auto", "--memory", &s.gpu);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->name, "gpu");
  EXPECT_EQ(c->backend, nullptr);
  EXPECT_THAT(c->explanation,
              HasSubstr("[not gpu: the 'wrong' attend did not answer its probe: attend backend "
                        "'wrong': the probe's attend differs from the CPU's by "));
  c = ChooseMemoryPool("gpu", "--memory", &s.gpu);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(c.status().message()),
              StartsWith("--memory gpu is not available: the 'wrong' attend did not answer"));
  // A device that cannot give the pool: passed by with the device API's reason.
  s.gpu.backend = HostAttendBackend();
  s.gpu.pool = [] {
    return absl::StatusOr<BytePool*>(absl::FailedPreconditionError("memory pool 'gpu': none"));
  };
  c = ChooseMemoryPool("auto", "--memory", &s.gpu);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->explanation, HasSubstr("[not gpu: memory pool 'gpu': none"));
}

// An attend that answers right but whose block reads (a store's scores and decodes of device
// blocks) answer wrongly.
class WrongReads final : public HostStandInBackend {
 public:
  const char* name() const override { return "wrong-reads"; }
  bool CanRead(kernels::Pool pool) const override { return true; }

 protected:
  int RunDecodeValues(const kernels::cuda::DecodeValueParams& p) const override {
    const int e = HostStandInBackend::RunDecodeValues(p);
    if (p.blocks > 0) p.out[0][0] += 1.0f;
    return e;
  }
};

TEST(MemoryPoolTest, AGpuWhoseBlockReadsFailTheProbeIsPassedBy) {
  StandIn s;
  WrongReads wrong;
  s.gpu.backend = &wrong;
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("auto", "--memory", &s.gpu);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->name, "gpu");
  EXPECT_THAT(c->explanation,
              HasSubstr("the probe's encode, score or decode on it differs from the CPU's"));
  // The same probe with the right reads chooses gpu (the probe's reads ran on the backend).
  const int64_t reads = HostAttendBackend()->block_op_calls();
  s.gpu.backend = HostAttendBackend();
  c = ChooseMemoryPool("auto", "--memory", &s.gpu);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "gpu") << c->explanation;
  EXPECT_GT(HostAttendBackend()->block_op_calls(), reads);
}

TEST(MemoryPoolTest, AttendGpuPutsTheGpuAttendOnTheChosenPool) {
  StandIn s;
  // Host memory read by the stand-in attend, as a device reads pinned memory over the bus.
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("host");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(ChooseAttend("gpu", "--attend", &*c, &s.gpu).ok());
  EXPECT_EQ(c->pool, HostBytePool());
  EXPECT_EQ(c->name, "host");
  EXPECT_EQ(c->backend, HostAttendBackend());
  EXPECT_EQ(c->explanation,
            "host; encoded blocks and windows in host memory; attended on the GPU, which reads "
            "the blocks in host memory over the bus");
  // auto keeps what the pool choice made; cpu takes the attend off device memory.
  c = ChooseMemoryPool("gpu", "--memory", &s.gpu);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(ChooseAttend("auto", "--attend", &*c, &s.gpu).ok());
  EXPECT_EQ(c->backend, HostAttendBackend());
  ASSERT_TRUE(ChooseAttend("cpu", "--attend", &*c, &s.gpu).ok());
  EXPECT_EQ(c->backend, nullptr);
  EXPECT_THAT(c->explanation, HasSubstr("; attended by the CPU kernels (blocks copied back)"));
  // An attend that fails its probe on the pool is refused, naming the flag.
  WrongAttend wrong;
  s.gpu.backend = &wrong;
  c = ChooseMemoryPool("host");
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::Status st = ChooseAttend("gpu", "--attend", &*c, &s.gpu);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(st.message()),
              StartsWith("--attend gpu: the 'wrong' attend cannot read host memory: "));
  EXPECT_EQ(c->backend, nullptr);
  EXPECT_EQ(ChooseAttend("tpu", "--attend", &*c).message(),
            "--attend must be auto, gpu or cpu (got 'tpu')");
}

TEST(MemoryPoolTest, AttendGpuOnPinnedMemoryNeedsADevice) {
  absl::StatusOr<MemoryPoolChoice> c =
      ChooseMemoryPool(kernels::CudaAvailable() ? "pinned" : "host");
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::Status st = ChooseAttend("gpu", "--attend", &*c);
  if (!kernels::CudaAvailable()) {  // the real CUDA attend cannot run here
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(st.message()),
                StartsWith("--attend gpu: the 'cuda' attend cannot read host memory: "));
    return;
  }
  // On the GPU machine's check: the device attends blocks in pinned memory.
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(c->name, "pinned");
  EXPECT_EQ(c->backend, CudaAttendBackend());
}

TEST(MemoryPoolTest, AnUnknownNameNamesTheField) {
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("floppy", "--memory");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "--memory must be auto, gpu, pinned or host (got 'floppy')");
  EXPECT_THAT(std::string(ChooseMemoryPool("").status().message()), StartsWith("memory must be"));
}

TEST(MemoryPoolTest, GpuWithoutADeviceIsRefusedWithItsReason) {
  if (kernels::CudaAvailable()) GTEST_SKIP() << "a CUDA device answers here";
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("gpu", "--memory");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(c.status().message()),
              StartsWith("--memory gpu is not available: memory pool 'gpu'"));
}

TEST(MemoryPoolTest, PinnedWorksOnlyWithADriver) {
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("pinned");
  if (!kernels::CudaAvailable()) {
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(c.status().message()), StartsWith("memory pinned is not available: "));
    return;
  }
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "pinned");
  EXPECT_EQ(c->explanation, "pinned; encoded blocks in pinned memory, windows in host memory");
}

TEST(MemoryPoolTest, CapacityDefaultsToHalfThePhysicalMemory) {
  EXPECT_GT(PhysicalMemoryBytes(), 0);
  EXPECT_EQ(CapacityOrDefault(0), PhysicalMemoryBytes() / 2);
  EXPECT_EQ(CapacityOrDefault(12345), 12345);
  EXPECT_EQ(CapacityOrDefault(int64_t{1} << 50), int64_t{1} << 50);  // no cap by the machine
}

}  // namespace
}  // namespace kvq::core
