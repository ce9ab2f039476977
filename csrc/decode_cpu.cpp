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

// Scratch of decode_row_top_p, one per thread (sized to the row on first use).
struct TopPScratch {
  std::vector<float> y, e;
  std::vector<uint32_t> k;
  std::vector<int64_t> cand;
};

// One row with nucleus (top-p) filtering of p = softmax(y), y = x * inv_t (reference top_p_nucleus_ref): the
// nucleus is {v : order_key(y_v) >= K0} with K0 = min{K : sum_{order_key(y_u) > K} e^{y_u - m} < top_p * s}, found
// by a radix select over the 32 key bits, 4 at a time: each level histograms the mass of the keys that share the
// prefix chosen so far by their next digit and keeps the smallest digit whose strictly-larger mass stays below
// the target. The first level reads the whole row; the candidates that share the chosen prefix are then gathered,
// and each later level reads (and narrows) only them. The global max is always in the nucleus, so the nucleus'
// softmax is relative to the same m. Then entropy, ln p_chosen (-inf outside the nucleus) and the Gumbel-max draw
// over the nucleus only. e^{y-m} is the float32 polynomial of the plain path, its sums are double.
template <typename T>
void decode_row_top_p(const T* x, int64_t V, float inv_t, float top_p, bool sample, uint32_t key, int64_t chosen,
                      const uint8_t* nonstop, int64_t* out_c, float* ent, float* lp, float* prob, uint8_t* flag,
                      TopPScratch& w) {
  namespace rs = row_softmax;
  w.y.resize(static_cast<size_t>(V));
  w.e.resize(static_cast<size_t>(V));
  w.k.resize(static_cast<size_t>(V));
  w.cand.resize(static_cast<size_t>(V));
  float* y = w.y.data();
  float* e = w.e.data();
  uint32_t* k = w.k.data();
  int64_t* cand = w.cand.data();
  float m = kNegInf, top = kNegInf;
  int64_t top_i = 0;  // the first max (the pick of a row without a distribution)
  bool bad = false;   // a NaN or +inf scaled logit
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    float cmax, xmax;
    rs::scale_chunk(x + c0, n, inv_t, y + c0, &cmax, &xmax, &bad);
    if (cmax > top) {
      top = cmax;
      top_i = c0 + rs::first_equal(y + c0, n, cmax);
    }
    m = std::max(m, cmax);
  }
  if (bad || m == kNegInf) {  // no distribution (NaN entropy and logprob), or no finite logit
    const int64_t c = chosen >= 0 ? chosen : top_i;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    *out_c = c;
    *ent = nan;
    *lp = bad ? nan : kNegInf;
    *prob = bad ? nan : 0.f;
    if (flag) *flag = nonstop[c];
    return;
  }
  double s = 0.0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) s += rs::exp_keys(y + c0, std::min(kChunk, V - c0), m, e + c0, k + c0);
  const double target = static_cast<double>(top_p) * s;
  uint32_t prefix = 0;
  double above = 0.0;  // mass of the keys above every key that shares `prefix`
  int64_t nc = 0;      // candidates (after the first level): the entries whose key starts with `prefix`
  for (int shift = 28; shift >= 0; shift -= 4) {
    double hist[16] = {0.0};
    if (shift == 28) {
      for (int64_t v = 0; v < V; ++v) hist[k[v] >> 28] += e[v];
    } else {
      for (int64_t j = 0; j < nc; ++j) hist[(k[cand[j]] >> shift) & 15u] += e[cand[j]];
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
    if (shift == 0) break;
    int64_t kept = 0;  // (in place: kept <= j)
    if (shift == 28) {
      for (int64_t v = 0; v < V; ++v) {
        cand[kept] = v;
        kept += (k[v] >> shift) == prefix;
      }
    } else {
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t v = cand[j];
        cand[kept] = v;
        kept += (k[v] >> shift) == prefix;
      }
    }
    nc = kept;
  }
  const uint32_t k0 = prefix;
  double sn = 0.0, un = 0.0;
  float best = kNegInf;
  int64_t best_i = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (k[v] < k0 || y[v] == kNegInf) continue;
    sn += e[v];
    un += (static_cast<double>(y[v]) - m) * e[v];
    const float score = sample ? y[v] - std::log(-std::log(sampling_uniform(key, static_cast<uint32_t>(v)))) : y[v];
    if (score > best || best_i < 0) {  // strict: ties keep the lowest index
      best = score;
      best_i = v;
    }
  }
  const int64_t c = chosen >= 0 ? chosen : best_i;  // (the max is in the nucleus: best_i >= 0)
  const double log_s = std::log(sn);
  const bool in = y[c] != kNegInf && k[c] >= k0;
  const double l = in ? static_cast<double>(y[c]) - m - log_s : -std::numeric_limits<double>::infinity();
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
    TopPScratch scratch;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const uint32_t key = sample ? static_cast<uint32_t>(keys[b]) : 0u;
      if (nucleus) {
        decode_row_top_p(logits + b * V, V, inv_t, top_p, sample, key, chosen ? chosen[b] : -1, nonstop,
                         out_chosen + b, entropy + b, logprob + b, prob + b, flag ? flag + b : nullptr, scratch);
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
