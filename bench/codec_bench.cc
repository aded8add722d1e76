// kvq-bench-codec: codec throughput against baselines measured in the same run.
//
//   EncodeKV     fp16 K+V in -> HeadQ blocks through LayerCache::Append (bytes_per_second of
//                fp16 input), next to Memcpy of the same bytes; EncodeKVk3g128 the
//                registry's default codec shape (3-bit keys in groups of 128, side code 4 bits).
//   AttendCodes  fused score + softmax + readout over 2-bit HeadQ codes (one decode query per
//                query head), AttendDense the same attention over fp16 K/V with the best SIMD
//                kernels, AttendRef the codec on the scalar reference kernels;
//                AttendCodesK3V3 the 4-bit-budget calibrated codecs (k3 G128 s8, v3 vg64).
//                AttendCodesK3G128RotK the lever codec (k3 G128 r4 s4 v2, rotated keys, metric
//                rounding) next to AttendCodesK3G128, the same codec without the levers.
//   AttendCodec  one row per codec setting of the quality frontier at 32k tokens (FrontierCodecs),
//                each attend row with its bytes-moved counters (SetByteCounters);
//                scripts/bench-attend-table.py sets them against AttendDense and StreamRead.
//   DecodeKV     LayerCache::DecodeAs fp16 of 4096 tokens (keys as attention sees them,
//                values: the bytes a GetBlocks of fp16 sends), bytes_per_second of fp16 K+V
//                written, next to Memcpy of those bytes (MemcpyReused: into one reused
//                destination, as DecodeKV's outputs are); DecodeKVF32 the fp32 Decode (twice
//                the bytes written, rated on the same fp16 bytes); DecodeKVRef DecodeKV on
//                the reference kernels.
//   AttendSplit  one request's Attend at 32k tokens: the unsplit order on one thread, 2 parts
//                on one thread (the split's own cost), 2 parts on two threads (flash-decoding);
//                StreamRead the memory-bandwidth baseline of the same run, one thread reading a
//                buffer beyond the LLC vs two threads reading half each. Wall-clock times
//                (UseRealTime: CPU time of the calling thread would hide the helper's).
// Every iteration touches a different cache (layer) of a set larger than the last-level cache,
// as in decode, where 30 layers of KV do not fit in cache. Single-threaded; rates and times
// are per CPU second (Google Benchmark's default), robust to preemption on a shared machine.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/half.h"
#include "kvq/core/worker_pool.h"
#include "kvq/kernels/kernels.h"

namespace {
using namespace kvq::core;
namespace kk = kvq::kernels;

constexpr size_t kWorkingSetBytes = size_t{96} << 20;  // > 32 MiB LLC, with margin

std::vector<uint16_t> RandomHalf(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> f(n);
  for (auto& x : f) x = nd(rng);
  std::vector<uint16_t> h(n);
  FloatToHalfN(f.data(), h.data(), n);
  return h;
}

// The same inputs for every row (and every call of a row's function: Google Benchmark calls
// it once per iteration-count trial and repetition), generated once: drawing 10^8 normals
// takes seconds on this machine, longer than measuring an attend.
const std::vector<uint16_t>& SharedRandomHalf(size_t n, uint32_t seed) {
  static std::map<std::pair<size_t, uint32_t>, std::vector<uint16_t>> made;
  auto it = made.find({n, seed});
  if (it == made.end()) it = made.emplace(std::pair{n, seed}, RandomHalf(n, seed)).first;
  return it->second;
}

CodecOptions HeadQOptions(int d, int group = 32) {
  CodecOptions o;
  o.head_dim = d;
  o.key_bits = 2;
  o.value_bits = 2;
  o.rank = 4;
  o.side_bits = 8;
  o.key_group = group;
  o.value_group = 32;
  return o;
}

ModelBasis Basis(int kv, int qh, int d, int r) {
  return RandomBasis({"bench", 1, 1, kv, qh, d, r}, 1);
}

// key_bits 0: HeadQOptions (k2 g32, rank 4 at 8 bits); else the registry's default codec shape
// with those key bits and group (rank 4 at 4 bits, v2 g32), what a client encodes by default.
void EncodeKV(benchmark::State& st, int kv, int d, int key_bits = 0, int key_group = 0) {
  const int T = 4096;
  const size_t per = static_cast<size_t>(kv) * T * d;
  const int layers = static_cast<int>(std::max<size_t>(2, kWorkingSetBytes / (per * 4) + 1));
  std::vector<std::vector<uint16_t>> k, v;
  for (int l = 0; l < layers; ++l) {
    k.push_back(RandomHalf(per, 2 * l));
    v.push_back(RandomHalf(per, 2 * l + 1));
  }
  CodecOptions o = HeadQOptions(d, key_group > 0 ? key_group : 32);
  if (key_bits > 0) {
    o.key_bits = key_bits;
    o.side_bits = 4;
  }
  const ModelBasis b = Basis(kv, kv, d, o.rank);
  int l = 0;
  for (auto _ : st) {
    LayerCache c(o, kv, b.u.data());
    auto s = c.Append(TensorView::Contiguous(k[l].data(), DType::kF16, {kv, T, d}),
                      TensorView::Contiguous(v[l].data(), DType::kF16, {kv, T, d}), 0);
    if (!s.ok()) st.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(c.Size().total_bytes());
    l = (l + 1) % layers;
  }
  st.SetBytesProcessed(st.iterations() * per * 4);
}

// Memcpy with DecodeKV's destination policy: the same fp16 bytes from a set beyond the LLC
// into one reused destination (Memcpy above writes a cold destination too).
void MemcpyReused(benchmark::State& st, int kv, int d) {
  const int T = 4096;
  const size_t per = static_cast<size_t>(kv) * T * d;
  const int layers = static_cast<int>(std::max<size_t>(2, kWorkingSetBytes / (per * 4) + 1));
  std::vector<std::vector<uint16_t>> src;
  for (int l = 0; l < layers; ++l) src.push_back(RandomHalf(2 * per, l));
  std::vector<uint16_t> dst(2 * per, 0);
  int l = 0;
  for (auto _ : st) {
    std::memcpy(dst.data(), src[l].data(), per * 4);
    benchmark::ClobberMemory();
    l = (l + 1) % layers;
  }
  st.SetBytesProcessed(st.iterations() * per * 4);
}

struct CodesSet {
  std::vector<std::unique_ptr<LayerCache>> caches;
  size_t bytes_each = 0;
};
CodesSet BuildCodes(int T, int qh, int kv, const CodecOptions& o);

// The output vectors are reused from call to call (as GetBlocks reuses its window's).
// dtype: kF16 (LayerCache::DecodeAs, what GetBlocks sends for fp16) or kF32 (Decode).
void DecodeKVImpl(benchmark::State& st, int kv, int d, DType dtype, bool reference) {
  const int T = 4096;
  CodesSet set = BuildCodes(T, kv, kv, HeadQOptions(d));
  std::vector<float> keys, values;
  std::vector<uint8_t> k16, v16;
  if (reference) kk::SetActive(&kk::Ref());
  size_t i = 0;
  for (auto _ : st) {
    auto s = dtype == DType::kF32 ? set.caches[i]->Decode(0, T, &keys, &values)
                                  : set.caches[i]->DecodeAs(0, T, dtype, &k16, &v16);
    if (!s.ok()) st.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(keys.data());
    benchmark::DoNotOptimize(k16.data());
    i = (i + 1) % set.caches.size();
  }
  kk::SetActive(nullptr);
  st.SetBytesProcessed(st.iterations() * static_cast<int64_t>(kv) * T * d * 4);
}
void DecodeKV(benchmark::State& st, int kv, int d) { DecodeKVImpl(st, kv, d, DType::kF16, false); }
void DecodeKVF32(benchmark::State& st, int kv, int d) {
  DecodeKVImpl(st, kv, d, DType::kF32, false);
}
void DecodeKVRef(benchmark::State& st, int kv, int d) {
  DecodeKVImpl(st, kv, d, DType::kF16, true);
}

void Memcpy(benchmark::State& st, int kv, int d) {
  const int T = 4096;
  const size_t per = static_cast<size_t>(kv) * T * d;
  const int layers = static_cast<int>(std::max<size_t>(2, kWorkingSetBytes / (per * 4) + 1));
  std::vector<std::vector<uint16_t>> src, dst;
  for (int l = 0; l < layers; ++l) {
    src.push_back(RandomHalf(2 * per, l));
    dst.emplace_back(2 * per, 0);
  }
  int l = 0;
  for (auto _ : st) {
    std::memcpy(dst[l].data(), src[l].data(), per * 4);
    benchmark::ClobberMemory();
    l = (l + 1) % layers;
  }
  st.SetBytesProcessed(st.iterations() * per * 4);
}

// The quality frontier's lever codec: k3 G128 r4 s4 v2 with rotated keys and metric
// rounding (rotated: false gives the same codec without the levers, to isolate their cost).
CodecOptions LeverOptions(int d, bool rotated) {
  CodecOptions o = HeadQOptions(d, 128);
  o.key_bits = 3;
  o.side_bits = 4;
  o.rotate_keys = rotated;
  o.metric_rounding = rotated;
  return o;
}

// One encoded cache, copied until the set exceeds the working-set size.
CodesSet BuildCodes(int T, int qh, int kv, const CodecOptions& o) {
  const int d = o.head_dim;
  const ModelBasis b = Basis(kv, qh, d, o.rank);
  const size_t per = static_cast<size_t>(kv) * T * d;
  const auto &k = SharedRandomHalf(per, 11), &v = SharedRandomHalf(per, 12);
  // Metric rounding's query moment (encoder only: it changes which codes are stored, not what
  // reading them costs): E[q q^T] = I + 1 1^T / d per head.
  std::vector<float> moment;
  if (o.metric_rounding) {
    moment.assign(static_cast<size_t>(kv) * d * d, 1.0f / d);
    for (int h = 0; h < kv; ++h)
      for (int c = 0; c < d; ++c) moment[(static_cast<size_t>(h) * d + c) * d + c] += 1.0f;
  }
  auto first = std::make_unique<LayerCache>(o, kv, b.u.data(), nullptr, nullptr,
                                            moment.empty() ? nullptr : moment.data());
  const absl::Status s =
      first->Append(TensorView::Contiguous(k.data(), DType::kF16, {kv, T, d}),
                    TensorView::Contiguous(v.data(), DType::kF16, {kv, T, d}), 0);
  if (!s.ok()) {  // a row over no codes would measure nothing
    std::fprintf(stderr, "kvq-bench-codec: encoding %s failed: %s\n", o.ToString().c_str(),
                 s.ToString().c_str());
    std::exit(1);
  }
  CodesSet set;
  set.bytes_each = first->Size().total_bytes();
  const size_t n = std::max<size_t>(2, kWorkingSetBytes / set.bytes_each + 1);
  set.caches.push_back(std::move(first));
  while (set.caches.size() < n) set.caches.push_back(std::make_unique<LayerCache>(*set.caches[0]));
  return set;
}

// fp16 bytes of a layer's K and V: what AttendDense reads per call.
double FpBytes(int T, int kv, int d) { return 4.0 * kv * T * d; }

// The bytes-moved view of an attend row (scripts/bench-attend-table.py turns it into a table
// against AttendDense and StreamRead of the same run): code_bytes read per call (every block,
// header and fp16 sink row of the layer), bits_per_elem of K and V together, and
// target_x_dense = 0.6 x (fp16 bytes / code bytes), the speed-up over fp16 attention that
// the attend goal asks of a codec reading that many bytes. GB/s of code bytes is bytes_per_second.
void SetByteCounters(benchmark::State& st, double code_bytes, double fp16_bytes) {
  st.counters["code_bytes"] = code_bytes;
  st.counters["bits_per_elem"] = 16.0 * code_bytes / fp16_bytes;
  st.counters["target_x_dense"] = 0.6 * fp16_bytes / code_bytes;
}

void AttendCodesWith(benchmark::State& st, int T, int qh, int kv, const CodecOptions& o,
                     bool reference, ReadPolicy read = {}) {
  const int d = o.head_dim;
  CodesSet set = BuildCodes(T, qh, kv, o);
  for (auto& c : set.caches) c->set_read_policy(read);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(qh) * d), out(q.size());
  for (auto& x : q) x = nd(rng);
  AttendOptions ao;
  ao.observe = false;
  if (reference) kk::SetActive(&kk::Ref());
  size_t i = 0;
  for (auto _ : st) {
    auto s = set.caches[i]->Attend(q.data(), qh, 1, ao, out.data());
    if (!s.ok()) st.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % set.caches.size();
  }
  kk::SetActive(nullptr);
  st.SetBytesProcessed(st.iterations() * set.bytes_each);
  st.SetItemsProcessed(st.iterations() * T);
  SetByteCounters(st, static_cast<double>(set.bytes_each), FpBytes(T, kv, d));
}

void AttendCodesImpl(benchmark::State& st, int T, int qh, int kv, int d, bool reference,
                     bool verify = true, int group = 32) {
  AttendCodesWith(st, T, qh, kv, HeadQOptions(d, group), reference,
                  ReadPolicy{.verify_checksums = verify});
}

void AttendCodes(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesImpl(st, T, qh, kv, d, false);
}
// The checksum trade-off: the same attend without verifying each block's XXH3 on read.
void AttendCodesNoVerify(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesImpl(st, T, qh, kv, d, false, false);
}
// HeadQ's trade: coarser key groups (G = 128) with the side code repairing the score error.
void AttendCodesG128(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesImpl(st, T, qh, kv, d, false, true, 128);
}
void AttendRef(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesImpl(st, T, qh, kv, d, true);
}
// The lever codec (rotated keys: the queries rotated once per attend), and the same codec
// unrotated beside it.
void AttendCodesK3G128RotK(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesWith(st, T, qh, kv, LeverOptions(d, true), false);
}
void AttendCodesK3G128(benchmark::State& st, int T, int qh, int kv, int d) {
  AttendCodesWith(st, T, qh, kv, LeverOptions(d, false), false);
}
// The calibrated 4-bit-budget codecs (headq-kv3-g128-vg64-*): 3-bit keys G = 128 with the
// 8-bit side code, 3-bit values in groups of 64 channels.
void AttendCodesK3V3(benchmark::State& st, int T, int qh, int kv, int d) {
  CodecOptions o = HeadQOptions(d, 128);
  o.key_bits = 3;
  o.value_bits = 3;
  o.value_group = 64;
  AttendCodesWith(st, T, qh, kv, o, false);
}

// The codec settings of the quality frontier (docs/RESULTS.md, "The quality frontier"; names
// as kvq-eval spells them, "a2b<B>": the A^2 per-token value widths at a budget of B bits).
// One lever at a time off the service's default (k3 G128 r4 s4 v2 g32), then the points the
// calibration chose and the other frontier rows. Metric rounding and the oblique pair are
// left out: they change which codes an encoder writes, not what reading them costs.
struct CodecRow {
  std::string name;
  CodecOptions o;
};
std::vector<CodecRow> FrontierCodecs(int d) {
  auto with = [d](int key_bits, int group, int rank, int side_bits, int value_bits,
                  int value_group) {
    return CodecOptions{.head_dim = d,
                        .key_bits = key_bits,
                        .key_group = group,
                        .rank = rank,
                        .side_bits = side_bits,
                        .value_bits = value_bits,
                        .value_group = value_group};
  };
  auto a2 = [](CodecOptions o, float budget) {
    o.value_policy = ValuePolicy::kA2;
    o.value_budget = budget;
    return o;
  };
  auto levers = [](CodecOptions o, bool rotk, int sinks) {
    o.rotate_keys = rotk;
    o.fp16_sinks = sinks;
    return o;
  };
  auto sparse = [](CodecOptions o, int keys, int values) {
    o.sparse_keys = keys;
    o.sparse_values = values;
    return o;
  };
  const CodecOptions base = with(3, 128, 4, 4, 2, 32);
  return {
      {"k3g128-r4s4-v2", base},  // the default codec
      {"k3g64-r4s4-v2", with(3, 64, 4, 4, 2, 32)},
      {"k3g32-r4s4-v2", with(3, 32, 4, 4, 2, 32)},
      {"k2g128-r4s4-v2", with(2, 128, 4, 4, 2, 32)},
      {"k4g128-r4s4-v2", with(4, 128, 4, 4, 2, 32)},
      {"k3g128-r4s8-v2", with(3, 128, 4, 8, 2, 32)},
      {"k3g128-r2s4-v2", with(3, 128, 2, 4, 2, 32)},
      {"k3g128-r2s8-v2", with(3, 128, 2, 8, 2, 32)},
      {"k3g128-r0-v2", with(3, 128, 0, 4, 2, 32)},
      {"k3g128-r4s4-v3", with(3, 128, 4, 4, 3, 32)},
      {"k3g128-r4s4-v2g64", with(3, 128, 4, 4, 2, 64)},
      {"k3g128-r4s4-a2b2", a2(base, 2.0f)},
      {"k3g128-r4s4-a2b3", a2(base, 3.0f)},
      {"k3g128-r4s4-v2-rotk", levers(base, true, 0)},
      {"k3g128-r4s4-v2-sink4", levers(base, false, 4)},
      // SmolLM2's and Qwen2.5's choices at 3 and 4 bits (kvq-calibrate --bits), the 2.4-bit
      // KIVI-like point, the 4.6-bit one, the A^2 rows and the legacy default.
      {"k2g128-r4s4-v2-rotk-sink4", levers(with(2, 128, 4, 4, 2, 32), true, 4)},
      {"k2g128-r4s8-v2g64-sink4", levers(with(2, 128, 4, 8, 2, 64), false, 4)},
      // ... with dense-and-sparse keys and values (5 per mille of each block: Qwen2.5's lever)
      {"k2g128-r4s8-v2g64-sink4-sk5-sv5",
       sparse(levers(with(2, 128, 4, 8, 2, 64), false, 4), 5, 5)},
      {"k3g128-r4s8-v3g64-rotk-sink4", levers(with(3, 128, 4, 8, 3, 64), true, 4)},
      {"k3g128-r4s8-v3g64", with(3, 128, 4, 8, 3, 64)},
      {"k2g128-r0-v2g64-rotk", levers(with(2, 128, 0, 4, 2, 64), true, 0)},
      {"k4g128-r0-v4-rotk", levers(with(4, 128, 0, 4, 4, 32), true, 0)},
      {"k2g128-r4s8-a2b2", a2(with(2, 128, 4, 8, 2, 32), 2.0f)},
      {"k2g32-r4s8-v2", HeadQOptions(d)},  // the legacy default (AttendCodes)
  };
}

void AttendCodec(benchmark::State& st, int T, int qh, int kv, const CodecOptions& o) {
  AttendCodesWith(st, T, qh, kv, o, false);
}

// Dense fp16 attention with the same structure: per KV head, scores of its query group,
// softmax, readout.
void AttendDense(benchmark::State& st, int T, int qh, int kv, int d) {
  const size_t per = static_cast<size_t>(kv) * T * d;
  const size_t n = std::max<size_t>(2, kWorkingSetBytes / (per * 4) + 1);
  std::vector<const std::vector<uint16_t>*> ks, vs;
  for (size_t l = 0; l < n; ++l) {
    ks.push_back(&SharedRandomHalf(per, 3 * l));
    vs.push_back(&SharedRandomHalf(per, 3 * l + 1));
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int gq = qh / kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> q(static_cast<size_t>(qh) * d), out(q.size()), s(static_cast<size_t>(gq) * T);
  for (auto& x : q) x = nd(rng) * scale;
  const kk::KernelTable& kt = kk::Best();
  size_t l = 0;
  for (auto _ : st) {
    for (int h = 0; h < kv; ++h) {
      const uint16_t* kh = ks[l]->data() + static_cast<size_t>(h) * T * d;
      const uint16_t* vh = vs[l]->data() + static_cast<size_t>(h) * T * d;
      kt.dense_scores_f16(kh, T, d, q.data() + static_cast<size_t>(h) * gq * d, gq, s.data(), T);
      for (int i = 0; i < gq; ++i) kt.softmax(s.data() + static_cast<size_t>(i) * T, T);
      float* o = out.data() + static_cast<size_t>(h) * gq * d;
      std::fill(o, o + static_cast<size_t>(gq) * d, 0.0f);
      kt.dense_readout_f16(vh, T, d, s.data(), T, gq, o, d);
    }
    benchmark::DoNotOptimize(out.data());
    l = (l + 1) % n;
  }
  st.SetBytesProcessed(st.iterations() * per * 4);
  st.SetItemsProcessed(st.iterations() * T);
  SetByteCounters(st, FpBytes(T, kv, d), FpBytes(T, kv, d));
}

// parts: AttendOptions::parts; threads: 1 (parts run on the caller) or 2 (the caller and one
// worker claiming parts: ClaimingRunParts); spin_us: the worker's poll before it sleeps
// (WorkerPool: waking a sleeping vCPU of this VM takes tens of microseconds, paid per request
// when the worker sleeps between layers).
void AttendSplit(benchmark::State& st, int T, int qh, int kv, int d, int parts, int threads,
                 int spin_us) {
  CodesSet set = BuildCodes(T, qh, kv, HeadQOptions(d));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(qh) * d), out(q.size());
  for (auto& x : q) x = nd(rng);
  WorkerPool worker(1, spin_us);
  const RunParts run = ClaimingRunParts(&worker, 1);
  AttendOptions ao;
  ao.observe = false;
  ao.parts = parts;
  ao.run_parts = threads > 1 ? &run : nullptr;
  size_t i = 0;
  for (auto _ : st) {
    auto s = set.caches[i]->Attend(q.data(), qh, 1, ao, out.data());
    if (!s.ok()) st.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % set.caches.size();
  }
  st.SetBytesProcessed(st.iterations() * set.bytes_each);
  st.SetItemsProcessed(st.iterations() * T);
}

// Reads 64 MiB (beyond the LLC share of this VM; a different half of a 256 MiB set each
// iteration) on 1 or 2 threads: the memory bandwidth one request can get from 1 or 2 cores.
void StreamRead(benchmark::State& st, int threads) {
  constexpr size_t kBytes = size_t{64} << 20, kSets = 4;
  std::vector<uint64_t> buf(kSets * kBytes / 8);
  for (size_t j = 0; j < buf.size(); ++j) buf[j] = j * 0x9e3779b97f4a7c15ull;
  WorkerPool worker(1);
  const RunParts run = ClaimingRunParts(&worker, 1);
  uint64_t sums[2] = {0, 0};
  size_t set = 0;
  for (auto _ : st) {
    const uint64_t* base = buf.data() + set * (kBytes / 8);
    const size_t per = kBytes / 8 / threads;
    auto part = [&](int k) {
      const uint64_t* p = base + k * per;
      uint64_t a = 0, b = 0, c = 0, e = 0;
      for (size_t j = 0; j < per; j += 4) {
        a += p[j];
        b += p[j + 1];
        c += p[j + 2];
        e += p[j + 3];
      }
      sums[k] = a + b + c + e;
    };
    if (threads > 1) {
      run(2, part);
    } else {
      part(0);
    }
    benchmark::DoNotOptimize(sums);
    set = (set + 1) % kSets;
  }
  st.SetBytesProcessed(st.iterations() * kBytes);
}

void RegisterAll() {
  for (auto [kv, d] : {std::pair{3, 64}, std::pair{8, 128}}) {
    const std::string shape = "/kv:" + std::to_string(kv) + "/d:" + std::to_string(d);
    benchmark::RegisterBenchmark(("EncodeKV" + shape).c_str(), EncodeKV, kv, d, 0, 0);
    benchmark::RegisterBenchmark(("EncodeKVk3g128" + shape).c_str(), EncodeKV, kv, d, 3, 128);
    benchmark::RegisterBenchmark(("Memcpy" + shape).c_str(), Memcpy, kv, d);
    benchmark::RegisterBenchmark(("MemcpyReused" + shape).c_str(), MemcpyReused, kv, d);
    benchmark::RegisterBenchmark(("DecodeKV" + shape).c_str(), DecodeKV, kv, d);
    benchmark::RegisterBenchmark(("DecodeKVF32" + shape).c_str(), DecodeKVF32, kv, d);
    benchmark::RegisterBenchmark(("DecodeKVRef" + shape).c_str(), DecodeKVRef, kv, d);
  }
  struct Shape {
    int qh, kv;
  };
  for (int threads : {1, 2})
    benchmark::RegisterBenchmark(("StreamRead/threads:" + std::to_string(threads)).c_str(),
                                 StreamRead, threads)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  for (auto [d, sh] : {std::pair{64, Shape{9, 3}}, std::pair{128, Shape{32, 8}}})
    for (auto [parts, threads, spin] :
         {std::tuple{1, 1, 0}, std::tuple{2, 1, 0}, std::tuple{2, 2, 0}, std::tuple{2, 2, 100}}) {
      const std::string name =
          "AttendSplit/T:32768/d:" + std::to_string(d) + "/q:" + std::to_string(sh.qh) +
          "/kv:" + std::to_string(sh.kv) + "/parts:" + std::to_string(parts) +
          "/threads:" + std::to_string(threads) + (spin ? "/spin_us:" + std::to_string(spin) : "");
      benchmark::RegisterBenchmark(name.c_str(), AttendSplit, 32768, sh.qh, sh.kv, d, parts,
                                   threads, spin)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  for (int T : {1024, 8192, 32768})
    for (int d : {64, 128})
      for (Shape sh : {Shape{9, 3}, Shape{32, 8}}) {
        const std::string name = "/T:" + std::to_string(T) + "/d:" + std::to_string(d) +
                                 "/q:" + std::to_string(sh.qh) + "/kv:" + std::to_string(sh.kv);
        benchmark::RegisterBenchmark(("AttendCodes" + name).c_str(), AttendCodes, T, sh.qh, sh.kv,
                                     d)
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("AttendDense" + name).c_str(), AttendDense, T, sh.qh, sh.kv,
                                     d)
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("AttendRef" + name).c_str(), AttendRef, T, sh.qh, sh.kv, d)
            ->Unit(benchmark::kMicrosecond);
        if (T == 32768) {
          benchmark::RegisterBenchmark(("AttendCodesNoVerify" + name).c_str(), AttendCodesNoVerify,
                                       T, sh.qh, sh.kv, d)
              ->Unit(benchmark::kMicrosecond);
          benchmark::RegisterBenchmark(("AttendCodesG128" + name).c_str(), AttendCodesG128, T,
                                       sh.qh, sh.kv, d)
              ->Unit(benchmark::kMicrosecond);
          benchmark::RegisterBenchmark(("AttendCodesK3G128" + name).c_str(), AttendCodesK3G128, T,
                                       sh.qh, sh.kv, d)
              ->Unit(benchmark::kMicrosecond);
          benchmark::RegisterBenchmark(("AttendCodesK3G128RotK" + name).c_str(),
                                       AttendCodesK3G128RotK, T, sh.qh, sh.kv, d)
              ->Unit(benchmark::kMicrosecond);
          benchmark::RegisterBenchmark(("AttendCodesK3V3" + name).c_str(), AttendCodesK3V3, T,
                                       sh.qh, sh.kv, d)
              ->Unit(benchmark::kMicrosecond);
        }
      }
  // The goal's shapes (the evaluation models' head_dim 64 with 9:3 heads, and 128 with 32:8):
  // one row per frontier codec beside AttendDense and StreamRead/threads:1 of the same run.
  for (auto [d, sh] : {std::pair{64, Shape{9, 3}}, std::pair{128, Shape{32, 8}}})
    for (const CodecRow& row : FrontierCodecs(d)) {
      const std::string name = "AttendCodec/" + row.name + "/T:32768/d:" + std::to_string(d) +
                               "/q:" + std::to_string(sh.qh) + "/kv:" + std::to_string(sh.kv);
      benchmark::RegisterBenchmark(name.c_str(), AttendCodec, 32768, sh.qh, sh.kv, row.o)
          ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("kernels", kk::Best().name);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
