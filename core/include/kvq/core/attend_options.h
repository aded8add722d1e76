// How one Attend runs (AttendOptions): causal offset, softmax scale, the A^2 observation,
// the split into parts (flash-decoding) and who runs them, the device backend; and the
// server's split policy (AttendSplitParts).
#pragma once

#include <cstdint>
#include <functional>

namespace kvq::core {

class AttendBackend;  // attend_backend.h
class WorkerPool;     // worker_pool.h

// Runs task(0), ..., task(n - 1), possibly concurrently on other threads, and returns once
// every one has finished. Core owns no threads: the caller (the server's worker pool) runs the
// parts of a split Attend through this.
using RunParts = std::function<void(int n, const std::function<void(int)>& task)>;

// A RunParts over the caller's executor: `submit` hands a closure to other threads (e.g. a
// worker pool's queue); `helpers` closures are submitted, and they and the calling thread
// claim parts one at a time until none is left, so the caller waits only for parts already
// running, never for a helper still queued behind other work (one that starts after the parts
// ran out returns at once). Safe from a pool's own worker; with every worker busy it costs
// `helpers` queued no-ops and runs all parts on the calling thread.
RunParts ClaimingRunParts(std::function<void(std::function<void()>)> submit, int helpers);
// The same over a WorkerPool's queue (kvq/core/worker_pool.h), which must outlive the result.
RunParts ClaimingRunParts(WorkerPool* pool, int helpers);

// A server's split policy for one Attend: the parts it asks for (AttendOptions::parts) when
// `idle` of its `workers` have nothing to do, the calling worker being busy with this call.
// One part per idle worker plus the caller's own, at most kMaxAttendParts and `workers`;
// 1 (no split) when none is idle or min_tokens is 0 (splitting off). Whether the layer is
// long enough (min_tokens) is decided under the store's lock: AttendOptions::split_min_tokens.
// The cap: past 4 parts at 32k tokens a part is too short to repay its own wake-up and merge.
inline constexpr int kMaxAttendParts = 4;
int AttendSplitParts(int64_t min_tokens, int idle, int workers);

struct AttendOptions {
  // Query i sees cached tokens [0, causal_offset + i]; -1: every cached token.
  int64_t causal_offset = -1;
  // Record the attention of these queries on window tokens as A^2 statistics for the
  // value policy (what a server legitimately knows: earlier readouts).
  bool observe = true;
  // Softmax scale; 0 means 1/sqrt(head_dim).
  float scale = 0.0f;
  // Flash-decoding: the cached tokens split into up to `parts` ranges of whole key groups
  // (LayerCache::AttendPartBounds), each scored, exponentiated against its own maximum and
  // read out on its own (an AttendPartial), then merged exactly by log-sum-exp
  // (MergePartials, partial_attention.h). 1 (the default) or fewer: the unsplit order. The
  // result depends on the part count only, never on run_parts or the schedule (bit-identical
  // from run to run). Against the unsplit order: the same bits for a query row whose visible
  // tokens all lie in one part (a causal offset inside the first part); otherwise rounding,
  // within 2e-6 * max|v| per output element on the fp32 readout and 1e-5 * max|v| on the
  // int16 one (AVX512-VNNI, blocks of 2- or 3-bit values: a part's weights, scaled by its own
  // maximum, can round to the neighbouring int16 step of their block), tested in
  // tests/core/attend_split_test.cc. Run on one thread,
  // 2 parts cost within ~2% of the unsplit order at 32k tokens (kvq-bench-codec AttendSplit).
  int parts = 1;
  // parts > 1 applies only to a layer holding at least this many tokens; a shorter one runs
  // unsplit (and never calls run_parts). 0: any length.
  int64_t split_min_tokens = 0;
  // Runs the parts (e.g. on idle workers); null: one after another on the calling thread.
  // Must outlive the call.
  const RunParts* run_parts = nullptr;
  // Where the encoded blocks' part runs (attend_backend.h: a GPU, or its host stand-in); null:
  // the CPU kernels. The backend splits the blocks its own way (parts and run_parts do not
  // apply); the fp16 sinks and the window are attended here and merged with its partial. A
  // read the backend cannot take runs on the CPU kernels as without one: a codec outside
  // kernels::cuda::AttendUnsupported's limits, or a causal offset that hides an encoded token
  // from a query (the kernel gives every query row every block).
  const AttendBackend* backend = nullptr;
};

}  // namespace kvq::core
