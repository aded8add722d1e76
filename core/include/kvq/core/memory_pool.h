// Where a serving store's encoded blocks live, chosen by name at start-up, and how big the
// store may grow when nobody says: the two defaults a server (or any embedder) takes before it
// builds a Store.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/core/attend_backend.h"
#include "kvq/core/byte_pool.h"

namespace kvq::core {

struct MemoryPoolChoice {
  BytePool* pool = nullptr;  // process-wide, never null once chosen
  std::string name;          // "gpu", "pinned" or "host": what `pool` is
  // Where Attend's encoded blocks are attended (StoreOptions::attend_backend): the CUDA
  // attend for gpu, null (the CPU kernels) otherwise.
  const AttendBackend* backend = nullptr;
  // One line for the start-up log: what was asked, what it came to, where blocks and windows
  // live and, for "auto", why: "auto -> host; encoded blocks and windows in host memory [no
  // CUDA driver ...]".
  std::string explanation;
};

// What "gpu" means: device memory for the blocks and the attend backend that reads it. The
// default is SharedBytePool(kGpu) and CudaAttendBackend(); tests give the host stand-ins (a
// SlabBytePool read by copies and HostAttendBackend()) so that the choice runs as on a GPU.
struct GpuCandidate {
  std::function<absl::StatusOr<BytePool*>()> pool;
  const AttendBackend* backend = nullptr;
};

// The pool named `want`:
//   "auto"   the best that works here: gpu where the pool is made and its attend backend
//            answers ProbeAttendBackend, then pinned, then host; never fails (no CUDA driver
//            means host memory, and the explanation says why each better one was passed by);
//   "gpu"    device memory for the encoded blocks, attended by the CUDA backend (the CPU
//            paths copy blocks back: byte_pool.h, CpuView), windows in host memory;
//   "pinned" page-locked host memory from the CUDA driver (SharedBytePool(kPinned));
//   "host"   ordinary host memory.
// Errors name `field` (e.g. the flag "--memory"): INVALID_ARGUMENT "<field> must be auto, gpu,
// pinned or host (got 'x')"; FAILED_PRECONDITION "<field> <want> is not available: <why>" for
// a pool named explicitly that cannot work here. `gpu`: null for the real one.
absl::StatusOr<MemoryPoolChoice> ChooseMemoryPool(absl::string_view want,
                                                  absl::string_view field = "memory",
                                                  const GpuCandidate* gpu = nullptr);

// Which attend reads a chosen pool's blocks, by name, applied to `c` (its backend and
// explanation):
//   "auto" what ChooseMemoryPool chose: the CUDA attend for gpu, the CPU kernels otherwise;
//   "gpu"  the CUDA attend (`gpu`'s backend; null: the real one) on whatever pool was chosen:
//          device memory, or pinned memory read by the device over the bus (no copy of the
//          blocks to the device); refused where its probe fails on that pool;
//   "cpu"  the CPU kernels (device blocks are then copied back for every read).
// Errors name `field` (e.g. "--attend"): INVALID_ARGUMENT "<field> must be auto, gpu or cpu
// (got 'x')"; FAILED_PRECONDITION "<field> gpu: the '<name>' attend cannot read <pool> memory:
// <why>".
absl::Status ChooseAttend(absl::string_view want, absl::string_view field, MemoryPoolChoice* c,
                          const GpuCandidate* gpu = nullptr);

// The machine's physical memory in bytes (sysconf); 8 GiB when the system does not say.
int64_t PhysicalMemoryBytes();

// A serving store's capacity: `capacity_bytes` when > 0, else (0, "auto") half the machine's
// physical memory, leaving the other half to the process's own buffers, the OS and whatever
// else runs beside it. (A bare StoreOptions::capacity_bytes of 0 means unlimited; a server
// resolves it through this first.)
int64_t CapacityOrDefault(int64_t capacity_bytes);

}  // namespace kvq::core
