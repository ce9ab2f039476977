// exp_sums of row_softmax.h: one loop of exp_nonpos over a chunk, vectorised by the compiler.
#include "row_softmax.h"

namespace fastrag {
namespace row_softmax {

FASTRAG_CLONES  // (the clones sum in different orders: results differ in the last bits of a float32 sum)
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

FASTRAG_CLONES
float exp_keys(const float* y, int64_t n, float m, float* e, uint32_t* k) {
  float a = 0.f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < n; ++i) {
    const float d = y[i] - m;
    const float v = d >= kExpCut ? exp_nonpos(d) : 0.f;
    e[i] = v;
    k[i] = order_key(y[i]);
    a += v;
  }
  return a;
}

}  // namespace row_softmax
}  // namespace fastrag
