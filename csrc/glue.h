// Host glue entry points of fastrag._C (shape/dtype/device checks, dtype dispatch), bound in bindings.cpp.
// CPU versions: glue_cpu.cpp. CUDA versions (suffix _cuda): glue_cuda.cpp, built only with FASTRAG_WITH_CUDA.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fastrag::glue {

// Writes out_chosen [B] i64, out_entropy/out_logprob/out_prob [B] f32 and out_flag [B] bool (if a nonstop table).
void decode_signals(torch::Tensor logits, double temperature, std::optional<torch::Tensor> rng_keys,
                    std::optional<torch::Tensor> chosen, std::optional<torch::Tensor> nonstop,
                    torch::Tensor out_chosen, torch::Tensor out_entropy, torch::Tensor out_logprob,
                    torch::Tensor out_prob, std::optional<torch::Tensor> out_flag, double top_p);

// amax [B, H, S] f32 updated in place; row [B, NB * block_size] f32 written if given.
void attn_decode_update(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables, torch::Tensor ctx_lens,
                        torch::Tensor span_start, torch::Tensor lse, int64_t block_size, double scale,
                        torch::Tensor amax, std::optional<torch::Tensor> row);

// [B, R, T] f32 head-mean causal attention of the query rows `rows` [B, R].
torch::Tensor causal_attn_rows(torch::Tensor q, torch::Tensor k, torch::Tensor lengths, torch::Tensor rows,
                               double scale, std::optional<torch::Tensor> out);

// BM25 best_fields top-k of Q queries over two fields' CSC score matrices (csrc/bm25_cpu.cpp): (ids [Q, k] i64, -1
// past the passages that match; scores [Q, k] f64). scratch [2, N] f32 and mark [N] u8 are all zero and left so.
std::tuple<torch::Tensor, torch::Tensor> bm25_best_fields(std::vector<torch::Tensor> data,
                                                           std::vector<torch::Tensor> indices,
                                                           std::vector<torch::Tensor> indptr,
                                                           std::vector<torch::Tensor> terms,
                                                           std::vector<torch::Tensor> offsets, torch::Tensor scratch,
                                                           torch::Tensor mark, double tie_breaker, int64_t k);

// The tokens of a BM25 build's passages (csrc/bm25_tokens.cpp; Han and hiragana spaced, each text lowered): (the
// distinct tokens [list of str, first seen first], every token's number end to end [T] i32, tokens a text [n] i64).
py::tuple bm25_tokens(py::sequence texts);

#ifdef FASTRAG_WITH_CUDA
void decode_signals_cuda(torch::Tensor logits, double temperature, std::optional<torch::Tensor> rng_keys,
                         std::optional<torch::Tensor> chosen, std::optional<torch::Tensor> nonstop,
                         torch::Tensor out_chosen, torch::Tensor out_entropy, torch::Tensor out_logprob,
                         torch::Tensor out_prob, std::optional<torch::Tensor> out_flag, int64_t num_splits,
                         double top_p, bool greedy);
void attn_decode_update_cuda(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables,
                             torch::Tensor ctx_lens, torch::Tensor span_start, torch::Tensor lse, int64_t block_size,
                             double scale, torch::Tensor amax, std::optional<torch::Tensor> row);
// Writes colmax [B, T] f32 if given and rows_out [B, R, T] f32 if rows [B, R] is given.
void causal_attn_stats_cuda(torch::Tensor q, torch::Tensor k, torch::Tensor lengths, double scale,
                            std::optional<torch::Tensor> colmax, std::optional<torch::Tensor> rows,
                            std::optional<torch::Tensor> rows_out);
#endif

}  // namespace fastrag::glue
