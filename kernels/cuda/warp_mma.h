// One warp's matrix product on the tensor cores, mma.sync m16n8k16 with bf16 operands and fp32
// accumulators (sm_80 and later), and its lane-by-lane emulation on the CPU, so that a program
// written against `Warp` runs on a GPU and in CI alike.
//
// A warp program keeps its fragments in arrays of Warp::kLanes lanes: on the GPU one lane (the
// thread's own registers, kLanes = 1), on the CPU all 32 of the warp (kLanes = 32), and
// Warp::Lane(l) is the lane index of entry l. Fragment layouts (PTX ISA, "Matrix fragments for
// mma.m16n8k16" with .bf16; g = lane / 4, t = lane % 4; each 32-bit register holds two bf16, the
// lower-indexed element in its low half):
//   A (16 x 16, row-major): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                           a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k x n):      b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   C (16 x 8, fp32):       c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]
// The emulation forms each product exactly (bf16 x bf16 fits a float) and sums in k order in
// fp32; the tensor cores sum in an order of their own, so the two agree to fp32 rounding.
#pragma once

#include <cstdint>

#include "kvq/format/block_format.h"

namespace kvq::kernels::cuda::warp_mma {

// The bf16 nearest to x (round to nearest even; x finite), as bits.
KVQ_HD uint32_t Bf16Bits(float x) {
  const uint32_t u = format::FloatBits(x);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
KVQ_HD float Bf16Value(uint32_t bits) { return format::BitsToFloat(bits << 16); }

// x as the sum of two bf16 (hi the nearest bf16, lo the nearest to the remainder): 16 of
// fp32's 24 significant bits, a relative error of at most 2^-17, with fp32's range.
KVQ_HD void SplitBf16(float x, uint16_t* hi, uint16_t* lo) {
  const uint32_t h = Bf16Bits(x);
  *hi = static_cast<uint16_t>(h);
  *lo = static_cast<uint16_t>(Bf16Bits(x - Bf16Value(h)));
}

// Two codes (integers in [0, 2^bits), bits <= 8) in the low and high halves of `halves` as a
// bf16 pair: exact. On the GPU for bits <= 7 without a conversion: 0x4300 | code is the bf16
// 128 + code, and one packed fma (x 1 - 128, exact) leaves the code (Marlin's magic-number
// dequantization).
KVQ_HD uint32_t CodePair(uint32_t halves, int bits) {
#ifdef __CUDA_ARCH__
  if (bits <= 7) {
    uint32_t out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
        : "=r"(out)
        : "r"(0x43004300u | halves), "r"(0x3F803F80u), "r"(0xC300C300u));
    return out;
  }
#endif
  (void)bits;
  return Bf16Bits(static_cast<float>(halves & 0xFFFFu)) |
         (Bf16Bits(static_cast<float>(halves >> 16)) << 16);
}

#ifdef __CUDACC__
// The GPU's warp: this thread's lane.
struct DeviceWarp {
  static constexpr int kLanes = 1;
  __device__ int Lane(int) const { return static_cast<int>(threadIdx.x & 31u); }
  // c += A B for this lane's fragments.
  __device__ void Mma(const uint32_t (&a)[1][4], const uint32_t (&b)[1][2], float (&c)[1][4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3])
        : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
#elif defined(__CUDA_ARCH__)
    __trap();  // the tensor-core attend is refused before launch below sm_80
#endif
  }
};
#endif

// The CPU's warp: all 32 lanes, the product formed from the fragment layouts above.
struct HostWarp {
  static constexpr int kLanes = 32;
  int Lane(int l) const { return l; }
  void Mma(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], float (&c)[32][4]) const {
    float A[16][16], B[16][8];
    auto lo = [](uint32_t r) { return Bf16Value(r & 0xFFFFu); };
    auto hi = [](uint32_t r) { return Bf16Value(r >> 16); };
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int h = 0; h < 2; ++h) {    // the k halves: a[0..1] then a[2..3]
        for (int r = 0; r < 2; ++r) {  // rows g, g + 8
          const uint32_t reg = a[l][2 * h + r];
          A[g + 8 * r][2 * t + 8 * h] = lo(reg);
          A[g + 8 * r][2 * t + 8 * h + 1] = hi(reg);
        }
        B[2 * t + 8 * h][g] = lo(b[l][h]);
        B[2 * t + 8 * h + 1][g] = hi(b[l][h]);
      }
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int e = 0; e < 4; ++e) {
        const int m = g + 8 * (e / 2), n = 2 * t + e % 2;
        float s = c[l][e];
        for (int k = 0; k < 16; ++k) s += A[m][k] * B[k][n];
        c[l][e] = s;
      }
    }
  }
};

}  // namespace kvq::kernels::cuda::warp_mma
