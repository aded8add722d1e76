// Batched verification of encoded blocks' checksums (core/include/kvq/core/codec.h layout):
// a store holding blocks in device memory checks them where they lie (a scrub, a read with
// ReadPolicy::verify_checksums) without copying them to the host. Each block's verdict is what
// core's ParseKeyBlock / ParseValueBlock would answer about its magic, version, size and checksum
// (kernels/cuda/xxh3_math.h computes the checksum exactly as core does). The header includes
// no CUDA header, so that host code and the CPU tests can name the params.
#pragma once

#include <cstdint>

namespace kvq::kernels::cuda {

// Verdicts, one byte per block.
inline constexpr uint8_t kVerifyOk = 0;
// The stored checksum (header bytes 12..15) differs from the one the bytes give.
inline constexpr uint8_t kVerifyChecksum = 1;
// Not a block: shorter than the 16-byte header, another magic, a version this build does not
// read (kvq/format/block_format.h), or a null pointer. The checksum is not computed.
inline constexpr uint8_t kVerifyBadHeader = 2;

struct VerifyParams {
  int blocks = 0;  // >= 0
  // [blocks] pointers to the blocks (any byte address), their sizes in bytes (header
  // included) and the verdicts written, one per block. VerifyBlocks: device arrays, device
  // pointers; VerifyBlocksOnHost: all in host memory.
  const uint8_t* const* block_ptrs = nullptr;
  const uint64_t* sizes = nullptr;
  uint8_t* verdicts = nullptr;
};

// Whether the params can be run: blocks >= 0 and, when blocks > 0, every array given.
inline bool VerifyParamsValid(const VerifyParams& p) {
  return p.blocks >= 0 && (p.blocks == 0 || (p.block_ptrs != nullptr && p.sizes != nullptr &&
                                             p.verdicts != nullptr));
}

// Launches the verification on `stream` (a cudaStream_t as void*, null: the default stream),
// one thread per block; returns a cudaError_t value (0 on success, cudaErrorInvalidValue (1)
// when !VerifyParamsValid). The verdicts are written when the stream reaches the kernel.
// Defined in CUDA builds (KVQ_HAVE_CUDA) only.
int VerifyBlocks(const VerifyParams& p, void* stream);

// VerifyBlocks with the arrays (block_ptrs, sizes, verdicts) in host memory and the blocks
// where a store keeps them (device memory, or pinned host memory): copies the arrays to device
// scratch held per calling thread, launches on cudaStreamPerThread, copies the verdicts back
// and waits. kErrorNoDevice (cuda.h) without a CUDA build or device; every build.
int VerifyBlocksFromHost(const VerifyParams& p);

// The same on the CPU, every pointer in host memory: the very per-block function the kernel
// runs, for each block in turn. Every build; 1 when !VerifyParamsValid, else 0.
int VerifyBlocksOnHost(const VerifyParams& p);

}  // namespace kvq::kernels::cuda
