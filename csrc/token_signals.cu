// Fused decode-step token signals on CUDA (reference: fastrag/signals/reference.py decode_signals_ref).
// Split-V: grid (nsplit, B); each block reduces one slice of a row to an online-softmax state
// (m, s = sum e^{y-m}, u = sum (y-m) e^{y-m}) plus the best score and its lowest index; a one-warp-per-row kernel
// merges the slices: H = ln s - u/s, ln p_c = y_c - m - ln s. Logits are read once, 16 bytes per load when
// the row is 16-byte aligned. Top-p sampling (top_p < 1) takes decode_top_p_kernel instead: ten reads of a row.
#include "cuda_common.cuh"
#include "sampling.h"
#include "signals_cuda.cuh"

namespace fastrag::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A logit over the temperature, rounded once: __fmul_rn is never contracted into an FMA with a later subtraction
// (nvcc contracts `x * inv_t - m` by default, keeping the product's rounding error: at T = 1e-30 the row's maximum got
// y - m = 9.4e30 on a GPU, a positive log-probability), so y - m is exactly 0 at the maximum.
template <typename T>
__device__ __forceinline__ float scaled(T x, float inv_t) {
  return __fmul_rn(to_float(x), inv_t);
}

struct State {
  float m, s, u, best;
  int32_t idx;
};

__device__ __forceinline__ void push(State& st, float y, float score, int32_t i) {
  if (score > st.best || (score == st.best && i < st.idx)) {
    st.best = score;
    st.idx = i;
  }
  if (y == kNegInf) return;  // masked: 0 * ln 0 = 0
  if (isnan(y) || y == kPosInf) {  // no distribution (the reference: NaN entropy and logprob); s stays NaN
    st.s = st.u = __int_as_float(0x7fc00000);
    return;
  }
  if (y > st.m) {  // one exp per element: rescale the state, the new element weighs e^0 = 1
    if (st.s > 0.f) {
      const float r = __expf(st.m - y);
      st.u = r > 0.f ? r * (st.u + (st.m - y) * st.s) : 0.f;  // (r = 0 when m - y overflows: the old state weighs 0)
      st.s = r * st.s + 1.f;
    } else if (st.s == 0.f) {  // the first unmasked element: m was -inf, and (-inf) * 0 would make u NaN
      st.u = 0.f;
      st.s = 1.f;
    }  // (s NaN: a NaN came before; it stays)
    st.m = y;
  } else {
    const float d = y - st.m;
    const float e = __expf(d);
    st.s += e;
    st.u += e > 0.f ? d * e : 0.f;  // (d = -inf where y - m overflows float32: a tiny temperature)
  }
}

__device__ __forceinline__ State merge(State a, const State& b) {
  if (b.best > a.best || (b.best == a.best && b.idx < a.idx)) {
    a.best = b.best;
    a.idx = b.idx;
  }
  const float m = fmaxf(a.m, b.m);
  if (isnan(a.s) || isnan(b.s)) {  // a NaN on either side (its lane may hold nothing else: m = -inf) stays
    a.s = a.u = __int_as_float(0x7fc00000);
    a.m = m;
    return a;
  }
  if (m == kNegInf) return a;
  const float ra = a.s > 0.f ? __expf(a.m - m) : 0.f;
  const float rb = b.s > 0.f ? __expf(b.m - m) : 0.f;
  a.u = (ra > 0.f ? ra * (a.u + (a.m - m) * a.s) : 0.f) + (rb > 0.f ? rb * (b.u + (b.m - m) * b.s) : 0.f);
  a.s = ra * a.s + rb * b.s;
  a.m = m;
  return a;
}

__device__ __forceinline__ State shfl_state(const State& st, int o) {
  State r;
  r.m = __shfl_xor_sync(0xffffffffu, st.m, o);
  r.s = __shfl_xor_sync(0xffffffffu, st.s, o);
  r.u = __shfl_xor_sync(0xffffffffu, st.u, o);
  r.best = __shfl_xor_sync(0xffffffffu, st.best, o);
  r.idx = __shfl_xor_sync(0xffffffffu, st.idx, o);
  return r;
}

template <bool kSample>
__device__ __forceinline__ float score_of(float y, uint32_t key, int32_t v) {
  if constexpr (kSample) {
    return y - logf(-logf(sampling_uniform(key, static_cast<uint32_t>(v))));  // accurate logf: no fast-math here
  } else {
    return y;
  }
}

template <typename T, bool kSample>
__global__ void __launch_bounds__(kThreads) decode_partial_kernel(const T* __restrict__ logits, int64_t V,
                                                                  float inv_t, const int64_t* __restrict__ keys,
                                                                  int64_t split_len, int nsplit,
                                                                  float* __restrict__ part,
                                                                  int32_t* __restrict__ pidx) {
  const int64_t b = blockIdx.y;
  const int sp = blockIdx.x;
  const int64_t v0 = sp * split_len;
  const int64_t v1 = min(v0 + split_len, V);
  const T* row = logits + b * V;
  const uint32_t key = kSample ? static_cast<uint32_t>(keys[b]) : 0u;
  State st{kNegInf, 0.f, 0.f, kNegInf, INT32_MAX};
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(row + v0) % 16 == 0);
  int64_t v = v0;
  if (aligned) {
    // 16-byte loads: kVec logits per thread per iteration, coalesced across the block
    const int64_t nvec = (v1 - v0) / kVec;
    const uint4* src = reinterpret_cast<const uint4*>(row + v0);
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const uint4 raw = __ldg(src + i);
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int32_t vi = static_cast<int32_t>(v0 + i * kVec + e);
        const float y = scaled(vals[e], inv_t);
        push(st, y, score_of<kSample>(y, key, vi), vi);
      }
    }
    v = v0 + nvec * kVec;
  }
  for (int64_t i = v + threadIdx.x; i < v1; i += kThreads) {
    const float y = scaled(row[i], inv_t);
    push(st, y, score_of<kSample>(y, key, static_cast<int32_t>(i)), static_cast<int32_t>(i));
  }
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_state(st, o));
  __shared__ State warp_states[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kWarps ? warp_states[lane] : State{kNegInf, 0.f, 0.f, kNegInf, INT32_MAX};
    for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_state(st, o));
    if (lane == 0) {
      float* p = part + (b * nsplit + sp) * 4;
      p[0] = st.m;
      p[1] = st.s;
      p[2] = st.u;
      p[3] = st.best;
      pidx[b * nsplit + sp] = st.idx;
    }
  }
}

template <typename T>
__global__ void decode_combine_kernel(const T* __restrict__ logits, int64_t B, int64_t V, float inv_t,
                                      const float* __restrict__ part, const int32_t* __restrict__ pidx, int nsplit,
                                      const int64_t* __restrict__ chosen, const uint8_t* __restrict__ nonstop,
                                      int64_t* __restrict__ out_chosen, float* __restrict__ out_entropy,
                                      float* __restrict__ out_logprob, float* __restrict__ out_prob,
                                      uint8_t* __restrict__ out_flag) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (b >= B) return;
  State st{kNegInf, 0.f, 0.f, kNegInf, INT32_MAX};
  for (int i = lane; i < nsplit; i += 32) {
    const float* p = part + (b * nsplit + i) * 4;
    st = merge(st, State{p[0], p[1], p[2], p[3], pidx[b * nsplit + i]});
  }
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_state(st, o));
  if (lane != 0) return;
  int64_t c = chosen ? chosen[b] : (st.idx == INT32_MAX ? 0 : static_cast<int64_t>(st.idx));  // (all -inf: 0)
  c = c < 0 ? 0 : (c >= V ? V - 1 : c);  // the glue validates on the CPU; on the GPU never read out of bounds
  const float m = st.m == kNegInf ? 0.f : st.m;
  const float log_s = logf(st.s);
  const float lp = scaled(logits[b * V + c], inv_t) - m - log_s;
  out_chosen[b] = c;
  out_entropy[b] = log_s - st.u / st.s;
  out_logprob[b] = lp;
  out_prob[b] = expf(lp);
  if (nonstop) out_flag[b] = nonstop[c];
}

// Order-preserving uint32 image of a float32 (a < b <=> order_key(a) < order_key(b), -0.0 keyed as +0.0); same as
// decode_cpu.cpp.
__device__ __forceinline__ uint32_t order_key(float y) {
  uint32_t bits = __float_as_uint(y);
  if (bits == 0x80000000u) bits = 0u;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Nucleus (top-p) sampling and signals, one block per row (reference: decode_signals_ref with top_p < 1; the C++
// twin is decode_row_top_p in decode_cpu.cpp). Pass 1: max m and s = sum e^{y-m}. Passes 2-9: radix select of
// K0 = min{K : sum_{key(y_u) > K} e^{y_u - m} < top_p * s}, 4 key bits per pass (a 16-bucket mass histogram of the
// keys sharing the prefix chosen so far; keep the smallest digit whose strictly-larger mass stays below the
// target). Pass 10: entropy, Gumbel-max draw and ln p_chosen over the nucleus {key >= K0}, which holds the max.
// Every reduction runs in a fixed order, so the result does not depend on scheduling.
template <typename T, bool kSample>
__global__ void __launch_bounds__(kThreads) decode_top_p_kernel(const T* __restrict__ logits, int64_t V, float inv_t,
                                                                float top_p, const int64_t* __restrict__ keys,
                                                                const int64_t* __restrict__ chosen,
                                                                const uint8_t* __restrict__ nonstop,
                                                                int64_t* __restrict__ out_chosen,
                                                                float* __restrict__ out_entropy,
                                                                float* __restrict__ out_logprob,
                                                                float* __restrict__ out_prob,
                                                                uint8_t* __restrict__ out_flag) {
  const int64_t b = blockIdx.x;
  const T* row = logits + b * V;
  const uint32_t key = kSample ? static_cast<uint32_t>(keys[b]) : 0u;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ State warp_states[kWarps];
  __shared__ float hist_w[kWarps][16];
  __shared__ uint32_t s_prefix;
  __shared__ float s_above;

  State st{kNegInf, 0.f, 0.f, kNegInf, INT32_MAX};
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float y = scaled(row[i], inv_t);
    push(st, y, y, static_cast<int32_t>(i));
  }
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_state(st, o));
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  st = warp_states[0];
  for (int w = 1; w < kWarps; ++w) st = merge(st, warp_states[w]);  // same order in every thread
  const float m = st.m == kNegInf ? 0.f : st.m;
  const float target = top_p * st.s;

  uint32_t prefix = 0;
  float above = 0.f;  // mass of the keys above every key that shares `prefix`
  for (int shift = 28; shift >= 0; shift -= 4) {
    float h[16];
#pragma unroll
    for (int d = 0; d < 16; ++d) h[d] = 0.f;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float y = scaled(row[i], inv_t);
      if (y == kNegInf) continue;
      const uint32_t k = order_key(y);
      if (shift < 28 && (k >> (shift + 4)) != prefix) continue;
      const uint32_t dig = (k >> shift) & 15u;
      const float e = __expf(y - m);
#pragma unroll
      for (int d = 0; d < 16; ++d) h[d] += dig == static_cast<uint32_t>(d) ? e : 0.f;
    }
#pragma unroll
    for (int d = 0; d < 16; ++d) h[d] = warp_sum(h[d]);
    if (lane == 0) {
#pragma unroll
      for (int d = 0; d < 16; ++d) hist_w[warp][d] = h[d];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float suffix = 0.f, digit_above = above;
      int digit = 15;
      for (int d = 15; d >= 0; --d) {  // smallest digit with above + sum_{d' > d} < target (15 always qualifies)
        if (above + suffix >= target) break;
        digit = d;
        digit_above = above + suffix;
        float tot = 0.f;
        for (int w = 0; w < kWarps; ++w) tot += hist_w[w][d];
        suffix += tot;
      }
      s_prefix = (prefix << 4) | static_cast<uint32_t>(digit);
      s_above = digit_above;
    }
    __syncthreads();
    prefix = s_prefix;
    above = s_above;
  }

  const uint32_t k0 = prefix;
  float sn = 0.f, un = 0.f, best = kNegInf;
  int32_t best_i = INT32_MAX;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float y = scaled(row[i], inv_t);
    if (y == kNegInf || order_key(y) < k0) continue;
    const float d = y - m;
    const float e = __expf(d);
    sn += e;
    un += e > 0.f ? d * e : 0.f;
    const float score = score_of<kSample>(y, key, static_cast<int32_t>(i));
    if (score > best || (score == best && static_cast<int32_t>(i) < best_i)) {
      best = score;
      best_i = static_cast<int32_t>(i);
    }
  }
  State fin{0.f, sn, un, best, best_i};  // m = 0 in every thread: merge adds s and u unscaled
  for (int o = 16; o > 0; o >>= 1) {
    const State other = shfl_state(fin, o);
    if (other.best > fin.best || (other.best == fin.best && other.idx < fin.idx)) {
      fin.best = other.best;
      fin.idx = other.idx;
    }
    fin.s += other.s;
    fin.u += other.u;
  }
  __syncthreads();  // warp_states is reused
  if (lane == 0) warp_states[warp] = fin;
  __syncthreads();
  if (threadIdx.x != 0) return;
  fin = warp_states[0];
  for (int w = 1; w < kWarps; ++w) {
    const State& other = warp_states[w];
    if (other.best > fin.best || (other.best == fin.best && other.idx < fin.idx)) {
      fin.best = other.best;
      fin.idx = other.idx;
    }
    fin.s += other.s;
    fin.u += other.u;
  }
  int64_t c = chosen ? chosen[b] : (fin.idx == INT32_MAX ? 0 : static_cast<int64_t>(fin.idx));
  c = c < 0 ? 0 : (c >= V ? V - 1 : c);
  const float yc = scaled(row[c], inv_t);
  const bool in = yc != kNegInf && order_key(yc) >= k0;
  const float log_s = logf(fin.s);
  const float lp = in ? yc - m - log_s : kNegInf;
  out_chosen[b] = c;
  out_entropy[b] = log_s - fin.u / fin.s;
  out_logprob[b] = lp;
  out_prob[b] = expf(lp);
  if (nonstop) out_flag[b] = nonstop[c];
}

template <typename T>
cudaError_t launch(const T* logits, int64_t B, int64_t V, float temperature, float top_p, bool sample,
                   const int64_t* keys, const int64_t* chosen, const uint8_t* nonstop, float* part, int32_t* pidx,
                   int nsplit, int64_t split_len, int64_t* oc, float* oe, float* ol, float* op, uint8_t* of,
                   cudaStream_t s) {
  if (B == 0) return cudaSuccess;
  const float inv_t = temperature > 0.f ? 1.f / temperature : 1.f;
  if (temperature > 0.f && top_p < 1.f) {
    const dim3 rows(static_cast<unsigned>(B));
    if (sample) {
      decode_top_p_kernel<T, true><<<rows, kThreads, 0, s>>>(logits, V, inv_t, top_p, keys, chosen, nonstop, oc, oe,
                                                            ol, op, of);
    } else {
      decode_top_p_kernel<T, false><<<rows, kThreads, 0, s>>>(logits, V, inv_t, top_p, keys, chosen, nonstop, oc, oe,
                                                             ol, op, of);
    }
    return cudaGetLastError();
  }
  const dim3 grid(nsplit, static_cast<unsigned>(B));
  if (sample) {
    decode_partial_kernel<T, true><<<grid, kThreads, 0, s>>>(logits, V, inv_t, keys, split_len, nsplit, part, pidx);
  } else {
    decode_partial_kernel<T, false><<<grid, kThreads, 0, s>>>(logits, V, inv_t, keys, split_len, nsplit, part, pidx);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  constexpr int kRowsPerBlock = 4;
  decode_combine_kernel<T><<<static_cast<unsigned>((B + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                             s>>>(logits, B, V, inv_t, part, pidx, nsplit, chosen, nonstop, oc, oe, ol, op, of);
  return cudaGetLastError();
}

}  // namespace

cudaError_t decode_signals(const void* logits, DType dtype, int64_t B, int64_t V, float temperature, float top_p,
                           bool sample,
                           const int64_t* keys, const int64_t* chosen, const uint8_t* nonstop, float* part,
                           int32_t* pidx, int nsplit, int64_t split_len, int64_t* out_chosen, float* out_entropy,
                           float* out_logprob, float* out_prob, uint8_t* out_flag, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch(static_cast<const float*>(logits), B, V, temperature, top_p, sample, keys, chosen, nonstop,
                    part, pidx, nsplit, split_len, out_chosen, out_entropy, out_logprob, out_prob, out_flag, stream);
    case DType::kBF16:
      return launch(static_cast<const __nv_bfloat16*>(logits), B, V, temperature, top_p, sample, keys, chosen,
                    nonstop, part, pidx, nsplit, split_len, out_chosen, out_entropy, out_logprob, out_prob, out_flag,
                    stream);
    case DType::kF16:
      return launch(static_cast<const __half*>(logits), B, V, temperature, top_p, sample, keys, chosen, nonstop,
                    part, pidx, nsplit, split_len, out_chosen, out_entropy, out_logprob, out_prob, out_flag, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastrag::cuda
