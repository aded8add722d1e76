// kvq-bench-cuda: the fused decode attend on the GPU against two baselines measured in the
// same run, on the same bytes or the same tokens.
//
//   Attend/<codec>/d<d>/t<tokens>[/rows<n>]  one launch of kernels::cuda::Attend (its default
//       program, the CUDA-core one) over `items` KV heads
//       (independent sequences) of `tokens` tokens each, 4 query rows per KV head (GQA 4:1, as
//       Llama-3-8B; SmolLM2 has 3, Qwen2.5-0.5B 7; /rows<n>: n), items chosen so that the codes of
//       one launch are >= 1 GiB (far beyond the 60 MB L2: every byte comes from HBM). Time per
//       launch by CUDA events (manual time), attend and merge included. Counters:
//         attend_GBps    code bytes the attend reads (key + value blocks) / attend time
//         stream_GBps    the buffer holding them read by StreamRead (16-byte loads,
//                        XOR-reduced; at most 64 blocks more than the attend reads)
//         frac_of_stream attend_GBps / stream_GBps (the goal: >= 0.6)
//         dense_GBps     fp16 K+V bytes of the same tokens / DenseAttend time
//         dense_frac_of_stream  dense_GBps / stream_GBps: how close the baseline comes to
//                        the memory bandwidth (a fair fp16 decode kernel is near 1)
//         dense_speedup  DenseAttend time / attend time (same tokens, same rows)
//         attend_us, dense_us, stream_us  the three mean times per launch
//         tensor_us      the same launch on the tensor-core program (kAttendTensorCores),
//                        timed interleaved with the others
//         tensor_speedup attend_us / tensor_us; tensor_frac_of_stream, tensor_dense_speedup
//                        as frac_of_stream and dense_speedup for the tensor-core program
//   Encode/<codec>/d<d>  kernels::cuda::EncodeKeys then EncodeValues (cuda_codec.h) over
//       2^20 tokens (2^20 / G blocks) of fp32 keys and values already in device memory, each block
//       from its own rows and basis. Counters: encode_GBps (fp32 K and V bytes in / encode time),
//       stream_GBps (StreamRead of those fp32 bytes in the same run), frac_of_stream, and
//       blocks_per_s.
//   Decode/<codec>/d<d>  kernels::cuda::DecodeKeys then DecodeValues over the same blocks, back
//       to fp32 rows: decode_GBps (fp32 K and V bytes out / time), frac_of_stream against
//       StreamRead of as many fp32 bytes.
//   Verify/<codec>/d<d>  kernels::cuda::VerifyBlocks over the encoded blocks (one thread a
//       block): verify_GBps (block bytes / time) and its frac_of_stream against StreamRead of
//       the same bytes.
//   Codecs: k3g128-r4s4-v2 (the server's default, docs/CODEC.md), k2g32-r4s8-v2 (the legacy
//   default; G=32 is the frontier's most finely grouped point) and k2g128-r4s8-a2b2 (the
//   frontier's A^2 row: per-token value widths, each block's record offsets by a prefix sum).
// The blocks are real encodings (LayerCache, a random basis) of 64 distinct groups per head,
// tiled over the launch's working set; timing does not depend on the values.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/cuda_checksum.h"
#include "kvq/kernels/cuda_codec.h"
#include "kvq/kernels/device.h"

namespace {
using namespace kvq::core;
namespace kc = kvq::kernels::cuda;

constexpr size_t kLaunchBytes = size_t{1} << 30;  // codes per launch, >> 60 MB L2
constexpr int kRows = 4;                          // query rows per KV head (default)
constexpr int kUniqueBlocks = 64;                 // distinct encoded groups, tiled

CodecOptions Codec(int d, int kb, int G, int r, int sb, int vb, int vg) {
  CodecOptions o;
  o.head_dim = d;
  o.key_bits = kb;
  o.key_group = G;
  o.rank = r;
  o.side_bits = sb;
  o.value_bits = vb;
  o.value_group = vg;
  return o;
}

struct NamedCodec {
  const char* name;
  int kb, G, r, sb, vb, vg;
  float a2_budget;  // > 0: the A^2 policy (per-token value widths) at this budget
};
const NamedCodec kCodecs[] = {{"k3g128-r4s4-v2", 3, 128, 4, 4, 2, 32, 0.0f},
                              {"k2g32-r4s8-v2", 2, 32, 4, 8, 2, 32, 0.0f},
                              {"k2g128-r4s8-a2b2", 2, 128, 4, 8, 2, 32, 2.0f}};

// kUniqueBlocks (key, value) block pairs of one head, back to back: [key | value] per group
// (A^2 value blocks differ in size: each block's offsets).
struct Unit {
  std::vector<uint8_t> bytes;
  std::vector<size_t> key_at, value_at;
};
const Unit& UnitFor(const CodecOptions& o) {
  static std::map<std::string, Unit> units;
  Unit& u = units[o.ToString() + "/" + std::to_string(o.head_dim)];
  if (!u.bytes.empty()) return u;
  const int d = o.head_dim;
  const int64_t T = static_cast<int64_t>(kUniqueBlocks) * o.key_group;
  const ModelBasis b = RandomBasis({"t", 1, 1, 1, kRows, d, std::max(o.rank, 1)}, 3);
  LayerCache cache(o, 1, o.rank > 0 ? b.u.data() : nullptr);
  cache.set_sealing(true);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> k(T * d), v(T * d);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  const auto view = [&](const std::vector<float>& x) {
    return TensorView::Contiguous(x.data(), DType::kF32, {1, T, d});
  };
  if (!cache.Append(view(k), view(v), 0).ok()) return u;
  for (const auto& blk : cache.sealed()) {
    u.key_at.push_back(u.bytes.size());
    u.bytes.insert(u.bytes.end(), blk->key(0).begin(), blk->key(0).end());
    u.value_at.push_back(u.bytes.size());
    u.bytes.insert(u.bytes.end(), blk->value(0).begin(), blk->value(0).end());
  }
  u.key_at.push_back(u.bytes.size());  // the end of the last block
  if (u.value_at.size() != static_cast<size_t>(kUniqueBlocks)) u.bytes.clear();
  return u;
}

// Device memory released at scope exit.
struct Device {
  std::vector<void*> held;
  ~Device() {
    for (void* p : held) cudaFree(p);
  }
  template <class T>
  T* Alloc(size_t count) {
    void* p = nullptr;
    // + 16: the attend reads whole 16-byte words, the last one past the last block's end.
    if (cudaMalloc(&p, count * sizeof(T) + 16) != cudaSuccess) return nullptr;
    held.push_back(p);
    return static_cast<T*>(p);
  }
};

// Times one launch (a callable returning a cudaError_t value) by CUDA events on the default
// stream: seconds, or -1 when the launch failed.
class EventTimer {
 public:
  EventTimer() {
    cudaEventCreate(&e0_);
    cudaEventCreate(&e1_);
  }
  ~EventTimer() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
  }
  template <class Launch>
  float operator()(Launch&& launch) {
    cudaEventRecord(e0_);
    const int err = launch();
    cudaEventRecord(e1_);
    cudaEventSynchronize(e1_);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0_, e1_);
    return err == 0 ? ms / 1e3f : -1.0f;
  }

 private:
  cudaEvent_t e0_, e1_;
};

void BM_Attend(benchmark::State& state, NamedCodec nc, int d, int64_t tokens, int rows) {
  CodecOptions o = Codec(d, nc.kb, nc.G, nc.r, nc.sb, nc.vb, nc.vg);
  if (nc.a2_budget > 0) {
    o.value_policy = ValuePolicy::kA2;
    o.value_budget = nc.a2_budget;
  }
  const Unit& unit = UnitFor(o);
  if (unit.bytes.empty()) return state.SkipWithError("encoding the unit blocks failed");
  const int nb = static_cast<int>(tokens / o.key_group);
  // Block g of the launch (item g / nb, block g % nb) is the unit's block g % kUniqueBlocks in
  // copy g / kUniqueBlocks of the unit.
  const size_t unit_bytes = unit.bytes.size();
  const size_t item_bytes = unit_bytes * nb / kUniqueBlocks;
  const int items =
      static_cast<int>(std::min<size_t>(65535, (kLaunchBytes + item_bytes - 1) / item_bytes));
  const size_t blocks = static_cast<size_t>(items) * nb;
  const size_t code_bytes = (blocks + kUniqueBlocks - 1) / kUniqueBlocks * unit_bytes;
  size_t attended_bytes = 0;  // the blocks the attend reads (the last copy may be partial)
  for (size_t g = 0; g < blocks; ++g)
    attended_bytes += unit.key_at[g % kUniqueBlocks + 1] - unit.key_at[g % kUniqueBlocks];
  Device dev;
  uint8_t* codes = dev.Alloc<uint8_t>(code_bytes);
  if (!codes) return state.SkipWithError("cudaMalloc of the codes failed");
  // The unit uploaded once, then tiled device to device.
  if (cudaMemcpy(codes, unit.bytes.data(), unit.bytes.size(), cudaMemcpyHostToDevice) !=
      cudaSuccess)
    return state.SkipWithError("upload failed");
  for (size_t at = unit.bytes.size(); at < code_bytes;) {
    const size_t n = std::min(at, code_bytes - at);
    cudaMemcpy(codes + at, codes, n, cudaMemcpyDeviceToDevice);
    at += n;
  }
  std::vector<const uint8_t*> kp(static_cast<size_t>(items) * nb), vp(kp.size());
  for (size_t i = 0; i < kp.size(); ++i) {
    const uint8_t* copy = codes + i / kUniqueBlocks * unit_bytes;
    kp[i] = copy + unit.key_at[i % kUniqueBlocks];
    vp[i] = copy + unit.value_at[i % kUniqueBlocks];
  }
  auto** dkp = dev.Alloc<const uint8_t*>(kp.size());
  auto** dvp = dev.Alloc<const uint8_t*>(vp.size());
  const size_t R = static_cast<size_t>(items) * rows;
  std::vector<float> q(R * d), uq(R * std::max(o.rank, 1));
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  for (auto& x : uq) x = nd(rng);
  float *dq = dev.Alloc<float>(q.size()), *duq = dev.Alloc<float>(uq.size());
  float *dout = dev.Alloc<float>(R * d), *dmx = dev.Alloc<float>(R), *dsum = dev.Alloc<float>(R);
  uint32_t* sink = dev.Alloc<uint32_t>(1);
  if (!dkp || !dvp || !dq || !duq || !dout || !dmx || !dsum || !sink)
    return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dkp, kp.data(), kp.size() * sizeof(kp[0]), cudaMemcpyHostToDevice);
  cudaMemcpy(dvp, vp.data(), vp.size() * sizeof(vp[0]), cudaMemcpyHostToDevice);
  cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(duq, uq.data(), uq.size() * 4, cudaMemcpyHostToDevice);

  kc::AttendParams p;
  p.codec = BlockCodecOf(o);
  p.items = items;
  p.rows = rows;
  p.blocks = nb;
  p.key_blocks = dkp;
  p.value_blocks = dvp;
  p.block_stride = nb;
  p.q = dq;
  p.uq = duq;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.out = dout;
  p.out_max = dmx;
  p.out_sum = dsum;
  // Split counts fixed once, so that the timed launches make no occupancy queries.
  p.splits = kc::AttendSplits(p);
  p.workspace_bytes = kc::AttendWorkspaceBytes(p);
  p.workspace = dev.Alloc<uint8_t>(p.workspace_bytes);

  // Dense fp16 K and V of the same tokens (constant values: the time does not depend on them).
  kc::DenseAttendParams dp;
  dp.head_dim = d;
  dp.items = items;
  dp.rows = rows;
  dp.tokens = static_cast<int64_t>(nb) * o.key_group;
  const size_t kv_elems = static_cast<size_t>(items) * dp.tokens * d;
  uint16_t* dk = dev.Alloc<uint16_t>(kv_elems);
  uint16_t* dv = dev.Alloc<uint16_t>(kv_elems);
  if (!p.workspace || !dk || !dv) return state.SkipWithError("cudaMalloc (dense) failed");
  cudaMemset(dk, 0x3c, kv_elems * 2);  // 0x3c3c: 1.06 in fp16
  cudaMemset(dv, 0x3c, kv_elems * 2);
  dp.k = dk;
  dp.v = dv;
  dp.q = dq;
  dp.scale = p.scale;
  dp.out = dout;
  dp.splits = kc::DenseAttendSplits(dp);
  dp.workspace_bytes = kc::DenseAttendWorkspaceBytes(dp);
  dp.workspace = dev.Alloc<uint8_t>(dp.workspace_bytes);
  if (!dp.workspace) return state.SkipWithError("cudaMalloc (dense workspace) failed");

  // The same launch on the tensor-core program where it runs (at most 8 rows; the default is the
  // CUDA-core one): its own split count and workspace.
  kc::AttendParams pc = p;
  pc.program = kc::kAttendTensorCores;
  const bool tensor = kc::AttendUnsupported(pc) == nullptr;
  if (!tensor) pc.program = kc::kAttendCudaCores;
  pc.splits = 0;
  pc.splits = kc::AttendSplits(pc);
  pc.workspace_bytes = kc::AttendWorkspaceBytes(pc);
  pc.workspace = dev.Alloc<uint8_t>(pc.workspace_bytes);
  if (!pc.workspace) return state.SkipWithError("cudaMalloc (workspace) failed");

  EventTimer timed;
  auto attend = [&] { return kc::Attend(p, nullptr); };
  auto attend_tc = [&] { return kc::Attend(pc, nullptr); };
  auto stream = [&] { return kc::StreamRead(codes, code_bytes, sink, nullptr); };
  auto dense = [&] { return kc::DenseAttend(dp, nullptr); };
  for (int w = 0; w < 2; ++w)
    if (timed(attend) < 0 || timed(attend_tc) < 0 || timed(stream) < 0 || timed(dense) < 0)
      return state.SkipWithError(cudaGetErrorString(cudaGetLastError()));
  double attend_s = 0, tc_s = 0, stream_s = 0, dense_s = 0;
  for (auto _ : state) {
    const float a = timed(attend);
    if (a < 0) return state.SkipWithError("Attend failed");
    state.SetIterationTime(a);
    attend_s += a;
    tc_s += timed(attend_tc);
    stream_s += timed(stream);
    dense_s += timed(dense);
  }
  if (cudaDeviceSynchronize() != cudaSuccess)
    return state.SkipWithError(cudaGetErrorString(cudaGetLastError()));
  // A launch that ran but produced garbage would time nothing real: every row's softmax sum must
  // be positive and finite.
  std::vector<float> sums(R);
  cudaMemcpy(sums.data(), dsum, R * 4, cudaMemcpyDeviceToHost);
  for (float x : sums)
    if (!(x > 0.0f && std::isfinite(x))) return state.SkipWithError("attend sums not finite");
  const double n = static_cast<double>(state.iterations());
  const double dense_bytes = 2.0 * kv_elems * 2;
  state.counters["items"] = items;
  state.counters["splits"] = p.splits;
  state.counters["code_MB"] = code_bytes / 1e6;
  const double attend_rate = attended_bytes / (attend_s / n),
               stream_rate = code_bytes / (stream_s / n);
  state.counters["attend_GBps"] = attend_rate / 1e9;
  state.counters["stream_GBps"] = stream_rate / 1e9;
  state.counters["frac_of_stream"] = attend_rate / stream_rate;
  const double dense_rate = dense_bytes / (dense_s / n);
  state.counters["dense_GBps"] = dense_rate / 1e9;
  state.counters["dense_frac_of_stream"] = dense_rate / stream_rate;
  state.counters["dense_speedup"] = dense_s / attend_s;
  if (tensor) {
    state.counters["tensor_us"] = tc_s / n * 1e6;
    state.counters["tensor_speedup"] = attend_s / tc_s;
    state.counters["tensor_frac_of_stream"] = attended_bytes / (tc_s / n) / stream_rate;
    state.counters["tensor_dense_speedup"] = dense_s / tc_s;
  }
  state.counters["attend_us"] = attend_s / n * 1e6;
  state.counters["dense_us"] = dense_s / n * 1e6;
  state.counters["stream_us"] = stream_s / n * 1e6;
}

// Tokens per encode launch: 256-512 MiB of fp32 keys and values in at d 64-128, far beyond L2.
constexpr size_t kEncodeTokens = size_t{1} << 20;

// The block codec's fields for a named codec (uniform value widths: the A^2 widths come from
// the policy, which stays on the CPU).
kc::BlockCodec BlockCodecOf(const NamedCodec& nc, int d) {
  return kvq::core::BlockCodecOf(Codec(d, nc.kb, nc.G, nc.r, nc.sb, nc.vb, nc.vg));
}

// Encodes 2^20 / G key and value blocks on the device (and, for the Verify benchmark,
// verifies them): time per launch pair by CUDA events.
enum class CodecOp { kEncode, kDecode, kVerify };

void BM_CodecOp(benchmark::State& state, NamedCodec nc, int d, CodecOp op) {
  const bool verify = op == CodecOp::kVerify, decode = op == CodecOp::kDecode;
  const kc::BlockCodec c = BlockCodecOf(nc, d);
  if (const char* why = kc::BlockCodecUnsupported(c)) return state.SkipWithError(why);
  const size_t G = c.key_group, n = kEncodeTokens / G, r = std::max(c.rank, 1);
  const size_t rows = n * G * d, kb = kc::KeyBlockSize(c), vb = kc::ValueBlockSize(c);
  Device dev;
  float* keys = dev.Alloc<float>(rows);
  float* values = dev.Alloc<float>(rows);
  float* basis = dev.Alloc<float>(r * d);
  uint8_t* blocks = dev.Alloc<uint8_t>(n * (kb + vb));
  uint32_t* sink = dev.Alloc<uint32_t>(1);
  if (!keys || !values || !basis || !blocks || !sink)
    return state.SkipWithError("cudaMalloc failed");
  // Values spread over [-2, 2) by a cheap generator (the time does not depend on them).
  std::vector<float> host(rows);
  uint32_t state_bits = 12345;
  for (auto& x : host) {
    state_bits = state_bits * 1664525u + 1013904223u;
    x = static_cast<float>(state_bits >> 8) * (4.0f / 16777216.0f) - 2.0f;
  }
  cudaMemcpy(keys, host.data(), rows * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(values, host.data(), rows * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(basis, host.data(), r * d * 4, cudaMemcpyHostToDevice);
  std::vector<const float*> kp(n), vp(n), bp(n, basis);
  std::vector<uint8_t*> ko(n), vo(n);
  std::vector<uint64_t> sizes(2 * n);
  std::vector<const uint8_t*> all(2 * n);
  for (size_t b = 0; b < n; ++b) {
    kp[b] = keys + b * G * d;
    vp[b] = values + b * G * d;
    ko[b] = blocks + b * (kb + vb);
    vo[b] = ko[b] + kb;
    all[2 * b] = ko[b];
    all[2 * b + 1] = vo[b];
    sizes[2 * b] = kb;
    sizes[2 * b + 1] = vb;
  }
  auto up = [&](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    T* p = dev.Alloc<T>(v.size());
    if (p) cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
  };
  kc::EncodeKeyParams ek;
  ek.codec = c;
  ek.blocks = static_cast<int>(n);
  ek.keys = up(kp);
  ek.ld = d;
  ek.basis_t = up(bp);
  ek.out = up(ko);
  ek.workspace_bytes = kc::EncodeKeyWorkspaceBytes(ek);
  ek.workspace = dev.Alloc<uint8_t>(ek.workspace_bytes);
  kc::EncodeValueParams ev;
  ev.codec = c;
  ev.blocks = static_cast<int>(n);
  ev.values = up(vp);
  ev.ld = d;
  ev.out = up(vo);
  kc::VerifyParams vf;
  vf.blocks = static_cast<int>(2 * n);
  vf.block_ptrs = up(all);
  vf.sizes = up(sizes);
  vf.verdicts = dev.Alloc<uint8_t>(2 * n);
  // Decode writes the rows back over the keys and values it was encoded from.
  std::vector<const uint8_t*> kin(ko.begin(), ko.end()), vin(vo.begin(), vo.end());
  std::vector<float*> kdst(n), vdst(n);
  for (size_t b = 0; b < n; ++b) {
    kdst[b] = keys + b * G * d;
    vdst[b] = values + b * G * d;
  }
  kc::DecodeKeyParams dk;
  dk.codec = c;
  dk.blocks = static_cast<int>(n);
  dk.in = up(kin);
  dk.basis = up(bp);
  dk.out = up(kdst);
  dk.ld = d;
  kc::DecodeValueParams dv;
  dv.codec = c;
  dv.blocks = static_cast<int>(n);
  dv.in = up(vin);
  dv.out = up(vdst);
  dv.ld = d;
  if (!ek.keys || !ek.basis_t || !ek.out || !ek.workspace || !ev.values || !ev.out ||
      !vf.block_ptrs || !vf.sizes || !vf.verdicts || !dk.in || !dk.basis || !dk.out || !dv.in ||
      !dv.out)
    return state.SkipWithError("cudaMalloc failed");
  EventTimer timed;
  auto encode = [&] {
    const int e = kc::EncodeKeys(ek, nullptr);
    return e != 0 ? e : kc::EncodeValues(ev, nullptr);
  };
  auto check = [&] { return kc::VerifyBlocks(vf, nullptr); };
  auto decode_all = [&] {
    const int e = kc::DecodeKeys(dk, nullptr);
    return e != 0 ? e : kc::DecodeValues(dv, nullptr);
  };
  // The baseline reads what the op reads: the fp32 rows (encode) or the blocks (verify); for
  // decode, what it writes (the fp32 rows, the larger side).
  auto stream = [&] {
    if (verify) return kc::StreamRead(blocks, n * (kb + vb) / 16 * 16, sink, nullptr);
    const int e = kc::StreamRead(keys, rows * 4, sink, nullptr);
    return e != 0 ? e : kc::StreamRead(values, rows * 4, sink, nullptr);
  };
  if (timed(encode) < 0) return state.SkipWithError("encode failed");
  auto run = [&] { return verify ? check() : decode ? decode_all() : encode(); };
  for (int w = 0; w < 2; ++w)
    if (timed(run) < 0 || timed(stream) < 0)
      return state.SkipWithError(cudaGetErrorString(cudaGetLastError()));
  double op_s = 0, stream_s = 0;
  for (auto _ : state) {
    const float t = timed(run);
    if (t < 0) return state.SkipWithError("launch failed");
    state.SetIterationTime(t);
    op_s += t;
    stream_s += timed(stream);
  }
  // Encoded blocks that do not verify would time garbage.
  std::vector<uint8_t> verdicts(2 * n, 0xFF);
  if (kc::VerifyBlocks(vf, nullptr) != 0 ||
      cudaMemcpy(verdicts.data(), vf.verdicts, 2 * n, cudaMemcpyDeviceToHost) != cudaSuccess)
    return state.SkipWithError("verify failed");
  for (uint8_t v : verdicts)
    if (v != kc::kVerifyOk) return state.SkipWithError("an encoded block fails its checksum");
  const double iters = static_cast<double>(state.iterations());
  const double in_bytes = verify ? static_cast<double>(n * (kb + vb)) : 2.0 * rows * 4;
  state.counters[verify   ? "verify_GBps"
                 : decode ? "decode_GBps"
                          : "encode_GBps"] = in_bytes / (op_s / iters) / 1e9;
  state.counters["stream_GBps"] = in_bytes / (stream_s / iters) / 1e9;
  state.counters["frac_of_stream"] = stream_s / op_s;
  state.counters["blocks_per_s"] = 2.0 * n / (op_s / iters);
}

void RegisterAll() {
  for (const NamedCodec& nc : kCodecs) {
    if (nc.a2_budget > 0) continue;  // the A^2 widths are chosen on the CPU
    for (int d : {64, 128})
      for (CodecOp op : {CodecOp::kEncode, CodecOp::kDecode, CodecOp::kVerify}) {
        const char* what = op == CodecOp::kEncode   ? "Encode/"
                           : op == CodecOp::kDecode ? "Decode/"
                                                    : "Verify/";
        const std::string name = std::string(what) + nc.name + "/d" + std::to_string(d);
        benchmark::RegisterBenchmark(name.c_str(), BM_CodecOp, nc, d, op)
            ->UseManualTime()
            ->Iterations(10)
            ->Unit(benchmark::kMicrosecond);
      }
  }
  for (const NamedCodec& nc : kCodecs)
    for (int d : {64, 128})
      for (int64_t tokens : {4096, 32768, 131072})
        for (int rows : {1, 4, 8}) {
          // GQA 1:1 and 8:1 for the default codec at d 128 only.
          if (rows != kRows && (&nc != &kCodecs[0] || d != 128 || tokens == 4096)) continue;
          const std::string name = std::string("Attend/") + nc.name + "/d" + std::to_string(d) +
                                   "/t" + std::to_string(tokens) +
                                   (rows != kRows ? "/rows" + std::to_string(rows) : "");
          benchmark::RegisterBenchmark(name.c_str(), BM_Attend, nc, d, tokens, rows)
              ->UseManualTime()
              ->Iterations(20)
              ->Unit(benchmark::kMicrosecond);
        }
}

}  // namespace

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    listing = listing || std::strncmp(argv[i], "--benchmark_list_tests", 22) == 0;
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "kvq-bench-cuda: the fused decode attend over HeadQ codes on the GPU, against a\n"
          "streaming read of the same bytes and dense fp16 attention over the same tokens;\n"
          "block encode and checksum verification against a streaming read of their inputs\n"
          "(bench/cuda_bench.cc says what each counter means). Needs a CUDA device.\n"
          "Google Benchmark flags, e.g. --benchmark_filter=REGEX, --benchmark_format=json,\n"
          "--benchmark_out=FILE.\n");
      return 0;
    }
  }
  RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (!listing && !kvq::kernels::CudaAvailable()) {
    std::string why;
    kvq::kernels::BestPool(&why);
    std::fprintf(stderr, "kvq-bench-cuda: needs a CUDA device: %s\n", why.c_str());
    return 1;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    benchmark::AddCustomContext("device", prop.name);
    benchmark::AddCustomContext("sm_count", std::to_string(prop.multiProcessorCount));
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
