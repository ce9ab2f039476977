// C++ CPU kernels of the fused decode-step signals and the attention statistics added for issue 3
// (definitions: fastrag/signals/reference.py). Raw pointers only; checks live in glue_cpu.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "row_softmax.h"
#include "sampling.h"
#include "signals_cpu.h"

namespace fastrag {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunk = 512;

// One row: online softmax state relative to the running max m (s = sum e^{y-m}, u = sum (y-m) e^{y-m}), folded
// per chunk in double; best score and its lowest index. Then H = ln s - u/s, ln p_c = y_c - m - ln s.
template <typename T>
void decode_row(const T* x, int64_t V, float inv_t, bool sample, uint32_t key, int64_t chosen, const uint8_t* nonstop,
                int64_t* out_c, float* ent, float* lp, float* prob, uint8_t* flag) {
  namespace rs = row_softmax;
  float buf[kChunk];
  double m = -std::numeric_limits<double>::infinity(), s = 0.0, u = 0.0;
  float best = kNegInf;
  int64_t best_i = -1;
  bool bad = false;  // a NaN or +inf scaled logit: no distribution (max drops a NaN, so it is tracked apart)
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    float cmax, xmax;
    rs::scale_chunk(x + c0, n, inv_t, buf, &cmax, &xmax, &bad);
    if (sample) {
      for (int64_t i = 0; i < n; ++i) {
        const float score = buf[i] - std::log(-std::log(sampling_uniform(key, static_cast<uint32_t>(c0 + i))));
        if (score > best || best_i < 0) {  // strict: ties keep the lowest index; NaN never wins
          best = score;
          best_i = c0 + i;
        }
      }
    } else {
      if (best_i < 0) {  // the first entry is taken whatever it is (a NaN there is never beaten)
        best = buf[0];
        best_i = 0;
      }
      if (cmax > best) {  // strict: ties keep the lowest index
        best = cmax;
        best_i = c0 + rs::first_equal(buf, n, cmax);
      }
    }
    if (cmax == kNegInf) continue;
    if (cmax > m) {
      if (s > 0.0) {
        const double r = std::exp(m - cmax);
        u = r * (u + (m - cmax) * s);
        s *= r;
      }
      m = cmax;
    }
    float cs, cu;
    rs::exp_sums(buf, n, static_cast<float>(m), &cs, &cu);  // (0 ln 0 = 0 for y = -inf)
    s += cs;
    u += cu;
  }
  const int64_t c = chosen >= 0 ? chosen : best_i;
  if (bad) s = std::numeric_limits<double>::quiet_NaN();  // no distribution: NaN entropy and logprob
  const double log_s = std::log(s);
  const double l = static_cast<double>(static_cast<float>(x[c]) * inv_t) - m - log_s;
  *out_c = c;
  *ent = static_cast<float>(log_s - u / s);
  *lp = static_cast<float>(l);
  *prob = static_cast<float>(std::exp(l));
  if (flag) *flag = nonstop[c];
}

// Order-preserving uint32 image of a float32: a < b  <=>  order_key(a) < order_key(b), and a == b  <=>  equal keys
// (NaN aside): -0.0 takes +0.0's key, so the two zeros are one tie group as in the reference.
inline uint32_t order_key(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  if (bits == 0x80000000u) bits = 0u;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// One row with nucleus (top-p) filtering of p = softmax(y), y = x * inv_t (reference top_p_nucleus_ref): the
// nucleus is {v : order_key(y_v) >= K0} with K0 = min{K : sum_{order_key(y_u) > K} e^{y_u - m} < top_p * s}, found
// by a radix select over the 32 key bits, 4 at a time: each level histograms the mass of the keys that share the
// prefix chosen so far by their next digit and keeps the smallest digit whose strictly-larger mass stays below
// the target. The global max is always in the nucleus, so the nucleus' softmax is relative to the same m.
// Then entropy, ln p_chosen (-inf outside the nucleus) and the Gumbel-max draw over the nucleus only.
template <typename T>
void decode_row_top_p(const T* x, int64_t V, float inv_t, float top_p, bool sample, uint32_t key, int64_t chosen,
                      const uint8_t* nonstop, int64_t* out_c, float* ent, float* lp, float* prob, uint8_t* flag,
                      std::vector<float>& y, std::vector<double>& e, std::vector<uint32_t>& k) {
  y.resize(static_cast<size_t>(V));
  e.resize(static_cast<size_t>(V));
  k.resize(static_cast<size_t>(V));
  float m = kNegInf;
  for (int64_t v = 0; v < V; ++v) {
    y[v] = static_cast<float>(x[v]) * inv_t;
    k[v] = order_key(y[v]);
    m = std::max(m, y[v]);
  }
  const double md = m == kNegInf ? 0.0 : static_cast<double>(m);
  double s = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    e[v] = y[v] == kNegInf ? 0.0 : std::exp(static_cast<double>(y[v]) - md);
    s += e[v];
  }
  const double target = static_cast<double>(top_p) * s;
  uint32_t prefix = 0;
  double above = 0.0;  // mass of the keys above every key that shares `prefix`
  for (int shift = 28; shift >= 0; shift -= 4) {
    double hist[16] = {0.0};
    for (int64_t v = 0; v < V; ++v) {
      if (shift < 28 && (k[v] >> (shift + 4)) != prefix) continue;
      hist[(k[v] >> shift) & 15u] += e[v];
    }
    // smallest digit d with above + sum_{d' > d} hist[d'] < target (d = 15 always qualifies)
    double suffix = 0.0;
    int digit = 15;
    double digit_above = above;
    for (int d = 15; d >= 0; --d) {
      if (above + suffix >= target) break;
      digit = d;
      digit_above = above + suffix;
      suffix += hist[d];
    }
    prefix = (prefix << 4) | static_cast<uint32_t>(digit);
    above = digit_above;
  }
  const uint32_t k0 = prefix;
  double sn = 0.0, un = 0.0;
  float best = kNegInf;
  int64_t best_i = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (y[v] == kNegInf || k[v] < k0) continue;
    const double d = static_cast<double>(y[v]) - md;
    sn += e[v];
    un += d * e[v];
    const float score = sample ? y[v] - std::log(-std::log(sampling_uniform(key, static_cast<uint32_t>(v)))) : y[v];
    if (score > best || best_i < 0) {
      best = score;
      best_i = v;
    }
  }
  const int64_t c = chosen >= 0 ? chosen : std::max<int64_t>(best_i, 0);  // best_i < 0 only for an all -inf row
  const double log_s = std::log(sn);
  const bool in = y[c] != kNegInf && k[c] >= k0;
  const double l = in ? static_cast<double>(y[c]) - md - log_s : -std::numeric_limits<double>::infinity();
  *out_c = c;
  *ent = static_cast<float>(log_s - un / sn);
  *lp = static_cast<float>(l);
  *prob = static_cast<float>(std::exp(l));
  if (flag) *flag = nonstop[c];
}

template <typename T>
inline float dot_f(const T* a, const T* b, int64_t D) {
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(a[d]) * static_cast<float>(b[d]);
  return acc;
}

}  // namespace

template <typename T>
void decode_signals_cpu(const T* logits, int64_t B, int64_t V, float temperature, float top_p, bool sample,
                        const int64_t* keys, const int64_t* chosen, const uint8_t* nonstop, int64_t* out_chosen,
                        float* entropy, float* logprob, float* prob, uint8_t* flag) {
  const float inv_t = temperature > 0.f ? 1.0f / temperature : 1.0f;
  const bool nucleus = temperature > 0.f && top_p < 1.f;
#pragma omp parallel
  {
    std::vector<float> y;
    std::vector<double> e;
    std::vector<uint32_t> k;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const uint32_t key = sample ? static_cast<uint32_t>(keys[b]) : 0u;
      if (nucleus) {
        decode_row_top_p(logits + b * V, V, inv_t, top_p, sample, key, chosen ? chosen[b] : -1, nonstop,
                         out_chosen + b, entropy + b, logprob + b, prob + b, flag ? flag + b : nullptr, y, e, k);
      } else {
        decode_row(logits + b * V, V, inv_t, sample, key, chosen ? chosen[b] : -1, nonstop, out_chosen + b,
                   entropy + b, logprob + b, prob + b, flag ? flag + b : nullptr);
      }
    }
  }
}

template <typename T>
void attn_decode_update_cpu(const T* q, const T* k_cache, int64_t sk_h, int64_t sk_s, const int64_t* block_tables,
                            const int64_t* ctx_lens, const int64_t* span_start, const float* lse, int64_t B,
                            int64_t H, int64_t Hkv, int64_t D, int64_t NB, int64_t nb_pool, int64_t bs, int64_t S,
                            float scale, float* amax, float* row) {
  const int64_t G = H / Hkv;
  const int64_t L = NB * bs;
  // slot of key position i of sequence b, or -1 past the context / outside the pool
  auto slot_of = [&](int64_t b, int64_t i) -> int64_t {
    if (i < 0 || i >= ctx_lens[b] || i >= L) return -1;
    const int64_t blk = block_tables[b * NB + i / bs];
    if (blk < 0 || blk >= nb_pool) return -1;
    return blk * bs + i % bs;
  };
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const T* qh = q + (b * H + h) * D;
      const T* kh = k_cache + (h / G) * sk_h;
      const float l = lse[b * H + h];
      float* am = amax + (b * H + h) * S;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t slot = slot_of(b, span_start[b] + s);
        if (slot < 0) continue;
        am[s] = std::max(am[s], std::exp(dot_f(qh, kh + slot * sk_s, D) * scale - l));
      }
    }
  }
  if (!row) return;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t slot = slot_of(b, i);
      float acc = 0.f;
      if (slot >= 0) {
        for (int64_t h = 0; h < H; ++h)
          acc += std::exp(dot_f(q + (b * H + h) * D, k_cache + (h / G) * sk_h + slot * sk_s, D) * scale -
                          lse[b * H + h]);
      }
      row[b * L + i] = acc / static_cast<float>(H);
    }
  }
}

void causal_attn_rows_cpu(const float* q, const float* k, const int64_t* lengths, const int64_t* rows, int64_t B,
                          int64_t H, int64_t Hkv, int64_t T, int64_t D, int64_t R, float scale, float* out) {
  const int64_t G = H / Hkv;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = 0; r < R; ++r) {
        float* o = out + (b * R + r) * T;
        std::fill(o, o + T, 0.f);
        const int64_t j = rows[b * R + r];
        if (j < 0 || j >= lengths[b]) continue;
        for (int64_t h = 0; h < H; ++h) {
          const float* qj = q + ((b * H + h) * T + j) * D;
          const float* kb = k + ((b * Hkv + h / G) * T) * D;
          float mx = kNegInf;
          for (int64_t i = 0; i <= j; ++i) {
            p[i] = dot_f(qj, kb + i * D, D) * scale;
            mx = std::max(mx, p[i]);
          }
          float sum = 0.f;
          for (int64_t i = 0; i <= j; ++i) {
            p[i] = std::exp(p[i] - mx);
            sum += p[i];
          }
          const float w = 1.f / (sum * static_cast<float>(H));
          for (int64_t i = 0; i <= j; ++i) o[i] += p[i] * w;
        }
      }
    }
  }
}

#define FASTRAG_INSTANTIATE(T)                                                                                     \
  template void decode_signals_cpu<T>(const T*, int64_t, int64_t, float, float, bool, const int64_t*,            \
                                      const int64_t*, const uint8_t*, int64_t*, float*, float*, float*, uint8_t*); \
  template void attn_decode_update_cpu<T>(const T*, const T*, int64_t, int64_t, const int64_t*, const int64_t*,   \
                                          const int64_t*, const float*, int64_t, int64_t, int64_t, int64_t,       \
                                          int64_t, int64_t, int64_t, int64_t, float, float*, float*);
FASTRAG_INSTANTIATE(float)
FASTRAG_INSTANTIATE(c10::BFloat16)
FASTRAG_INSTANTIATE(c10::Half)
#undef FASTRAG_INSTANTIATE

}  // namespace fastrag
