// exp_sums of row_softmax.h: one loop of exp_nonpos over a chunk, vectorised by the compiler.
#include "row_softmax.h"

// On x86-64 Linux with GCC or Clang the function is built three times, for AVX-512, AVX2 and the baseline SSE2,
// and the loader picks the widest the CPU runs (an ifunc). The clones sum in different orders (their vector
// widths), so their results differ in the last bits of a float32 sum.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FASTRAG_NO_TARGET_CLONES)
#define FASTRAG_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTRAG_TARGET_CLONES
#endif

namespace fastrag {
namespace row_softmax {

FASTRAG_TARGET_CLONES
void exp_sums(const float* y, int64_t n, float m, float* cs, float* cu) {
  float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const float d = y[i] - m;
    const float e = exp_nonpos(d);
    const bool live = d >= kExpCut;
    a += live ? e : 0.f;
    b += live ? d * e : 0.f;
  }
  *cs = a;
  *cu = b;
}

}  // namespace row_softmax
}  // namespace fastrag
