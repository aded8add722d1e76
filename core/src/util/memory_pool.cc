#include "kvq/core/memory_pool.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/kernels/device.h"

namespace kvq::core {

namespace {

// The gpu candidate's pool with its backend probed on it, or why not.
absl::StatusOr<BytePool*> TryGpu(const GpuCandidate& gpu) {
  ASSIGN_OR_RETURN(BytePool * pool, gpu.pool());
  if (absl::Status st = ProbeAttendBackend(*gpu.backend, pool); !st.ok())
    return absl::FailedPreconditionError(absl::StrCat(
        "the '", gpu.backend->name(), "' attend did not answer its probe: ", st.message()));
  return pool;
}

}  // namespace

absl::StatusOr<MemoryPoolChoice> ChooseMemoryPool(absl::string_view want, absl::string_view field,
                                                  const GpuCandidate* gpu) {
  if (want != "auto" && want != "gpu" && want != "pinned" && want != "host") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be auto, gpu, pinned or host (got '", want, "')"));
  }
  const GpuCandidate real{[] { return SharedBytePool(kernels::Pool::kGpu); }, CudaAttendBackend()};
  if (gpu == nullptr) gpu = &real;
  std::string why;
  MemoryPoolChoice c;
  if (want == "gpu" || want == "auto") {
    absl::StatusOr<BytePool*> bytes = TryGpu(*gpu);
    if (bytes.ok()) {
      c.pool = *bytes;
      c.backend = gpu->backend;
      why = absl::StrCat("the '", gpu->backend->name(), "' attend answered its probe");
    } else if (want == "gpu") {
      return absl::FailedPreconditionError(
          absl::StrCat(field, " gpu is not available: ", bytes.status().message()));
    } else {
      why = absl::StrCat("not gpu: ", bytes.status().message());
    }
  }
  if (c.pool == nullptr) {
    kernels::Pool pool = kernels::Pool::kHost;
    if (want == "auto") {
      std::string best;
      pool = kernels::BestPool(&best);
      why = absl::StrCat(why, "; ", best);
    } else if (want == "pinned") {
      pool = kernels::Pool::kPinned;
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
    c.pool = *bytes;
  }
  c.name = c.backend ? "gpu" : kernels::PoolName(c.pool->pool());
  const char* where =
      c.backend ? "encoded blocks in device memory, attended on the GPU; windows in host memory"
      : c.name == "host" ? "encoded blocks and windows in host memory"
                         : "encoded blocks in pinned memory, windows in host memory";
  c.explanation = absl::StrCat(want == "auto" ? "auto -> " : "", c.name, "; ", where,
                               why.empty() ? "" : absl::StrCat(" [", why, "]"));
  return c;
}

absl::Status ChooseAttend(absl::string_view want, absl::string_view field, MemoryPoolChoice* c,
                          const GpuCandidate* gpu) {
  if (want != "auto" && want != "gpu" && want != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be auto, gpu or cpu (got '", want, "')"));
  }
  if (want == "cpu" && c->backend != nullptr) {
    c->backend = nullptr;
    absl::StrAppend(&c->explanation, "; attended by the CPU kernels (blocks copied back)");
  } else if (want == "gpu" && c->backend == nullptr) {
    const AttendBackend* backend = gpu != nullptr ? gpu->backend : CudaAttendBackend();
    if (absl::Status st = ProbeAttendBackend(*backend, c->pool); !st.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(field, " gpu: the '", backend->name(),
                                                        "' attend cannot read ", c->name,
                                                        " memory: ", st.message()));
    }
    c->backend = backend;
    absl::StrAppend(&c->explanation, "; attended on the GPU, which reads the blocks in ", c->name,
                    " memory over the bus");
  }
  return absl::OkStatus();
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? int64_t{pages} * size : int64_t{8} << 30;
}

int64_t CapacityOrDefault(int64_t capacity_bytes) {
  return capacity_bytes > 0 ? capacity_bytes : PhysicalMemoryBytes() / 2;
}

}  // namespace kvq::core
