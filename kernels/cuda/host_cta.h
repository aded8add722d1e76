// A CUDA thread block's program run on the CPU, for the host stand-in of the attend
// (kernels/src/attend_host.cc) and the tests of attend_math.h's and tc_attend_math.h's phases.
#pragma once

#include <vector>

#include "warp_mma.h"

namespace kvq::kernels::cuda {

// A thread block on the CPU: a phase runs for thread 0, 1, ... in turn, each with its own
// registers (the phases never read what another thread writes in the same phase).
template <class State>
struct HostCta {
  explicit HostCta(int threads) : state(threads) {}
  std::vector<State> state;
  template <class F>
  void Phase(F&& f) {
    for (int tid = 0; tid < static_cast<int>(state.size()); ++tid) f(tid, state[tid]);
  }
  // A phase of warp programs (f(warp, HostWarp&): all 32 lanes' fragments at once), warp 0,
  // 1, ... in turn.
  template <class F>
  void WarpPhase(F&& f) {
    warp_mma::HostWarp w;
    for (int warp = 0; warp < static_cast<int>(state.size()) / 32; ++warp) f(warp, w);
  }
};

}  // namespace kvq::kernels::cuda
