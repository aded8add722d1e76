// Memory-pool choice by name and the capacity default (core/include/kvq/core/memory_pool.h).
#include "kvq/core/memory_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  // Codes must stay readable by the CPU kernels: auto never ends on device memory.
  EXPECT_NE(c->name, "gpu");
  if (!kernels::CudaAvailable()) {
    EXPECT_EQ(c->pool, HostBytePool());
    EXPECT_THAT(c->explanation, HasSubstr(" ["));  // why not pinned
  }
}

TEST(MemoryPoolTest, AnUnknownNameNamesTheField) {
  absl::StatusOr<MemoryPoolChoice> c = ChooseMemoryPool("floppy", "--memory");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "--memory must be auto, gpu, pinned or host (got 'floppy')");
  EXPECT_THAT(std::string(ChooseMemoryPool("").status().message()), StartsWith("memory must be"));
}

TEST(MemoryPoolTest, GpuIsRefusedWithItsReason) {
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
