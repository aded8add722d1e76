// The fused attend on the CPU: attend_math.h's thread-block programs run phase by phase for
// every thread of every thread block, then the merge for every output element; and the check
// of what the kernel supports, shared by both builds.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../cuda/attend_math.h"
#include "../cuda/host_cta.h"
#include "../cuda/tc_attend_math.h"
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/cuda_codec.h"

namespace kvq::kernels::cuda {
namespace am = attend_math;
namespace tc = tc_attend;

namespace {

void MergeAll(const AttendParams& p, int splits) {
  const int d = p.codec.head_dim;
  for (int64_t w = 0; w < static_cast<int64_t>(p.items) * p.rows * d; ++w)
    am::MergeOne(p.workspace, p.items, p.rows, d, splits, w, p.out, p.out_max, p.out_sum);
}

template <int MaxRows>
void RunGrid(const AttendParams& p, const am::Geometry& g, int splits) {
  thread_local std::vector<am::Vec16> sm;
  sm.resize((g.sm_bytes + 15) / 16);
  for (int item = 0; item < p.items; ++item)
    for (int split = 0; split < splits; ++split) {
      // Shared memory as the GPU leaves it between launches: garbage (NaN bytes), so that a
      // read of anything no phase wrote shows in the result.
      std::memset(sm.data(), 0xFF, sm.size() * sizeof(am::Vec16));
      HostCta<am::AttendState<MaxRows>> cta(g.threads);
      am::AttendCta<MaxRows>(cta, p, g, reinterpret_cast<uint8_t*>(sm.data()), item, split, splits);
    }
  MergeAll(p, splits);
}

// The tensor-core program: its warps' products by warp_mma::HostWarp, lane by lane.
void RunTcGrid(const AttendParams& p, int splits) {
  const tc::TcGeometry tg = tc::MakeTcGeometry(p);
  thread_local std::vector<am::Vec16> sm;
  sm.resize((tg.sm_bytes + 15) / 16);
  for (int item = 0; item < p.items; ++item)
    for (int split = 0; split < splits; ++split) {
      std::memset(sm.data(), 0xFF, sm.size() * sizeof(am::Vec16));
      HostCta<tc::TcState> cta(tc::kThreads);
      tc::WithTilings(tg, [&](auto kj, auto vj) {
        tc::TcAttendCta<decltype(kj)::value, decltype(vj)::value>(
            cta, p, tg, reinterpret_cast<uint8_t*>(sm.data()), item, split, splits);
      });
    }
  MergeAll(p, splits);
}

}  // namespace

const char* AttendUnsupported(const AttendParams& p) {
  const int d = p.codec.head_dim;
  if (d < 32 || d > 256 || d % 32 != 0) return "head_dim: must be a multiple of 32 in [32, 256]";
  if (const char* why = BlockCodecUnsupported(p.codec)) return why;
  if (p.items < 1 || p.items > 65535) return "items: must be in [1, 65535]";
  if (p.rows < 1 || p.rows > kAttendMaxRows) return "rows: must be in [1, 16]";
  if (p.blocks < 0 || p.block_stride < p.blocks) return "blocks: must be in [0, block_stride]";
  if (p.masked_prefix < 0 || p.masked_prefix >= p.codec.key_group)
    return "masked_prefix: must be in [0, key_group)";
  if (p.splits < 0) return "splits: must be >= 0 (0: choose)";
  if (p.blocks > 0 && (!p.key_blocks || !p.value_blocks)) return "key_blocks, value_blocks: null";
  if (!p.q || (p.codec.rank > 0 && !p.uq)) return "q (and uq when rank > 0): null";
  if (!p.out || !p.out_max || !p.out_sum) return "out, out_max, out_sum: null";
  if (p.program < kAttendAuto || p.program > kAttendCudaCores)
    return "program: must be kAttendAuto, kAttendTensorCores or kAttendCudaCores";
  if (p.program == kAttendTensorCores) return tc::TcUnsupported(p);
  if (am::MakeGeometry(p).sm_bytes > 227 * 1024)
    return "rows x head_dim x key_group: the thread block's shared memory exceeds 227 KiB";
  return nullptr;
}

bool AttendOnTensorCores(const AttendParams& p) { return p.program == kAttendTensorCores; }

int AttendOnHost(const AttendParams& p) {
  if (AttendUnsupported(p) != nullptr) return 1;  // cudaErrorInvalidValue
  const int splits = p.splits > 0
                         ? std::max(1, std::min(p.splits, std::max(1, p.blocks)))
                         : am::SplitsToFill(p.items, p.blocks, int64_t{2} * kHostStandInSms);
  // The partials start as garbage too (NaN), as a device workspace would.
  thread_local std::vector<float> ws;
  ws.assign(static_cast<size_t>(p.items) * splits * p.rows * (p.codec.head_dim + 2), std::nanf(""));
  AttendParams hp = p;
  hp.workspace = ws.data();
  hp.workspace_bytes = 4 * ws.size();
  if (AttendOnTensorCores(hp)) {
    RunTcGrid(hp, splits);
    return 0;
  }
  const am::Geometry g = am::MakeGeometry(hp);
  if (p.rows <= 4) {
    RunGrid<4>(hp, g, splits);
  } else if (p.rows <= 8) {
    RunGrid<8>(hp, g, splits);
  } else {
    RunGrid<16>(hp, g, splits);
  }
  return 0;
}

}  // namespace kvq::kernels::cuda
