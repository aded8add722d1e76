// Fuzzes the block parsers and every reader behind them: arbitrary bytes as a key or value
// block of one of a few codecs (dense-and-sparse lists or not), with and without checksum
// verification. A parse must fail
// cleanly or give a view that decode, score and readout can read within the block's bytes.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/core/codec.h"

namespace {

kvq::core::CodecOptions Codec(uint8_t pick) {
  kvq::core::CodecOptions o;
  // 33: value records of odd size (4 * groups + ceil(33 * bits / 8)), fp16 fields at odd
  // addresses (a misaligned-load finding of the first run, fixed with unaligned copies).
  o.head_dim = (pick & 128) ? 33 : (pick & 1) ? 64 : 32;
  o.key_bits = (pick & 2) ? 3 : 2;
  o.key_group = (pick & 4) ? 128 : 32;
  o.rank = (pick & 8) ? 4 : 0;
  o.side_bits = (pick & 16) ? 4 : 8;
  o.value_bits = (pick & 32) ? 3 : 2;
  o.value_policy = (pick & 64) ? kvq::core::ValuePolicy::kA2 : kvq::core::ValuePolicy::kUniform;
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  kvq::core::CodecOptions o = Codec(data[0]);
  const bool verify = (size & 1) != 0;
  // Dense-and-sparse lists (positions the parser must bound when it does not verify). Bit 2
  // of the size, not bit 1: key blocks are a multiple of 4 bytes, so an input of a key block's
  // size (+1 for the pick) has bit 1 clear, and bit 2 set for half the codecs' sizes.
  if ((size & 4) != 0) o.sparse_keys = o.sparse_values = 10;
  // An aligned copy: blocks start at even offsets in the store's vectors (every block has an
  // even size), and the key readers take their fp16 fields through uint16_t pointers.
  const std::vector<uint8_t> bytes(data + 1, data + size);
  const std::span<const uint8_t> block(bytes.data(), bytes.size());
  const int d = o.head_dim, G = o.key_group, r = o.rank;
  std::vector<float> out(static_cast<size_t>(G) * d), q(2 * d, 0.5f), uq(2 * 4, 0.25f),
      basis(static_cast<size_t>(d) * 4, 0.1f), scores(2 * G), p(2 * G, 0.01f), ro(2 * d);
  if (auto k = kvq::core::ParseKeyBlock(block, o, verify); k.ok()) {
    kvq::core::DecodeKeyBlock(*k, r > 0 ? basis.data() : nullptr, out.data());
    kvq::core::ScoreKeyBlock(*k, q.data(), r > 0 ? uq.data() : nullptr, 2, 0.125f, scores.data(),
                             G);
  }
  if (auto v = kvq::core::ParseValueBlock(block, o, verify); v.ok()) {
    kvq::core::DecodeValueBlock(*v, out.data());
    kvq::core::ReadoutValueBlock(*v, p.data(), G, 2, ro.data(), d);
  }
  (void)kvq::core::VerifyBlock(block);
  return 0;
}
