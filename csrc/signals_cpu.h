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
