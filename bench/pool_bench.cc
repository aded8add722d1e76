// kvq-bench-pool: what the block memory pool costs on the write path, host memory (the
// default, operator new) against the slab pool that pinned memory uses (SlabBytePool, here
// on host slabs: the same code path minus the driver call per slab), in the same run.
//
//   Prefill  a 4096-token sequence per iteration appended in 256-token chunks (3 KV heads x
//            64 dims, fp16 in, HeadQ rank 4), then dropped: bytes_per_second of fp16 input.
//   Decode   one-token appends to a growing sequence of 1k, 4k and 32k tokens (vector growth by
//            whole groups: the rate must not fall with the length).
//   Churn    64 sequences of 1024 tokens written and dropped per iteration from 2 threads:
//            the pool's lock and free lists under contention.
// Run: build/bin/kvq-bench-pool [--benchmark_min_time=1.0]; report the slab / host ratio of
// each pair.
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/core/byte_pool.h"
#include "kvq/core/cache.h"
#include "kvq/core/half.h"

namespace {
using namespace kvq::core;

constexpr int kKv = 3, kD = 64, kT = 4096, kLong = 32768;

CodecOptions Options() {
  CodecOptions o;
  o.head_dim = kD;
  o.rank = 4;
  o.window = 32;
  return o;
}

const std::vector<uint16_t>& Input() {
  static const std::vector<uint16_t> h = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<float> f(static_cast<size_t>(kKv) * kLong * kD);
    for (auto& x : f) x = nd(rng);
    std::vector<uint16_t> out(f.size());
    FloatToHalfN(f.data(), out.data(), f.size());
    return out;
  }();
  return h;
}

const std::vector<float>& Basis() {
  static const std::vector<float> b = [] {
    BasisManifest m;
    m.model = "bench";
    m.layers = 1;
    m.kv_heads = kKv;
    m.q_heads = 3 * kKv;
    m.head_dim = kD;
    m.rank = 4;
    return RandomBasis(m, 1).u;
  }();
  return b;
}

BytePool* PoolOf(int which) {
  static SlabBytePool slabs(kvq::kernels::Pool::kHost);
  return which == 0 ? HostBytePool() : &slabs;
}

void Fill(LayerCache* c, int64_t tokens, int64_t chunk) {
  const auto& in = Input();
  for (int64_t at = 0; at < tokens; at += chunk) {
    const int64_t n = std::min(chunk, tokens - at);
    TensorView k = TensorView::Contiguous(in.data() + at * kD, DType::kF16, {kKv, n, kD});
    k.stride[0] = static_cast<int64_t>(kLong) * kD;
    if (!c->Append(k, k, at).ok()) std::abort();
  }
}

void Prefill(benchmark::State& st) {
  BytePool* pool = PoolOf(static_cast<int>(st.range(0)));
  double held = 0, requested = 0, stored = 0;
  for (auto _ : st) {
    LayerCache c(Options(), kKv, Basis().data(), pool);
    Fill(&c, kT, 256);
    benchmark::DoNotOptimize(c.tokens());
    const BytePool::Usage u = pool->usage();
    held = static_cast<double>(u.held_bytes);
    requested = static_cast<double>(u.requested_bytes);
    stored = static_cast<double>(c.Size().key_block_bytes + c.Size().value_block_bytes);
  }
  st.SetBytesProcessed(st.iterations() * int64_t{2} * kKv * kT * kD * 2);
  // Memory per block byte of the last sequence: vector slack and size-class rounding.
  st.counters["requested/stored"] = requested / stored;
  st.counters["held/stored"] = held / stored;
  st.SetLabel(st.range(0) == 0 ? "host" : "slab");
}

void Decode(benchmark::State& st) {
  BytePool* pool = PoolOf(static_cast<int>(st.range(0)));
  const int64_t tokens = st.range(1);
  for (auto _ : st) {
    LayerCache c(Options(), kKv, Basis().data(), pool);
    Fill(&c, tokens, 1);
    benchmark::DoNotOptimize(c.tokens());
  }
  st.SetItemsProcessed(st.iterations() * tokens);
  st.SetLabel(st.range(0) == 0 ? "host" : "slab");
}

void Churn(benchmark::State& st) {
  BytePool* pool = PoolOf(static_cast<int>(st.range(0)));
  for (auto _ : st) {
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&] {
        for (int s = 0; s < 32; ++s) {
          LayerCache c(Options(), kKv, Basis().data(), pool);
          Fill(&c, 1024, 128);
          benchmark::DoNotOptimize(c.tokens());
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  st.SetItemsProcessed(st.iterations() * 64);
  st.SetLabel(st.range(0) == 0 ? "host" : "slab");
}

BENCHMARK(Prefill)->ArgName("slab")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(Decode)
    ->ArgNames({"slab", "tokens"})
    ->Args({0, 1024})
    ->Args({1, 1024})
    ->Args({0, kT})
    ->Args({1, kT})
    ->Args({0, kLong})
    ->Args({1, kLong})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(Churn)->ArgName("slab")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
