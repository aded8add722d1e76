// Fuzzes the untrusted-run check (CheckEncodedGroups) and everything a run that passes it
// reaches: arbitrary bytes as a run of encoded groups (what PutBlocks' Append.encoded carries)
// for one KV head under one of five codecs like the quality frontier's (2-, 3- and 4-bit keys,
// groups of 32, 64 and 128, side codes of 4 and 8 bits, A^2 values with fp16 sinks and a window,
// dense-and-sparse lists, rotations). Input: byte 0 picks the codec, byte 1 the number of blocks
// k, then k little-endian u16 block sizes, then the blocks' bytes; any bytes after them are the
// sinks' rows (keys, then values, half each). With byte 0's top bit set, the harness first
// rewrites every block's checksum, so that mutations of a valid run reach the field checks and
// the reads behind them instead of stopping at the checksum.
//
// Checked: the check never crashes; a run it accepts is taken by a cache (AppendGroups), decodes
// to finite values (LayerCache::DecodeAs), decodes on its own to the same bytes (DecodeMessage,
// what a client does) and attends to finite outputs. A run that passes the check but breaks a read
// is a finding (abort).
//
// KVQ_FUZZ_ENCODED_SEEDS=DIR writes the committed seeds (fuzz/corpus/encoded_groups/: valid runs
// of one and two groups of every codec, made by the encoder) into DIR and exits.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/cache.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/format/block_format.h"
#include "xxhash.h"

namespace {

using kvq::core::CodecOptions;

constexpr int kDim = 64, kRank = 8, kCodecs = 5;

CodecOptions Codec(int pick) {
  CodecOptions o;
  o.head_dim = kDim;
  switch (pick % kCodecs) {
    case 0:  // the pre-frontier default: k2 g32 r4 s8, v2 in groups of 32
      o.key_bits = 2, o.key_group = 32, o.rank = 4, o.side_bits = 8;
      break;
    case 1:  // a calibrated B = 3 codec's shape: k3 g128 r4 s4
      o.key_bits = 3, o.key_group = 128, o.rank = 4, o.side_bits = 4;
      break;
    case 2:  // A^2 values with exact sinks and a window
      o.key_bits = 3, o.key_group = 64, o.rank = 8, o.side_bits = 4;
      o.value_policy = kvq::core::ValuePolicy::kA2;
      o.value_budget = 2.5f;
      o.fp16_sinks = 4;
      o.window = 16;
      break;
    case 3:  // dense-and-sparse, no side code
      o.key_bits = 2, o.key_group = 32, o.rank = 0;
      o.sparse_keys = o.sparse_values = 10;
      break;
    default:  // rotations, 4-bit keys, 3-bit values in groups of 16
      o.key_bits = 4, o.key_group = 32, o.rank = kRank, o.side_bits = 8;
      o.value_bits = 3, o.value_group = 16;
      o.rotate_keys = o.rotate_values = true;
      break;
  }
  return o;
}

// One KV head's basis: the first kRank unit vectors, spread over the channels.
const std::vector<float>& Basis() {
  static const std::vector<float> u = [] {
    std::vector<float> b(static_cast<size_t>(kDim) * kRank, 0.0f);
    for (int j = 0; j < kRank; ++j) b[static_cast<size_t>((j * 7) % kDim) * kRank + j] = 1.0f;
    return b;
  }();
  return u;
}

void Require(const absl::Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "fuzz_encoded_groups: a run that passed the check %s: %s\n", what,
               std::string(st.message()).c_str());
  std::abort();
}
void Require(bool ok, const char* what) {
  Require(ok ? absl::OkStatus() : absl::InternalError(""), what);
}

void WriteSeeds(const std::string& dir) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int pick = 0; pick < kCodecs; ++pick) {
    const CodecOptions o = Codec(pick);
    for (int groups = 1; groups <= 2; ++groups) {
      const int64_t n = static_cast<int64_t>(groups) * o.key_group + o.window;
      std::vector<float> k(static_cast<size_t>(n) * kDim), v(k.size());
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      kvq::core::LayerCache c(o, 1, Basis().data());
      auto view = [&](const std::vector<float>& x) {
        return kvq::core::TensorView::Contiguous(x.data(), kvq::core::DType::kF32, {1, n, kDim});
      };
      kvq::core::EncodedGroups run;
      if (!c.Append(view(k), view(v), 0).ok() ||
          !c.ExportGroups(0, c.encoded_tokens() / o.key_group, &run).ok()) {
        std::abort();
      }
      std::string bytes(1, static_cast<char>(pick | 0x80));
      bytes += static_cast<char>(run.sizes.size());
      for (uint32_t s : run.sizes)
        bytes += {static_cast<char>(s & 0xff), static_cast<char>(s >> 8)};
      bytes.append(reinterpret_cast<const char*>(run.bytes.data()), run.bytes.size());
      for (const auto* rows : {&run.sink_keys, &run.sink_values}) {
        bytes.append(reinterpret_cast<const char*>(rows->data()), rows->size() * 2);
      }
      std::ofstream(dir + "/codec" + std::to_string(pick) + "-groups" + std::to_string(groups),
                    std::ios::binary)
          << bytes;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (const char* dir = std::getenv("KVQ_FUZZ_ENCODED_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  if (size < 2) return 0;
  const CodecOptions o = Codec(data[0]);
  const size_t k = data[1];
  if (size < 2 + 2 * k) return 0;
  std::vector<uint32_t> sizes(k);
  size_t total = 0;
  for (size_t i = 0; i < k; ++i) {
    sizes[i] = data[2 + 2 * i] | (static_cast<uint32_t>(data[3 + 2 * i]) << 8);
    total += sizes[i];
  }
  const size_t at = 2 + 2 * k;
  const size_t block_bytes = std::min(total, size - at);
  std::vector<uint8_t> blocks(data + at, data + at + block_bytes);
  if ((data[0] & 0x80) != 0) {  // re-seal: every whole block's checksum made right
    size_t off = 0;
    for (uint32_t s : sizes) {
      if (s < kvq::format::kHeaderBytes || off + s > blocks.size()) break;
      uint8_t* b = blocks.data() + off;
      const uint64_t head = XXH3_64bits(b, kvq::format::kHashedHeaderBytes);
      const uint64_t payload =
          XXH3_64bits(b + kvq::format::kHeaderBytes, s - kvq::format::kHeaderBytes);
      kvq::format::StoreU32(b + kvq::format::kChecksumAt, kvq::format::MixChecksum(payload, head));
      off += s;
    }
  }
  const std::vector<uint8_t> rest(data + at + block_bytes, data + size);
  kvq::core::EncodedGroupsView run;
  run.groups = static_cast<int64_t>(k / 2);
  run.bytes = blocks;
  run.sizes = sizes;
  run.sink_keys = std::span<const uint8_t>(rest).first(rest.size() / 2);
  run.sink_values = std::span<const uint8_t>(rest).subspan(rest.size() / 2);
  if (!kvq::core::CheckEncodedGroups(o, 1, run, "enc").ok()) return 0;

  kvq::core::LayerCache cache(o, 1, Basis().data());
  Require(cache.AppendGroups(run), "was refused by a cache");
  const int64_t T = cache.tokens();
  if (T == 0) return 0;  // an empty run: nothing to read
  std::vector<uint8_t> kd, vd;
  Require(cache.DecodeAs(0, T, kvq::core::DType::kF32, &kd, &vd), "failed to decode");
  for (const auto* bytes : {&kd, &vd}) {
    const float* x = reinterpret_cast<const float*>(bytes->data());
    for (size_t i = 0; i < bytes->size() / 4; ++i)
      Require(std::isfinite(x[i]), "decoded to Inf/NaN");
  }
  std::vector<uint8_t> rk, rv;
  const float* u = cache.tables()->basis.empty() ? nullptr : cache.tables()->basis.data();
  Require(kvq::core::DecodeMessage(cache.options(), 1, u, run, nullptr, nullptr,
                                   kvq::core::DType::kF32, "encoded", &rk, &rv),
          "failed DecodeMessage");
  Require(rk == kd && rv == vd, "decoded otherwise on its own (DecodeMessage)");
  std::vector<float> q(2 * kDim, 0.1f), out(2 * kDim);
  kvq::core::AttendOptions ao;
  ao.observe = false;
  Require(cache.Attend(q.data(), 2, 1, ao, out.data()), "failed to attend");
  for (float x : out) Require(std::isfinite(x), "attended to Inf/NaN");
  return 0;
}
