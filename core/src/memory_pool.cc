#include "kvq/core/memory_pool.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kvq/kernels/device.h"

namespace kvq::core {

absl::StatusOr<MemoryPoolChoice> ChooseMemoryPool(absl::string_view want, absl::string_view field) {
  std::string why;
  kernels::Pool pool = kernels::Pool::kHost;
  if (want == "auto") {
    pool = kernels::BestPool(&why);
  } else if (want == "pinned") {
    pool = kernels::Pool::kPinned;
  } else if (want == "gpu") {
    pool = kernels::Pool::kGpu;
  } else if (want != "host") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be auto, gpu, pinned or host (got '", want, "')"));
  }
  absl::StatusOr<BytePool*> bytes = SharedBytePool(pool);
  if (!bytes.ok() && want != "auto") {
    return absl::FailedPreconditionError(
        absl::StrCat(field, " ", want, " is not available: ", bytes.status().message()));
  }
  if (!bytes.ok()) {  // auto: what the device API offered does not work; host memory
    why = absl::StrCat(why, "; ", bytes.status().message());
    bytes = HostBytePool();
  }
  MemoryPoolChoice c;
  c.pool = *bytes;
  c.name = kernels::PoolName(c.pool->pool());
  c.explanation =
      absl::StrCat(want == "auto" ? "auto -> " : "", c.name, "; ",
                   c.name == "host" ? "encoded blocks and windows in host memory"
                                    : "encoded blocks in pinned memory, windows in host memory",
                   why.empty() ? "" : absl::StrCat(" [", why, "]"));
  return c;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? int64_t{pages} * size : int64_t{8} << 30;
}

int64_t CapacityOrDefault(int64_t capacity_bytes) {
  return capacity_bytes > 0 ? capacity_bytes : PhysicalMemoryBytes() / 2;
}

}  // namespace kvq::core
