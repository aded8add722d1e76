// The block codec ops on the CPU: codec_math.h's launches run in order, each as a loop over
// its whole grid (the threads of a launch never read each other's writes, so any order gives
// the GPU's result); and the sizes and checks shared with the CUDA launchers.
#include <cmath>
#include <vector>

#include "../cuda/codec_math.h"
#include "kvq/kernels/cuda_codec.h"

namespace kvq::kernels::cuda {
namespace cm = codec_math;

namespace {

// Runs each step as two loops over (outer, inner).
struct HostRun {
  template <auto F, class P>
  void Step(const P& p, int outer, int inner) {
    for (int o = 0; o < outer; ++o)
      for (int i = 0; i < inner; ++i) F(p, o, i);
  }
};

// A workspace as the GPU's would start: garbage (NaN), so that a read of anything no step
// wrote shows in the result.
void* Garbage(size_t bytes) {
  thread_local std::vector<float> ws;
  ws.assign((bytes + 3) / 4, std::nanf(""));
  return ws.data();
}

}  // namespace

const char* BlockCodecUnsupported(const BlockCodec& c) { return cm::CodecReason(c); }

size_t KeyBlockSize(const BlockCodec& c) {
  return static_cast<size_t>(format::MakeKeyLayout(c).bytes);
}
size_t ValueBlockSize(const BlockCodec& c) {
  return static_cast<size_t>(format::MaxValueBlockBytes(c));
}
size_t EncodeKeyWorkspaceBytes(const EncodeKeyParams& p) {
  return 4 * static_cast<size_t>(p.blocks) * cm::KeyWorkFloats(p.codec);
}
size_t EncodeValueWorkspaceBytes(const EncodeValueParams& p) {
  return 4 * static_cast<size_t>(p.blocks) * cm::ValueWorkFloats(p.codec);
}

int EncodeKeysOnHost(const EncodeKeyParams& p) {
  EncodeKeyParams hp = p;
  hp.workspace_bytes = EncodeKeyWorkspaceBytes(p);
  hp.workspace = Garbage(hp.workspace_bytes);
  if (cm::Reason(hp) != nullptr) return 1;  // cudaErrorInvalidValue
  HostRun run;
  cm::EncodeKeySteps(hp, run);
  return 0;
}

int EncodeValuesOnHost(const EncodeValueParams& p) {
  EncodeValueParams hp = p;
  hp.workspace_bytes = EncodeValueWorkspaceBytes(p);
  hp.workspace = Garbage(hp.workspace_bytes);
  if (cm::Reason(hp) != nullptr) return 1;
  HostRun run;
  cm::EncodeValueSteps(hp, run);
  return 0;
}

int DecodeKeysOnHost(const DecodeKeyParams& p) {
  if (cm::Reason(p) != nullptr) return 1;
  HostRun run;
  cm::DecodeKeySteps(p, run);
  return 0;
}

int DecodeValuesOnHost(const DecodeValueParams& p) {
  if (cm::Reason(p) != nullptr) return 1;
  HostRun run;
  cm::DecodeValueSteps(p, run);
  return 0;
}

int ScoreBlocksOnHost(const ScoreBlocksParams& p) {
  if (cm::Reason(p) != nullptr) return 1;
  HostRun run;
  cm::ScoreSteps(p, run);
  return 0;
}

int ReadoutBlocksOnHost(const ReadoutBlocksParams& p) {
  if (cm::Reason(p) != nullptr) return 1;
  HostRun run;
  cm::ReadoutSteps(p, run);
  return 0;
}

}  // namespace kvq::kernels::cuda
