// Launchers of the CUDA signal kernels (token_signals.cu, attn_stats.cu). Plain C++ over raw device pointers and
// a stream: no torch headers, so these sources compile with nvcc alone (CI's compile-only check). Shapes, dtypes,
// devices and contiguity are checked by the host glue (glue_cuda.cpp); every launcher returns the launch's
// cudaError_t. Definitions: fastrag/signals/reference.py.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace fastrag::cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Fused decode-step signals. logits: [B, V] contiguous. part: [B, nsplit, 4] f32 and pidx: [B, nsplit] i32
// workspaces; split_len: logits per slice (nsplit = ceil(V / split_len)). temperature 0: greedy. top_p < 1 with
// temperature > 0: the nucleus kernel (one block per row, radix select of the nucleus, no workspace).
// chosen, keys, nonstop, out_flag are nullable (keys needed when sampling; flag written iff nonstop).
cudaError_t decode_signals(const void* logits, DType dtype, int64_t B, int64_t V, float temperature, float top_p,
                           bool sample,
                           const int64_t* keys, const int64_t* chosen, const uint8_t* nonstop, float* part,
                           int32_t* pidx, int nsplit, int64_t split_len, int64_t* out_chosen, float* out_entropy,
                           float* out_logprob, float* out_prob, uint8_t* out_flag, cudaStream_t stream);

// Decode attention statistics. q: [B, H, D] contiguous; k_cache: [Hkv, num_slots, D] with strides (sk_h, sk_s, 1);
// block_tables: [B, NB] i64 contiguous; ctx_lens, span_start: [B]; lse: [B, H]; amax: [B, H, S] in place;
// row: [B, NB * bs] or nullptr. D <= kMaxHeadDim.
constexpr int kMaxHeadDim = 256;
cudaError_t attn_decode_update(const void* q, const void* k_cache, DType dtype, int64_t sk_h, int64_t sk_s,
                               const int64_t* block_tables, const int64_t* ctx_lens, const int64_t* span_start,
                               const float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB,
                               int64_t nb_pool, int64_t bs, int64_t S, float scale, float* amax, float* row,
                               cudaStream_t stream);

// Prefill (causal block) statistics. q: [B, H, T, D], k: [B, Hkv, T, D] contiguous; lengths: [B];
// row_ml: [B, H, T, 2] f32 workspace (each row's largest score and log l); colmax: [B, T] (nullable);
// rows: [B, R] i64 and rows_out: [B, R, T] (nullable).
cudaError_t causal_attn_stats(const void* q, const void* k, DType dtype, const int64_t* lengths, int64_t B,
                              int64_t H, int64_t Hkv, int64_t T, int64_t D, float scale, float* row_ml, float* colmax,
                              const int64_t* rows, int64_t R, float* rows_out, cudaStream_t stream);

}  // namespace fastrag::cuda
