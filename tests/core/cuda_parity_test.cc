// CUDA kernels against the CPU reference (the ggml test-backend-ops habit). Skips, saying
// why, where no CUDA device answers (this machine and CI); runs on a GPU machine.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvq/kernels/device.h"
#include "kvq/kernels/kernels.h"

#ifdef KVQ_HAVE_CUDA
#include "kvq/kernels/cuda.h"
#endif

namespace kvq::kernels {
namespace {

TEST(CudaParity, ScoreCodes) {
#ifndef KVQ_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device on this machine";
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int bits : {1, 2, 3, 4, 8})
    for (int d : {64, 80, 128})
      for (int n_q : {1, 3, 8}) {
        const int tokens = 64;
        const size_t cb = static_cast<size_t>(tokens) * bits / 8 * d;
        std::vector<uint8_t> codes(cb);
        for (auto& c : codes) c = static_cast<uint8_t>(rng());
        std::vector<uint16_t> sc(d), ze(d);
        for (int c = 0; c < d; ++c) {
          sc[c] = static_cast<uint16_t>(0x2c00 + rng() % 0x800);
          ze[c] = static_cast<uint16_t>(0xb000 + rng() % 0x800);
        }
        std::vector<float> q(n_q * d), want(n_q * tokens), got(n_q * tokens);
        for (auto& x : q) x = nd(rng);
        Ref().score_codes(codes.data(), bits, d, tokens, sc.data(), ze.data(), q.data(), d, n_q,
                          0.125f, false, want.data(), tokens);
        std::string err;
        auto dev = [&](size_t n) { return Allocate(Pool::kGpu, n, &err); };
        void *dc = dev(cb), *ds = dev(2 * d), *dz = dev(2 * d), *dq = dev(4 * q.size()),
             *dout = dev(4 * got.size());
        ASSERT_TRUE(dc && ds && dz && dq && dout) << err;
        ASSERT_EQ(Copy(dc, Pool::kGpu, codes.data(), Pool::kHost, cb), 0);
        ASSERT_EQ(Copy(ds, Pool::kGpu, sc.data(), Pool::kHost, 2 * d), 0);
        ASSERT_EQ(Copy(dz, Pool::kGpu, ze.data(), Pool::kHost, 2 * d), 0);
        ASSERT_EQ(Copy(dq, Pool::kGpu, q.data(), Pool::kHost, 4 * q.size()), 0);
        ASSERT_EQ(
            cuda::ScoreCodes(static_cast<uint8_t*>(dc), bits, d, tokens, static_cast<uint16_t*>(ds),
                             static_cast<uint16_t*>(dz), static_cast<float*>(dq), d, n_q, 0.125f,
                             false, static_cast<float*>(dout), tokens, nullptr),
            0);
        ASSERT_EQ(Copy(got.data(), Pool::kHost, dout, Pool::kGpu, 4 * got.size()), 0);
        for (void* p : {dc, ds, dz, dq, dout}) Free(Pool::kGpu, p);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 1e-3f * (1 + std::fabs(want[i]))) << bits << " " << d;
      }
#endif
}

}  // namespace
}  // namespace kvq::kernels
