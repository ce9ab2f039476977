// CPU kernels for the retrieval signals. Free of Python: only raw pointers and c10 scalar types.
#include "signals_cpu.h"

#include "row_softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace fastrag {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Chunk of a logits row converted to float: one max per chunk means one rescale per chunk, not per element.
constexpr int64_t kChunk = 512;

template <typename T>
void token_signals_row(const T* x, int64_t V, float inv_t, int64_t chosen, float* entropy, float* logprob,
                       int64_t* argmax) {
  namespace rs = row_softmax;
  float buf[kChunk];
  // Online state over the row, all relative to the running max m of the scaled logits:
  //   s = sum e^{x-m},  u = sum (x-m) e^{x-m}.  Then H = log s - u / s  and  log p_c = x_c - m - log s.
  // When m grows to m', both rescale by r = e^{m-m'}:  s' = r s,  u' = r (u + (m-m') s).
  // Each chunk's sums are float (vectorised, row_softmax.h), folded into double accumulators.
  double m = -std::numeric_limits<double>::infinity();
  double s = 0.0, u = 0.0;
  float best = kNegInf;
  int64_t best_i = 0;
  bool bad = false;  // a NaN or +inf scaled logit: no distribution (max drops a NaN, so it is tracked apart)
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    float cmax, xmax;
    rs::scale_chunk(x + c0, n, inv_t, buf, &cmax, &xmax, &bad);
    if (xmax > best) {  // strict: ties keep the lowest index; NaN never wins
      best = xmax;
      best_i = c0 + rs::first_equal(x + c0, n, xmax);
    }
    if (cmax == kNegInf) continue;  // fully masked chunk
    if (cmax > m) {
      if (s > 0.0) {
        const double r = std::exp(m - cmax);
        u = r * (u + (m - cmax) * s);
        s *= r;
      }
      m = cmax;
    }
    float cs, cu;
    rs::exp_sums(buf, n, static_cast<float>(m), &cs, &cu);
    s += cs;
    u += cu;
  }
  if (bad) s = std::numeric_limits<double>::quiet_NaN();  // no distribution: NaN entropy and logprob
  const double log_s = std::log(s);
  *entropy = static_cast<float>(log_s - u / s);
  const int64_t c = chosen < 0 ? best_i : chosen;
  *logprob = static_cast<float>(static_cast<double>(static_cast<float>(x[c]) * inv_t) - m - log_s);
  *argmax = best_i;
}

}  // namespace

template <typename T>
void token_signals_cpu(const T* logits, const int64_t* chosen, int64_t B, int64_t V, float temperature,
                       float* entropy, float* logprob, int64_t* argmax) {
  const float inv_t = 1.0f / temperature;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    token_signals_row(logits + b * V, V, inv_t, chosen ? chosen[b] : -1, entropy + b, logprob + b, argmax + b);
  }
}

template void token_signals_cpu<float>(const float*, const int64_t*, int64_t, int64_t, float, float*, float*,
                                       int64_t*);
template void token_signals_cpu<c10::BFloat16>(const c10::BFloat16*, const int64_t*, int64_t, int64_t, float,
                                               float*, float*, int64_t*);
template void token_signals_cpu<c10::Half>(const c10::Half*, const int64_t*, int64_t, int64_t, float, float*,
                                           float*, int64_t*);

void causal_attn_colmax_cpu(const float* q, const float* k, const int64_t* lengths, int64_t B, int64_t H,
                            int64_t Hkv, int64_t T, int64_t D, float scale, float* out) {
  const int64_t group = H / Hkv;
  // colmax[b, h, i] = max_j A[h, j, i]; one slot per (b, h) so the parallel loop never shares writes.
  std::vector<float> colmax(static_cast<size_t>(B * H * T), 0.f);
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t n = lengths[b];
        const float* qb = q + ((b * H + h) * T) * D;
        const float* kb = k + ((b * Hkv + h / group) * T) * D;
        float* cm = colmax.data() + (b * H + h) * T;
        for (int64_t j = 0; j < n; ++j) {
          const float* qj = qb + j * D;
          float mx = kNegInf;
          for (int64_t i = 0; i <= j; ++i) {  // causal: keys i <= j
            const float* ki = kb + i * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qj[d] * ki[d];
            p[i] = dot * scale;
            mx = std::max(mx, p[i]);
          }
          float sum = 0.f;
          for (int64_t i = 0; i <= j; ++i) {
            p[i] = std::exp(p[i] - mx);
            sum += p[i];
          }
          const float inv = 1.f / sum;
          for (int64_t i = 0; i <= j; ++i) cm[i] = std::max(cm[i], p[i] * inv);
        }
      }
    }
  }
  const float inv_h = 1.f / static_cast<float>(H);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      float acc = 0.f;
      for (int64_t h = 0; h < H; ++h) acc += colmax[(b * H + h) * T + i];
      out[b * T + i] = acc * inv_h;  // padded columns (i >= n) stay 0: no row ever wrote them
    }
  }
}

}  // namespace fastrag
