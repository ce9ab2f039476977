// CUDA host glue (built only with FASTRAG_WITH_CUDA): checks, workspaces, stream, dtype code, error check after
// every launch. Device code is in token_signals.cu / attn_stats.cu behind signals_cuda.cuh.
#ifdef FASTRAG_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>

#include "glue.h"
#include "glue_common.h"
#include "signals_cuda.cuh"

namespace fastrag::glue {
namespace {

#define FR_CHECK_CUDA(x, name) TORCH_CHECK((x).is_cuda(), name " must be a CUDA tensor, got ", (x).device())

fastrag::cuda::DType dtype_code(at::ScalarType t) {
  if (t == at::kFloat) return fastrag::cuda::DType::kF32;
  if (t == at::kBFloat16) return fastrag::cuda::DType::kBF16;
  TORCH_CHECK(t == at::kHalf, "unsupported dtype ", t);
  return fastrag::cuda::DType::kF16;
}

constexpr int64_t kSplitAlign = 4096;  // slice length multiple: keeps every slice 16-byte aligned

}  // namespace

void decode_signals_cuda(torch::Tensor logits, double temperature, std::optional<torch::Tensor> rng_keys,
                         std::optional<torch::Tensor> chosen, std::optional<torch::Tensor> nonstop,
                         torch::Tensor out_chosen, torch::Tensor out_entropy, torch::Tensor out_logprob,
                         torch::Tensor out_prob, std::optional<torch::Tensor> out_flag, int64_t num_splits,
                         double top_p, bool greedy) {
  FR_CHECK_CUDA(logits, "logits");
  check_decode_args(logits, temperature, top_p, rng_keys, chosen, nonstop, out_chosen, out_entropy, out_logprob,
                    out_prob, out_flag, greedy);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  logits = logits.contiguous();
  // greedy: the argmax, with the signals of softmax(logits / temperature) (token_signals)
  const bool sample = temperature > 0.0 && !chosen.has_value() && !greedy;
  torch::Tensor ch = chosen.has_value() ? chosen->contiguous() : torch::Tensor();
  torch::Tensor keys = sample ? rng_keys->contiguous() : torch::Tensor();
  const int64_t chunks = (V + kSplitAlign - 1) / kSplitAlign;
  int64_t nsplit = num_splits;
  if (nsplit <= 0) {  // about 4 blocks per SM in all
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, logits.device().index()));
    nsplit = std::max<int64_t>(1, std::min<int64_t>(chunks, (4 * sms + B - 1) / std::max<int64_t>(B, 1)));
  }
  nsplit = std::min(nsplit, chunks);
  const int64_t split_len = (chunks + nsplit - 1) / nsplit * kSplitAlign;
  nsplit = (V + split_len - 1) / split_len;
  auto part = torch::empty({B, nsplit, 4}, logits.options().dtype(at::kFloat));
  auto pidx = torch::empty({B, nsplit}, logits.options().dtype(at::kInt));
  const uint8_t* ns = nonstop.has_value() ? reinterpret_cast<const uint8_t*>(nonstop->data_ptr<bool>()) : nullptr;
  uint8_t* fl = nonstop.has_value() ? reinterpret_cast<uint8_t*>(out_flag->data_ptr<bool>()) : nullptr;
  C10_CUDA_CHECK(fastrag::cuda::decode_signals(
      logits.data_ptr(), dtype_code(logits.scalar_type()), B, V, static_cast<float>(temperature),
      static_cast<float>(top_p), sample,
      keys.defined() ? keys.data_ptr<int64_t>() : nullptr, ch.defined() ? ch.data_ptr<int64_t>() : nullptr, ns,
      part.data_ptr<float>(), pidx.data_ptr<int32_t>(), static_cast<int>(nsplit), split_len,
      out_chosen.data_ptr<int64_t>(), out_entropy.data_ptr<float>(), out_logprob.data_ptr<float>(),
      out_prob.data_ptr<float>(), fl, c10::cuda::getCurrentCUDAStream().stream()));
}

void attn_decode_update_cuda(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables,
                             torch::Tensor ctx_lens, torch::Tensor span_start, torch::Tensor lse, int64_t block_size,
                             double scale, torch::Tensor amax, std::optional<torch::Tensor> row) {
  FR_CHECK_CUDA(q, "q");
  if (block_tables.scalar_type() == at::kInt) block_tables = block_tables.to(at::kLong);
  check_attn_decode_args(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, amax, row);
  TORCH_CHECK(q.size(2) <= fastrag::cuda::kMaxHeadDim, "head dim ", q.size(2), " exceeds the CUDA kernel's limit ",
              fastrag::cuda::kMaxHeadDim);
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  span_start = span_start.contiguous();
  lse = lse.contiguous();
  C10_CUDA_CHECK(fastrag::cuda::attn_decode_update(
      q.data_ptr(), k_cache.data_ptr(), dtype_code(q.scalar_type()), k_cache.stride(0), k_cache.stride(1),
      block_tables.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), span_start.data_ptr<int64_t>(),
      lse.data_ptr<float>(), q.size(0), q.size(1), k_cache.size(0), q.size(2), block_tables.size(1),
      k_cache.size(1) / block_size, block_size, amax.size(2), static_cast<float>(scale), amax.data_ptr<float>(),
      row.has_value() ? row->data_ptr<float>() : nullptr, c10::cuda::getCurrentCUDAStream().stream()));
}

void causal_attn_stats_cuda(torch::Tensor q, torch::Tensor k, torch::Tensor lengths, double scale,
                            std::optional<torch::Tensor> colmax, std::optional<torch::Tensor> rows,
                            std::optional<torch::Tensor> rows_out) {
  FR_CHECK_CUDA(q, "q");
  FR_CHECK_DIM(q, 4, "q");
  FR_CHECK_DIM(k, 4, "k");
  FR_CHECK_FLOAT(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k dtype ", k.scalar_type(), " must match q dtype ",
              q.scalar_type());
  FR_CHECK_DTYPE(lengths, at::kLong, "lengths");
  FR_CHECK_DEVICE(k, q.device(), "k");
  FR_CHECK_DEVICE(lengths, q.device(), "lengths");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D, "k must have shape [", B, ", Hkv, ", T, ", ", D,
              "], got ", k.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "q heads (", H, ") must be a multiple of k heads (", Hkv, ")");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B, "lengths must have shape [", B, "], got ", lengths.sizes());
  TORCH_CHECK(D <= fastrag::cuda::kMaxHeadDim, "head dim ", D, " exceeds the CUDA kernel's limit ",
              fastrag::cuda::kMaxHeadDim);
  if (colmax.has_value()) check_out_buf(*colmax, "colmax", {B, T}, at::kFloat, q.device());
  int64_t R = 0;
  torch::Tensor rw;
  if (rows.has_value()) {
    FR_CHECK_DIM(*rows, 2, "rows");
    FR_CHECK_DTYPE(*rows, at::kLong, "rows");
    FR_CHECK_DEVICE(*rows, q.device(), "rows");
    TORCH_CHECK(rows->size(0) == B, "rows must have ", B, " rows, got ", rows->sizes());
    R = rows->size(1);
    TORCH_CHECK(rows_out.has_value(), "rows_out is required with rows");
    check_out_buf(*rows_out, "rows_out", {B, R, T}, at::kFloat, q.device());
    rw = rows->contiguous();
  }
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  k = k.contiguous();
  lengths = lengths.contiguous();
  auto row_ml = torch::empty({B, H, T, 2}, q.options().dtype(at::kFloat));  // each row's (largest score, log l)
  C10_CUDA_CHECK(fastrag::cuda::causal_attn_stats(
      q.data_ptr(), k.data_ptr(), dtype_code(q.scalar_type()), lengths.data_ptr<int64_t>(), B, H, Hkv, T, D,
      static_cast<float>(scale), row_ml.data_ptr<float>(), colmax.has_value() ? colmax->data_ptr<float>() : nullptr,
      rw.defined() ? rw.data_ptr<int64_t>() : nullptr, R, rows_out.has_value() ? rows_out->data_ptr<float>() : nullptr,
      c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace fastrag::glue

#endif  // FASTRAG_WITH_CUDA
