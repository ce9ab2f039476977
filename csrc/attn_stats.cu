// Last-layer attention statistics on CUDA (reference: fastrag/signals/reference.py attn_decode_update_ref,
// causal_attn_colmax_ref, causal_attn_rows_ref). A warp computes one q.k dot product (lanes over the head dim,
// shuffle reduction); p = exp(q.k * scale - lse) with lse from the main attention (decode), or
// p = exp((q.k * scale - m) - log l) with each row's (m, log l) from a first pass (prefill). Only the last layer's
// attention is formed, one key at a time.
#include "cuda_common.cuh"
#include "signals_cuda.cuh"

namespace fastrag::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// lanes over d: q from shared memory (float), k from global memory
template <typename T>
__device__ __forceinline__ float warp_dot(const float* q, const T* __restrict__ k, int64_t D) {
  float acc = 0.f;
  for (int64_t d = threadIdx.x % 32; d < D; d += 32) acc += q[d] * to_float(k[d]);
  return warp_sum(acc);
}

// s = q.k * scale rounded to nearest, in every kernel that forms a prefill row's scores: a row is normalised by
// scores the lse kernel formed and divided by scores colmax or rows form, so all must round s alike. A plain
// `dot * scale` is contracted (nvcc's default --fmad=true: ptxas made `dot * scale - m` one FFMA in the rows kernel,
// the exact product less m against the rounded product the lse kernel compared; at the largest score p = exp(r -
// log l), r up to half a float32 step of s, p up to 1.03 at |s| ~ 1e6 with a scale that is not a power of two);
// __fmul_rn is never contracted.
__device__ __forceinline__ float scaled(float dot, float scale) { return __fmul_rn(dot, scale); }

// slot of key position i of sequence b, or -1 outside the context, the block table or the pool
__device__ __forceinline__ int64_t slot_of(const int64_t* bt, int64_t NB, int64_t nb_pool, int64_t bs, int64_t n,
                                           int64_t i) {
  if (i < 0 || i >= n || i >= NB * bs) return -1;
  const int64_t blk = bt[i / bs];
  if (blk < 0 || blk >= nb_pool) return -1;
  return blk * bs + i % bs;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) decode_span_kernel(
    const T* __restrict__ q, const T* __restrict__ k, int64_t sk_h, int64_t sk_s, const int64_t* __restrict__ bt,
    const int64_t* __restrict__ ctx, const int64_t* __restrict__ start, const float* __restrict__ lse, int64_t H,
    int64_t G, int64_t D, int64_t NB, int64_t nb_pool, int64_t bs, int64_t S, float scale, float* __restrict__ amax) {
  const int64_t b = blockIdx.y, h = blockIdx.x;
  __shared__ float qs[kMaxHeadDim];
  for (int64_t d = threadIdx.x; d < D; d += kThreads) qs[d] = to_float(q[(b * H + h) * D + d]);
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const float l = lse[b * H + h];
  const T* kh = k + (h / G) * sk_h;
  float* am = amax + (b * H + h) * S;
  for (int64_t s = warp; s < S; s += kWarps) {
    const int64_t slot = slot_of(bt + b * NB, NB, nb_pool, bs, ctx[b], start[b] + s);
    if (slot < 0) continue;  // uniform across the warp
    const float p = expf(warp_dot(qs, kh + slot * sk_s, D) * scale - l);
    if (threadIdx.x % 32 == 0) am[s] = fmaxf(am[s], p);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) decode_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, int64_t sk_h, int64_t sk_s, const int64_t* __restrict__ bt,
    const int64_t* __restrict__ ctx, const float* __restrict__ lse, int64_t H, int64_t G, int64_t D, int64_t NB,
    int64_t nb_pool, int64_t bs, float scale, float* __restrict__ row) {
  const int64_t b = blockIdx.y;
  const int64_t L = NB * bs;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= L) return;
  const int64_t slot = slot_of(bt + b * NB, NB, nb_pool, bs, ctx[b], i);
  float acc = 0.f;
  if (slot >= 0) {
    for (int64_t h = 0; h < H; ++h) {
      const T* qh = q + (b * H + h) * D;
      const T* kh = k + (h / G) * sk_h + slot * sk_s;
      float part = 0.f;
      for (int64_t d = threadIdx.x % 32; d < D; d += 32) part += to_float(qh[d]) * to_float(kh[d]);
      acc += expf(warp_sum(part) * scale - lse[b * H + h]);
    }
  }
  if (threadIdx.x % 32 == 0) row[b * L + i] = acc / static_cast<float>(H);
}

// Row j's log-sum-exp ln sum_{i <= j, i < n} exp(s_ji), s_ji = q_j . k_i * scale, kept as two floats:
// ml[(b*H + h)*T + j] = (m, log l) with m = max_i s_ji and l = sum_i exp(s_ji - m). The consumers form
// p = exp((s - m) - log l): one float m + log l would drop log l next to a large m (log l = 4.5e-5 is lost
// beside m ~ 1e6, and the row sums to 1 + 4.5e-5). One block per (j, b*h), warps over keys.
template <typename T>
__global__ void __launch_bounds__(kThreads) causal_lse_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                              const int64_t* __restrict__ lengths, int64_t H,
                                                              int64_t G, int64_t T_, int64_t D, float scale,
                                                              float2* __restrict__ ml) {
  const int64_t j = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int64_t n = lengths[b];
  __shared__ float qs[kMaxHeadDim];
  __shared__ float wm[kWarps], ws[kWarps];
  if (j >= n) {
    if (threadIdx.x == 0) ml[bh * T_ + j] = make_float2(kNegInf, 0.f);
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) qs[d] = to_float(q[(bh * T_ + j) * D + d]);
  __syncthreads();
  const T* kb = k + (b * (H / G) + h / G) * T_ * D;
  const int warp = threadIdx.x / 32;
  float m = kNegInf, s = 0.f;
  for (int64_t i = warp; i <= j; i += kWarps) {
    const float x = scaled(warp_dot(qs, kb + i * D, D), scale);
    const float m2 = fmaxf(m, x);
    s = s * expf(m - m2) + expf(x - m2);
    m = m2;
  }
  if (threadIdx.x % 32 == 0) {
    wm[warp] = m;
    ws[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = kNegInf;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w]);
    float tot = 0.f;
    for (int w = 0; w < kWarps; ++w) tot += ws[w] > 0.f ? ws[w] * expf(wm[w] - M) : 0.f;
    ml[bh * T_ + j] = make_float2(M, logf(tot));
  }
}

// p_ji = exp((s_ji - m_j) - log l_j), the attention row j gives key i (s_ji as causal_lse_kernel forms it, the
// same float products in the same lane order, so the row is normalised by the scores it is made of)
__device__ __forceinline__ float row_prob(float s, float2 ml) { return expf((s - ml.x) - ml.y); }

// colmax[b, i] = mean_h max_{i <= j < n} p_ji: one block per (i, b), warps over rows j.
template <typename T>
__global__ void __launch_bounds__(kThreads) causal_colmax_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                                 const int64_t* __restrict__ lengths, int64_t H,
                                                                 int64_t G, int64_t T_, int64_t D, float scale,
                                                                 const float2* __restrict__ ml,
                                                                 float* __restrict__ colmax) {
  const int64_t i = blockIdx.x, b = blockIdx.y;
  const int64_t n = lengths[b];
  __shared__ float ks[kMaxHeadDim];
  __shared__ float wmax[kWarps];
  const int warp = threadIdx.x / 32;
  float acc = 0.f;
  for (int64_t h = 0; h < H && i < n; ++h) {
    const T* kb = k + ((b * (H / G) + h / G) * T_ + i) * D;
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += kThreads) ks[d] = to_float(kb[d]);
    __syncthreads();
    const T* qb = q + (b * H + h) * T_ * D;
    const float2* mb = ml + (b * H + h) * T_;
    float mx = 0.f;
    for (int64_t j = i + warp; j < n; j += kWarps) {
      mx = fmaxf(mx, row_prob(scaled(warp_dot(ks, qb + j * D, D), scale), mb[j]));
    }
    if (threadIdx.x % 32 == 0) wmax[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wmax[w]);
      acc += mx;
    }
  }
  if (threadIdx.x == 0) colmax[b * T_ + i] = acc / static_cast<float>(H);
}

// rows_out[b, r, i] = mean_h p_ji for i <= j = rows[b, r] < n, else 0.
template <typename T>
__global__ void __launch_bounds__(kThreads) causal_rows_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                               const int64_t* __restrict__ lengths,
                                                               const int64_t* __restrict__ rows, int64_t R,
                                                               int64_t H, int64_t G, int64_t T_, int64_t D,
                                                               float scale, const float2* __restrict__ ml,
                                                               float* __restrict__ out) {
  const int64_t r = blockIdx.x, b = blockIdx.y;
  const int64_t n = lengths[b];
  const int64_t j = rows[b * R + r];
  const bool ok = j >= 0 && j < n;
  float* o = out + (b * R + r) * T_;
  const int warp = threadIdx.x / 32;
  for (int64_t i = warp; i < T_; i += kWarps) {
    float acc = 0.f;
    if (ok && i <= j) {
      for (int64_t h = 0; h < H; ++h) {
        const T* qj = q + ((b * H + h) * T_ + j) * D;
        const T* ki = k + ((b * (H / G) + h / G) * T_ + i) * D;
        float part = 0.f;
        for (int64_t d = threadIdx.x % 32; d < D; d += 32) part += to_float(qj[d]) * to_float(ki[d]);
        acc += row_prob(scaled(warp_sum(part), scale), ml[(b * H + h) * T_ + j]);
      }
    }
    if (threadIdx.x % 32 == 0) o[i] = acc / static_cast<float>(H);
  }
}

template <typename T>
cudaError_t launch_decode(const T* q, const T* k, int64_t sk_h, int64_t sk_s, const int64_t* bt, const int64_t* ctx,
                          const int64_t* start, const float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t NB, int64_t nb_pool, int64_t bs, int64_t S, float scale, float* amax, float* row,
                          cudaStream_t st) {
  if (B == 0) return cudaSuccess;
  if (D > kMaxHeadDim) return cudaErrorInvalidValue;
  const int64_t G = H / Hkv;
  if (S > 0) {
    decode_span_kernel<T><<<dim3(static_cast<unsigned>(H), static_cast<unsigned>(B)), kThreads, 0, st>>>(
        q, k, sk_h, sk_s, bt, ctx, start, lse, H, G, D, NB, nb_pool, bs, S, scale, amax);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (row) {
    const int64_t L = NB * bs;
    decode_row_kernel<T><<<dim3(static_cast<unsigned>((L + kWarps - 1) / kWarps), static_cast<unsigned>(B)),
                           kThreads, 0, st>>>(q, k, sk_h, sk_s, bt, ctx, lse, H, G, D, NB, nb_pool, bs, scale, row);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_prefill(const T* q, const T* k, const int64_t* lengths, int64_t B, int64_t H, int64_t Hkv,
                           int64_t T_, int64_t D, float scale, float2* ml, float* colmax, const int64_t* rows,
                           int64_t R, float* rows_out, cudaStream_t st) {
  if (B == 0 || T_ == 0) return cudaSuccess;
  if (D > kMaxHeadDim) return cudaErrorInvalidValue;
  const int64_t G = H / Hkv;
  causal_lse_kernel<T><<<dim3(static_cast<unsigned>(T_), static_cast<unsigned>(B * H)), kThreads, 0, st>>>(
      q, k, lengths, H, G, T_, D, scale, ml);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (colmax) {
    causal_colmax_kernel<T><<<dim3(static_cast<unsigned>(T_), static_cast<unsigned>(B)), kThreads, 0, st>>>(
        q, k, lengths, H, G, T_, D, scale, ml, colmax);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (rows && R > 0) {
    causal_rows_kernel<T><<<dim3(static_cast<unsigned>(R), static_cast<unsigned>(B)), kThreads, 0, st>>>(
        q, k, lengths, rows, R, H, G, T_, D, scale, ml, rows_out);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t attn_decode_update(const void* q, const void* k_cache, DType dtype, int64_t sk_h, int64_t sk_s,
                               const int64_t* block_tables, const int64_t* ctx_lens, const int64_t* span_start,
                               const float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB,
                               int64_t nb_pool, int64_t bs, int64_t S, float scale, float* amax, float* row,
                               cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch_decode(static_cast<const float*>(q), static_cast<const float*>(k_cache), sk_h, sk_s,
                           block_tables, ctx_lens, span_start, lse, B, H, Hkv, D, NB, nb_pool, bs, S, scale, amax,
                           row, stream);
    case DType::kBF16:
      return launch_decode(static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k_cache), sk_h,
                           sk_s, block_tables, ctx_lens, span_start, lse, B, H, Hkv, D, NB, nb_pool, bs, S, scale,
                           amax, row, stream);
    case DType::kF16:
      return launch_decode(static_cast<const __half*>(q), static_cast<const __half*>(k_cache), sk_h, sk_s,
                           block_tables, ctx_lens, span_start, lse, B, H, Hkv, D, NB, nb_pool, bs, S, scale, amax,
                           row, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t causal_attn_stats(const void* q, const void* k, DType dtype, const int64_t* lengths, int64_t B,
                              int64_t H, int64_t Hkv, int64_t T, int64_t D, float scale, float* row_ml, float* colmax,
                              const int64_t* rows, int64_t R, float* rows_out, cudaStream_t stream) {
  float2* ml = reinterpret_cast<float2*>(row_ml);  // [B, H, T] pairs (m, log l); torch allocations are 8-aligned
  switch (dtype) {
    case DType::kF32:
      return launch_prefill(static_cast<const float*>(q), static_cast<const float*>(k), lengths, B, H, Hkv, T, D,
                            scale, ml, colmax, rows, R, rows_out, stream);
    case DType::kBF16:
      return launch_prefill(static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k), lengths, B,
                            H, Hkv, T, D, scale, ml, colmax, rows, R, rows_out, stream);
    case DType::kF16:
      return launch_prefill(static_cast<const __half*>(q), static_cast<const __half*>(k), lengths, B, H, Hkv, T, D,
                            scale, ml, colmax, rows, R, rows_out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastrag::cuda
