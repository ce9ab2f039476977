// The per-chunk pieces of a logits row's online softmax statistics on the CPU, written as plain loops the compiler
// vectorises (no -ffast-math, no intrinsics: the same code builds on any target; setup.py adds -fno-trapping-math,
// without which GCC keeps the selects below as branches). Used by token_signals_cpu (signals_cpu.cpp) and
// decode_signals_cpu (decode_cpu.cpp).
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

// A function built once per instruction set (AVX-512, AVX2, the baseline) on x86-64 Linux with GCC; the loader
// picks the widest the CPU runs (an ifunc). Elsewhere it is built once.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define FASTRAG_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTRAG_CLONES
#endif

namespace fastrag {
namespace row_softmax {

// Lanes of the partial maxima and sums: enough independent accumulators for a 16-float vector (AVX-512) or two
// 8-float ones (AVX2).
constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
// Below ln(FLT_MIN) e^d is no normal float32; there it counts as 0 (the terms weigh < 1e-38 of the row's sum,
// whose largest term is e^0 = 1).
constexpr float kExpCut = -87.33654f;

// e^d for d <= 0 in plain arithmetic, so that a simd loop over it vectorises (a libm call per element does not):
// Cody-Waite reduction d = n ln 2 + r with |r| <= ln(2) / 2, the Cephes single-precision polynomial for e^r (within
// 2 ulp), 2^n built in the exponent bits; rounding to n adds and subtracts 1.5 * 2^23. Below kExpCut (and for
// d = -inf) it gives about 2^-126, never a denormal: callers that need 0 there mask d < kExpCut (exp_sums); a NaN d
// gives NaN. Shared by the signal loops and the paged decode attention (paged_attn_cpu.cpp).
inline __attribute__((always_inline)) float exp_nonpos(float d) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  const float dc = d < kExpCut ? kExpCut : d;
  const float n = (dc * kLog2e + kRound) - kRound;  // round(dc / ln 2), in [-126, 0]
  const float r = (dc - n * kLn2Hi) - n * kLn2Lo;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A chunk of n entries of a logits row: y[i] = float(x[i]) * inv_t; *ymax = max y and *xmax = max float(x)
// (NaN ignored, -inf when none); *bad |= some y is NaN or +inf (the row then has no distribution).
template <typename T>
inline void scale_chunk(const T* x, int64_t n, float inv_t, float* y, float* ymax, float* xmax, bool* bad) {
  float ym[kLanes], xm[kLanes];
  int32_t nb[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    ym[l] = kNegInf;
    xm[l] = kNegInf;
    nb[l] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      const float s = v * inv_t;
      y[i + l] = s;
      xm[l] = v > xm[l] ? v : xm[l];  // (a NaN compares false: never taken)
      ym[l] = s > ym[l] ? s : ym[l];
      nb[l] |= static_cast<int32_t>(s != s) | static_cast<int32_t>(s == kPosInf);
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    const float s = v * inv_t;
    y[i] = s;
    xm[0] = v > xm[0] ? v : xm[0];
    ym[0] = s > ym[0] ? s : ym[0];
    nb[0] |= static_cast<int32_t>(s != s) | static_cast<int32_t>(s == kPosInf);
  }
  float a = kNegInf, b = kNegInf;
  int32_t any = 0;
  for (int l = 0; l < kLanes; ++l) {
    a = ym[l] > a ? ym[l] : a;
    b = xm[l] > b ? xm[l] : b;
    any |= nb[l];
  }
  *ymax = a;
  *xmax = b;
  *bad |= any != 0;
}

// Over the n entries of y: *cs = sum e^{y-m} and *cu = sum (y-m) e^{y-m}, entries with e^{y-m} below kExpCut
// (y = -inf among them: 0 ln 0 = 0) left out. m is the row's running max (m >= every y of the chunk).
// Defined in row_softmax.cpp (FASTRAG_CLONES).
void exp_sums(const float* y, int64_t n, float m, float* cs, float* cu);

// Order-preserving uint32 image of a float32: a < b  <=>  order_key(a) < order_key(b), and a == b  <=>  equal keys
// (NaN aside): -0.0 takes +0.0's key, so the two zeros are one tie group as in the reference.
inline __attribute__((always_inline)) uint32_t order_key(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits = bits == 0x80000000u ? 0u : bits;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Over the n entries of y: e[i] = e^{y[i]-m} (0 below kExpCut, y = -inf among them), k[i] = order_key(y[i]);
// returns sum e. m >= every y. The nucleus (top-p) pass of decode_signals_cpu; defined in row_softmax.cpp.
float exp_keys(const float* y, int64_t n, float m, float* e, uint32_t* k);

// The lowest i < n with float(x[i]) == v (v: a value of the chunk, as scale_chunk's maxima are), or -1.
template <typename T>
inline int64_t first_equal(const T* x, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<float>(x[i]) == v) return i;
  }
  return -1;
}

}  // namespace row_softmax
}  // namespace fastrag
