// CPU kernels for the retrieval signals (see fastrag/signals/reference.py for the exact definitions).
// Plain C++ over raw pointers: no Python, no tensor objects. Shapes/dtypes/contiguity are checked by the
// host glue in bindings.cpp; these functions assume contiguous row-major buffers.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace fastrag {

// logits: [B, V] (T in {float, c10::BFloat16, c10::Half}); chosen: [B] or nullptr (use the argmax).
// entropy[b] = -sum_v p_v log p_v,  p = softmax(logits[b] / temperature)   (-inf entries contribute 0)
// logprob[b] = log p_{chosen[b]};  argmax[b] = lowest index of the max logit.
template <typename T>
void token_signals_cpu(const T* logits, const int64_t* chosen, int64_t B, int64_t V, float temperature,
                       float* entropy, float* logprob, int64_t* argmax);

// q: [B, H, T, D], k: [B, Hkv, T, D] float32; lengths: [B]; out: [B, T].
// out[b, i] = mean_h max_{i <= j < n} softmax_{i' <= j}(q[b,h,j] . k[b,h/G,i'] * scale)[i]  for i < n, else 0.
void causal_attn_colmax_cpu(const float* q, const float* k, const int64_t* lengths, int64_t B, int64_t H,
                            int64_t Hkv, int64_t T, int64_t D, float scale, float* out);

}  // namespace fastrag

namespace fastrag {

// The fused decode-step signals (fastrag/signals/reference.py decode_signals_ref). logits: [B, V] contiguous.
// temperature 0: greedy on the raw logits; > 0: y = logits / T, restricted to the top-p nucleus when top_p < 1,
// and (sample) the Gumbel-max draw keyed by keys[b] (sampling.h). chosen (nullable) overrides the choice.
// nonstop: [V] bytes (nullable; then flag is not written).
// Outputs [B]: out_chosen, entropy, logprob, prob = exp(logprob), flag = nonstop[chosen].
template <typename T>
void decode_signals_cpu(const T* logits, int64_t B, int64_t V, float temperature, float top_p, bool sample,
                        const int64_t* keys, const int64_t* chosen, const uint8_t* nonstop, int64_t* out_chosen,
                        float* entropy, float* logprob, float* prob, uint8_t* flag);

// Running max of the last layer's decode attention over the generated span (reference attn_decode_update_ref).
// q: [B, H, D] contiguous; k_cache: [Hkv, num_slots, D] with strides (sk_h, sk_s, 1); block_tables: [B, NB]
// contiguous int64; ctx_lens, span_start: [B]; lse: [B, H]; amax: [B, H, S] in place; row (nullable): [B, NB*bs].
template <typename T>
void attn_decode_update_cpu(const T* q, const T* k_cache, int64_t sk_h, int64_t sk_s, const int64_t* block_tables,
                            const int64_t* ctx_lens, const int64_t* span_start, const float* lse, int64_t B,
                            int64_t H, int64_t Hkv, int64_t D, int64_t NB, int64_t nb_pool, int64_t bs, int64_t S,
                            float scale, float* amax, float* row);

// Head-mean causal attention of selected query rows (reference causal_attn_rows_ref). q: [B, H, T, D],
// k: [B, Hkv, T, D] float32 contiguous; rows: [B, R]; out: [B, R, T] (zero rows for indices outside [0, n)).
void causal_attn_rows_cpu(const float* q, const float* k, const int64_t* lengths, const int64_t* rows, int64_t B,
                          int64_t H, int64_t Hkv, int64_t T, int64_t D, int64_t R, float scale, float* out);

}  // namespace fastrag
