// A CUDA thread block's program run on the CPU, for the host stand-in of the attend
// (kernels/src/attend_host.cc) and the tests of attend_math.h's phases.
#pragma once

#include <vector>

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
};

}  // namespace kvq::kernels::cuda
