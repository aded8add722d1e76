// Flash-decoding: an Attend split into token parts (AttendOptions::parts) against the unsplit
// order, and MergePartials on its own against a softmax in double. Odd token counts, 1..7
// parts, causal masks, several codecs; fixed seeds.
//
// Tolerance: a split changes only the order of fp32 sums (each part's readout is a shorter
// sum of unnormalized weights, scaled once at the merge, as the unsplit order's one) and the
// exp shifts, so the outputs differ from the unsplit order by rounding: |split - unsplit| <=
// 2e-6 * max|v| per element (observed up to 5.8e-7 on these shapes, avx512 and ref tables).
// The int16 readout (avx512 table, 2- and 3-bit values) rounds a block's weights on the scale
// of its largest: a row whose visible tokens all lie in one part reads the same weights as
// the unsplit order (same bits); one whose tokens span parts, within 1e-5 * max|v|.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/partial_attention.h"
#include "kvq/core/worker_pool.h"
#include "test_util.h"

namespace kvq::core {
namespace {
using kvq::testing::Gaussian;
using kvq::testing::View3;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kSplitTolerance = 2e-6f;  // times max|v|
// The int16 readout (AVX512-VNNI, blocks of 2- or 3-bit values) where a row's visible tokens
// span parts (FewVisibleTokensAcrossPartsWithinTheReadoutsBound).
constexpr float kInt16SplitTolerance = 1e-5f;  // times max|v|

// Partials of rows of logits s [rows][T] over values v [T][d], token ranges cut at `cuts`
// (ascending, 0 .. T), each row seeing tokens [0, vis[r]).
struct Partials {
  std::vector<float> m, l, o;
};
Partials MakePartials(const std::vector<float>& s, const std::vector<float>& v,
                      const std::vector<int64_t>& vis, int64_t T, int d,
                      const std::vector<int64_t>& cuts) {
  const int64_t rows = static_cast<int64_t>(vis.size());
  const int P = static_cast<int>(cuts.size()) - 1;
  Partials p{std::vector<float>(P * rows), std::vector<float>(P * rows),
             std::vector<float>(P * rows * d, 0.0f)};
  for (int k = 0; k < P; ++k)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t1 = std::min(cuts[k + 1], vis[r]);
      float m = -kInf;
      for (int64_t t = cuts[k]; t < t1; ++t) m = std::max(m, s[r * T + t]);
      float l = 0.0f;
      for (int64_t t = cuts[k]; t < t1; ++t) {
        const float e = std::exp(s[r * T + t] - m);
        l += e;
        for (int c = 0; c < d; ++c) p.o[(k * rows + r) * d + c] += e * v[t * d + c];
      }
      p.m[k * rows + r] = m;
      p.l[k * rows + r] = l;
    }
  return p;
}

TEST(CacheMergePartials, EqualsSoftmaxInDouble) {
  const int d = 19, rows = 5;
  const int64_t T = 989;
  auto s = Gaussian(rows * T, 1, 3.0f);
  const auto v = Gaussian(T * d, 2);
  s[1 * T + 500] = 40.0f;  // one dominant token: the other parts' weights underflow
  // Row 2 sees only the first 7 tokens (later parts see none of it); row 4 none at all.
  const std::vector<int64_t> vis{T, T, 7, 300, 0};
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, T},
                                           {0, 1, T},
                                           {0, 100, 101, 500, 501, T},
                                           {0, 333, 666, T},
                                           {0, 0, 64, 64, T, T}}) {
    SCOPED_TRACE(::testing::Message() << cuts.size() - 1 << " parts");
    const Partials p = MakePartials(s, v, vis, T, d, cuts);
    std::vector<float> out(rows * d, -1.0f);
    MergePartials(p.m.data(), p.l.data(), p.o.data(), static_cast<int>(cuts.size()) - 1, rows, d,
                  out.data());
    for (int r = 0; r < rows; ++r) {
      double mx = -1e300, sum = 0;
      for (int64_t t = 0; t < vis[r]; ++t) mx = std::max<double>(mx, s[r * T + t]);
      for (int64_t t = 0; t < vis[r]; ++t) sum += std::exp(s[r * T + t] - mx);
      for (int c = 0; c < d; ++c) {
        double want = 0;
        for (int64_t t = 0; t < vis[r]; ++t)
          want += std::exp(s[r * T + t] - mx) / sum * v[t * d + c];
        ASSERT_NEAR(out[r * d + c], want, 2e-6) << "row " << r << " c " << c;
      }
    }
  }
}

TEST(CacheMergePartials, OnePartIsItsOwnNormalization) {
  const float m[] = {2.0f}, l[] = {4.0f}, o[] = {8.0f, -2.0f, 1.0f};
  float out[3];
  MergePartials(m, l, o, 1, 1, 3, out);
  EXPECT_EQ(out[0], 2.0f);
  EXPECT_EQ(out[1], -0.5f);
  EXPECT_EQ(out[2], 0.25f);
}

struct Case {
  const char* name;
  CodecOptions o;
  int64_t T;
  int kv, qh, nq;
  int64_t causal;  // -1: all tokens
};

CodecOptions Opt(int d, int kbits, int G, int rank, int vbits) {
  CodecOptions o;
  o.head_dim = d;
  o.key_bits = kbits;
  o.key_group = G;
  o.rank = rank;
  o.value_bits = vbits;
  return o;
}

std::vector<Case> Cases() {
  std::vector<Case> c;
  c.push_back({"k2 G32 r4 v2", Opt(64, 2, 32, 4, 2), 1001, 3, 9, 1, -1});
  c.push_back({"k3 G128 r0 v3", Opt(64, 3, 128, 0, 3), 1111, 2, 6, 1, -1});
  CodecOptions w = Opt(128, 2, 32, 4, 2);
  w.window = 40;
  c.push_back({"k2 G32 r4 window 40, causal", w, 989, 2, 8, 3, 900});
  CodecOptions a2 = Opt(64, 2, 32, 4, 2);
  a2.value_policy = ValuePolicy::kA2;
  a2.window = 16;
  c.push_back({"k2 G32 r4 A^2", a2, 777, 3, 9, 1, -1});
  CodecOptions sk = Opt(64, 3, 128, 4, 2);
  sk.fp16_sinks = 4;
  c.push_back({"k3 G128 r4 fp16 sinks", sk, 1279, 2, 4, 2, 1200});
  CodecOptions rot = Opt(64, 3, 32, 4, 2);
  rot.rotate_keys = rot.rotate_values = true;
  c.push_back({"k3 G32 r4 rotated keys and values", rot, 555, 1, 3, 1, -1});
  c.push_back({"k2 G32 r4, causal inside the first group", Opt(64, 2, 32, 4, 2), 301, 1, 2, 4, 20});
  return c;
}

// Runs the parts on threads of its own, one per part (as a worker pool would, any order).
const RunParts kThreads = [](int n, const std::function<void(int)>& task) {
  std::vector<std::thread> ts;
  for (int k = n - 1; k >= 0; --k) ts.emplace_back(task, k);
  for (auto& t : ts) t.join();
};

TEST(CacheAttendSplit, MatchesUnsplitWithinRoundingForEveryPartCount) {
  for (const Case& cs : Cases()) {
    SCOPED_TRACE(cs.name);
    const int d = cs.o.head_dim, kv = cs.kv;
    const ModelBasis b = RandomBasis({"t", 1, 1, kv, cs.qh, d, std::max(cs.o.rank, 1)}, 3);
    const auto k = Gaussian(kv * cs.T * d, 11), v = Gaussian(kv * cs.T * d, 12);
    float vmax = 0.0f;
    for (float x : v) vmax = std::max(vmax, std::fabs(x));
    LayerCache c(cs.o, kv, cs.o.rank > 0 ? b.u.data() : nullptr);
    ASSERT_TRUE(c.Append(View3(k, kv, cs.T, d), View3(v, kv, cs.T, d), 0).ok());
    const auto q = Gaussian(cs.qh * cs.nq * d, 13, 2.0f);
    AttendOptions ao;
    ao.causal_offset = cs.causal;
    ao.observe = false;
    std::vector<float> want(q.size());
    ASSERT_TRUE(c.Attend(q.data(), cs.qh, cs.nq, ao, want.data()).ok());
    for (int parts = 1; parts <= 7; ++parts) {
      SCOPED_TRACE(::testing::Message() << parts << " parts");
      ao.parts = parts;
      ao.run_parts = nullptr;
      std::vector<float> got(q.size()), threaded(q.size());
      ASSERT_TRUE(c.Attend(q.data(), cs.qh, cs.nq, ao, got.data()).ok());
      float worst = 0.0f;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      EXPECT_LE(worst, kSplitTolerance * vmax);
      if (parts == 1) {
        EXPECT_EQ(got, want);  // no split: the unsplit order itself
      }
      // The schedule never changes a bit: threads (parts in reverse order) equal the inline run.
      ao.run_parts = &kThreads;
      ASSERT_TRUE(c.Attend(q.data(), cs.qh, cs.nq, ao, threaded.data()).ok());
      EXPECT_EQ(threaded, got);
    }
  }
}

// A causal offset that leaves a query row only the first tokens of a long layer (a prefill's
// first rows over a 16k-token layer) puts every token it sees in the first part. The unsplit
// order reads out the same unnormalized weights as that part and divides by their sum as the
// merge does, so the int16 readout (2-bit values) rounds the same weights and the split answer
// is the unsplit one bit for bit. (The readout once took normalized weights, which round to
// int16 differently: up to 1.2e-5 * max|v| apart here.)
TEST(CacheAttendSplit, RowsSeeingOnlyTheFirstPartMatchUnsplitBitForBit) {
  const int d = 64, kv = 2, qh = 8, nq = 4;
  const int64_t T = 16384;
  const ModelBasis b = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 3);
  const auto k = Gaussian(kv * T * d, 11), v = Gaussian(kv * T * d, 12);
  const auto q = Gaussian(qh * nq * d, 13, 2.0f);
  float vmax = 0.0f;
  for (float x : v) vmax = std::max(vmax, std::fabs(x));
  for (const CodecOptions& o : {Opt(d, 2, 32, 4, 2), Opt(d, 3, 128, 4, 2)}) {
    SCOPED_TRACE(o.ToString());
    LayerCache c(o, kv, b.u.data());
    ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
    for (int64_t causal : {50, 100, 150, 200}) {
      AttendOptions ao;
      ao.causal_offset = causal;
      ao.observe = false;
      std::vector<float> want(q.size());
      ASSERT_TRUE(c.Attend(q.data(), qh, nq, ao, want.data()).ok());
      for (int parts = 2; parts <= 7; ++parts) {
        SCOPED_TRACE(::testing::Message() << "causal " << causal << ", " << parts << " parts");
        ao.parts = parts;
        std::vector<float> got(q.size());
        ASSERT_TRUE(c.Attend(q.data(), qh, nq, ao, got.data()).ok());
        int differ = 0;
        float worst = 0.0f;
        for (size_t i = 0; i < got.size(); ++i) {
          differ += got[i] != want[i];
          worst = std::max(worst, std::fabs(got[i] - want[i]));
        }
        EXPECT_EQ(differ, 0) << "of " << got.size() << " elements, up to " << worst / vmax
                             << " * max|v| apart";
      }
    }
  }
}

// Rows whose few visible tokens span two or more parts, with sharp softmaxes: the parts'
// weights are exp(s - m_k) against their own maxima, so on the int16 readout a weight can round
// to the neighbouring int16 step of its block (each such weight moves an output by at most
// 2^-14 * max|v| * the block's largest softmax weight). Within kSplitTolerance on the fp32
// readout, kInt16SplitTolerance on the int16 one (observed up to 4.6e-6 * max|v| over 5,760
// shapes like these; 2.4e-5 when the unsplit order read out normalized weights).
TEST(CacheAttendSplit, FewVisibleTokensAcrossPartsWithinTheReadoutsBound) {
  struct Shape {
    int kbits, G;
    int64_t T, causal;
    float q_scale;
  };
  const int d = 64, kv = 2, qh = 8, nq = 4;
  for (const Shape& sh : {Shape{3, 128, 700, 200, 6.0f}, Shape{2, 32, 700, 500, 3.0f},
                          Shape{2, 32, 300, 100, 2.0f}, Shape{2, 128, 2000, 500, 4.0f}}) {
    SCOPED_TRACE(::testing::Message()
                 << "k" << sh.kbits << " G" << sh.G << " T " << sh.T << " causal " << sh.causal);
    const ModelBasis b = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 3);
    const auto k = Gaussian(kv * sh.T * d, 11), v = Gaussian(kv * sh.T * d, 12);
    float vmax = 0.0f;
    for (float x : v) vmax = std::max(vmax, std::fabs(x));
    LayerCache c(Opt(d, sh.kbits, sh.G, 4, 2), kv, b.u.data());
    ASSERT_TRUE(c.Append(View3(k, kv, sh.T, d), View3(v, kv, sh.T, d), 0).ok());
    const auto q = Gaussian(qh * nq * d, 15, sh.q_scale);
    AttendOptions ao;
    ao.causal_offset = sh.causal;
    ao.observe = false;
    std::vector<float> want(q.size());
    ASSERT_TRUE(c.Attend(q.data(), qh, nq, ao, want.data()).ok());
    for (int parts = 2; parts <= 7; ++parts) {
      ao.parts = parts;
      std::vector<float> got(q.size());
      ASSERT_TRUE(c.Attend(q.data(), qh, nq, ao, got.data()).ok());
      float worst = 0.0f;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      EXPECT_LE(worst, kInt16SplitTolerance * vmax) << parts << " parts";
    }
  }
}

// ClaimingRunParts over an idle pool runs parts on both threads; over a busy one (its worker
// blocked until after the Attend) the caller runs them all and never waits on the queued
// helper, which later finds nothing to do. Same bits either way.
TEST(CacheAttendSplit, ClaimingRunPartsOverIdleAndBusyPools) {
  const int kv = 2, qh = 8, d = 64;
  const int64_t T = 32 * 40 + 7;
  CodecOptions o = Opt(d, 2, 32, 4, 2);
  const ModelBasis b = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 3);
  const auto k = Gaussian(kv * T * d, 1), v = Gaussian(kv * T * d, 2), q = Gaussian(qh * d, 3);
  LayerCache c(o, kv, b.u.data());
  ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  AttendOptions ao;
  ao.observe = false;
  ao.parts = 5;
  std::vector<float> inline_out(q.size()), idle(q.size()), busy(q.size());
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, inline_out.data()).ok());
  WorkerPool pool(1);
  const RunParts run = ClaimingRunParts(&pool, 1);
  ao.run_parts = &run;
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, idle.data()).ok());
  EXPECT_EQ(idle, inline_out);
  std::mutex gate;
  gate.lock();
  pool.Submit([&gate] { std::lock_guard<std::mutex> l(gate); });  // the worker is busy
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, busy.data()).ok());
  EXPECT_EQ(busy, inline_out);
  gate.unlock();  // the stale helper runs now and claims nothing
}

// split_min_tokens: a layer shorter than it runs the unsplit order (bit-identical, run_parts
// never called); at exactly that length it splits.
TEST(CacheAttendSplit, LayersBelowSplitMinTokensRunUnsplit) {
  const int kv = 2, qh = 4, d = 64;
  const int64_t T = 32 * 12 + 5;
  CodecOptions o = Opt(d, 2, 32, 0, 2);
  LayerCache c(o, kv, nullptr);
  const auto k = Gaussian(kv * T * d, 21), v = Gaussian(kv * T * d, 22), q = Gaussian(qh * d, 23);
  ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  AttendOptions ao;
  ao.observe = false;
  std::vector<float> unsplit(q.size()), out(q.size());
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, unsplit.data()).ok());
  int calls = 0;
  const RunParts counting = [&calls](int n, const std::function<void(int)>& task) {
    ++calls;
    for (int i = 0; i < n; ++i) task(i);
  };
  ao.parts = 3;
  ao.run_parts = &counting;
  ao.split_min_tokens = T + 1;
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, out.data()).ok());
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(out, unsplit);
  ao.split_min_tokens = T;
  ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, out.data()).ok());
  EXPECT_EQ(calls, 1);  // split (its results: MatchesUnsplitWithinRounding...)
}

// The server's policy: one part per idle worker plus the caller, capped; off at 0 tokens.
TEST(CacheAttendSplit, SplitPartsFollowIdleWorkers) {
  EXPECT_EQ(AttendSplitParts(8192, 0, 2), 1);  // none idle: no split
  EXPECT_EQ(AttendSplitParts(8192, 1, 2), 2);  // the other worker idle
  EXPECT_EQ(AttendSplitParts(0, 1, 2), 1);     // splitting off
  EXPECT_EQ(AttendSplitParts(8192, 7, 8), kMaxAttendParts);
  EXPECT_EQ(AttendSplitParts(8192, 5, 3), 3);  // never more than the pool's workers
  EXPECT_EQ(AttendSplitParts(8192, 2, 16), 3);
}

TEST(CacheAttendSplit, PartBoundsAreWholeGroupsAndDeterministic) {
  CodecOptions o = Opt(64, 2, 32, 0, 2);
  o.window = 8;
  LayerCache c(o, 1, nullptr);
  const int64_t T = 32 * 7 + 8 + 5;  // 7 groups encoded, 13 tokens in the window
  const auto k = Gaussian(T * 64, 1), v = Gaussian(T * 64, 2);
  ASSERT_TRUE(c.Append(View3(k, 1, T, 64), View3(v, 1, T, 64), 0).ok());
  ASSERT_EQ(c.Size().encoded_tokens, 224);
  EXPECT_EQ(c.AttendPartBounds(1), (std::vector<int64_t>{0, T}));
  EXPECT_EQ(c.AttendPartBounds(2), (std::vector<int64_t>{0, 96, T}));
  EXPECT_EQ(c.AttendPartBounds(3), (std::vector<int64_t>{0, 64, 128, T}));
  EXPECT_EQ(c.AttendPartBounds(7).size(), 8u);
  EXPECT_EQ(c.AttendPartBounds(100).size(), 8u);  // at most one part per encoded group
  EXPECT_EQ(c.AttendPartBounds(0), (std::vector<int64_t>{0, T}));
}

// An observing split Attend records the window's weights (the A^2 statistics) as the unsplit
// one does: the value widths of the next groups are chosen the same (and differ from those
// of a cache nobody attended to, checked when this test was written).
TEST(CacheAttendSplit, ObservingSplitAttendRecordsTheWindowLikeTheUnsplit) {
  CodecOptions o = Opt(64, 2, 32, 4, 2);
  o.value_policy = ValuePolicy::kA2;
  o.window = 64;
  const int kv = 2, qh = 4, d = 64;
  const ModelBasis b = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 3);
  const int64_t T = 32 * 9 + 64 + 7, more = 96;
  const auto k = Gaussian(kv * (T + more) * d, 21), v = Gaussian(kv * (T + more) * d, 22);
  auto part = [&](const std::vector<float>& x, int64_t from, int64_t n) {
    std::vector<float> out;
    for (int h = 0; h < kv; ++h)
      out.insert(out.end(), x.begin() + (h * (T + more) + from) * d,
                 x.begin() + (h * (T + more) + from + n) * d);
    return out;
  };
  const auto k0 = part(k, 0, T), v0 = part(v, 0, T), k1 = part(k, T, more), v1 = part(v, T, more);
  // Sharp queries: a few window tokens take most of the weight, so widths differ from uniform.
  const auto q = Gaussian(qh * d, 5, 4.0f), q3 = Gaussian(qh * 3 * d, 6, 4.0f);
  std::vector<std::vector<uint8_t>> blocks;
  for (int parts : {1, 3}) {
    LayerCache c(o, kv, b.u.data());
    ASSERT_TRUE(c.Append(View3(k0, kv, T, d), View3(v0, kv, T, d), 0).ok());
    AttendOptions ao;
    ao.parts = parts;
    std::vector<float> out(q3.size());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(c.Attend(q.data(), qh, 1, ao, out.data()).ok());
    // Three queries per head with a causal mask inside the window: rows see different spans.
    ao.causal_offset = T - 40;
    ASSERT_TRUE(c.Attend(q3.data(), qh, 3, ao, out.data()).ok());
    ASSERT_TRUE(c.Append(View3(k1, kv, more, d), View3(v1, kv, more, d), T).ok());
    for (int h = 0; h < kv; ++h)
      blocks.emplace_back(c.value_blocks(h).begin(), c.value_blocks(h).end());
  }
  EXPECT_EQ(blocks[0], blocks[2]);
  EXPECT_EQ(blocks[1], blocks[3]);
}

}  // namespace
}  // namespace kvq::core
