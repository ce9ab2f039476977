// Check macros shared by the CPU and CUDA host glue. `name` is the Python argument name.
#pragma once

#include <torch/extension.h>

#define FR_CHECK_DIM(x, n, name) \
  TORCH_CHECK((x).dim() == (n), name " must have ", (n), " dims, got shape ", (x).sizes())
#define FR_CHECK_DTYPE(x, t, name) \
  TORCH_CHECK((x).scalar_type() == (t), name " must be ", (t), ", got ", (x).scalar_type())
#define FR_CHECK_FLOAT(x, name)                                                                      \
  TORCH_CHECK((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kBFloat16 ||             \
                  (x).scalar_type() == at::kHalf,                                                  \
              name " must be float32, bfloat16 or float16, got ", (x).scalar_type())
#define FR_CHECK_DEVICE(x, dev, name) \
  TORCH_CHECK((x).device() == (dev), name " is on ", (x).device(), " but must be on ", (dev))

namespace fastrag::glue {

// An output written in place: exact shape, dtype, device, contiguous (no silent copy).
inline void check_out_buf(const torch::Tensor& out, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                          const at::Device& dev) {
  TORCH_CHECK(out.device() == dev, name, " must be on ", dev, ", got ", out.device());
  TORCH_CHECK(out.sizes() == shape, name, " must have shape ", shape, ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == dtype, name, " must be ", dtype, ", got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), name, " must be contiguous");
}

// Shape/dtype checks of the decode-signals arguments common to both devices (values are checked on the CPU only).
inline void check_decode_args(const torch::Tensor& logits, double temperature, double top_p,
                              const std::optional<torch::Tensor>& rng_keys, const std::optional<torch::Tensor>& chosen,
                              const std::optional<torch::Tensor>& nonstop, const torch::Tensor& oc,
                              const torch::Tensor& oe, const torch::Tensor& ol, const torch::Tensor& op,
                              const std::optional<torch::Tensor>& of, bool greedy = false) {
  FR_CHECK_DIM(logits, 2, "logits");
  FR_CHECK_FLOAT(logits, "logits");
  const auto dev = logits.device();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31) - 1, "logits vocabulary V=", V, " must be in [1, 2^31 - 1)");
  TORCH_CHECK(temperature >= 0.0, "temperature must be >= 0 (0: greedy), got ", temperature);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got ", top_p);
  if (chosen.has_value()) {
    FR_CHECK_DIM(*chosen, 1, "chosen");
    FR_CHECK_DTYPE(*chosen, at::kLong, "chosen");
    FR_CHECK_DEVICE(*chosen, dev, "chosen");
    TORCH_CHECK(chosen->size(0) == B, "chosen must have shape [", B, "], got ", chosen->sizes());
  } else if (temperature > 0.0 && !greedy) {
    TORCH_CHECK(rng_keys.has_value(), "rng_keys [B] int64 is required when sampling (temperature > 0)");
  }
  if (rng_keys.has_value()) {
    FR_CHECK_DIM(*rng_keys, 1, "rng_keys");
    FR_CHECK_DTYPE(*rng_keys, at::kLong, "rng_keys");
    FR_CHECK_DEVICE(*rng_keys, dev, "rng_keys");
    TORCH_CHECK(rng_keys->size(0) == B, "rng_keys must have shape [", B, "], got ", rng_keys->sizes());
  }
  if (nonstop.has_value()) {
    FR_CHECK_DIM(*nonstop, 1, "nonstop");
    FR_CHECK_DTYPE(*nonstop, at::kBool, "nonstop");
    FR_CHECK_DEVICE(*nonstop, dev, "nonstop");
    TORCH_CHECK(nonstop->size(0) == V, "nonstop must have shape [", V, "], got ", nonstop->sizes());
    TORCH_CHECK(of.has_value(), "out_flag is required when a nonstop table is given");
    check_out_buf(*of, "out_flag", {B}, at::kBool, dev);
  }
  check_out_buf(oc, "out_chosen", {B}, at::kLong, dev);
  check_out_buf(oe, "out_entropy", {B}, at::kFloat, dev);
  check_out_buf(ol, "out_logprob", {B}, at::kFloat, dev);
  check_out_buf(op, "out_prob", {B}, at::kFloat, dev);
}

// q [B, H, D], k_cache [Hkv, slots, D] same float dtype, block_tables [B, NB] int64, ctx_lens/span_start [B] int64,
// lse [B, H] f32, amax [B, H, S] f32 contiguous with S <= NB * block_size, row [B, NB * block_size] f32.
inline void check_attn_decode_args(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& bt,
                                   const torch::Tensor& ctx, const torch::Tensor& start, const torch::Tensor& lse,
                                   int64_t block_size, const torch::Tensor& amax,
                                   const std::optional<torch::Tensor>& row) {
  FR_CHECK_DIM(q, 3, "q");
  FR_CHECK_DIM(k, 3, "k_cache");
  FR_CHECK_DIM(bt, 2, "block_tables");
  FR_CHECK_DIM(ctx, 1, "ctx_lens");
  FR_CHECK_DIM(start, 1, "span_start");
  FR_CHECK_DIM(lse, 2, "lse");
  FR_CHECK_DIM(amax, 3, "amax");
  FR_CHECK_FLOAT(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k_cache dtype ", k.scalar_type(), " must match q dtype ",
              q.scalar_type());
  FR_CHECK_DTYPE(bt, at::kLong, "block_tables");
  FR_CHECK_DTYPE(ctx, at::kLong, "ctx_lens");
  FR_CHECK_DTYPE(start, at::kLong, "span_start");
  FR_CHECK_DTYPE(lse, at::kFloat, "lse");
  FR_CHECK_DTYPE(amax, at::kFloat, "amax");
  const auto dev = q.device();
  FR_CHECK_DEVICE(k, dev, "k_cache");
  FR_CHECK_DEVICE(bt, dev, "block_tables");
  FR_CHECK_DEVICE(ctx, dev, "ctx_lens");
  FR_CHECK_DEVICE(start, dev, "span_start");
  FR_CHECK_DEVICE(lse, dev, "lse");
  FR_CHECK_DEVICE(amax, dev, "amax");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0);
  TORCH_CHECK(k.size(2) == D, "k_cache head dim ", k.size(2), " must match q head dim ", D);
  TORCH_CHECK(k.stride(2) == 1, "k_cache must have a contiguous head dim");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "q heads (", H, ") must be a multiple of k_cache heads (", Hkv, ")");
  TORCH_CHECK(block_size > 0 && k.size(1) % block_size == 0, "k_cache slots (", k.size(1),
              ") must be a positive multiple of block_size (", block_size, ")");
  TORCH_CHECK(bt.size(0) == B, "block_tables must have ", B, " rows, got ", bt.sizes());
  TORCH_CHECK(ctx.size(0) == B, "ctx_lens must have shape [", B, "], got ", ctx.sizes());
  TORCH_CHECK(start.size(0) == B, "span_start must have shape [", B, "], got ", start.sizes());
  TORCH_CHECK(lse.size(0) == B && lse.size(1) == H, "lse must have shape [", B, ", ", H, "], got ", lse.sizes());
  const int64_t L = bt.size(1) * block_size;
  TORCH_CHECK(amax.size(0) == B && amax.size(1) == H, "amax must have shape [", B, ", ", H, ", span], got ",
              amax.sizes());
  TORCH_CHECK(amax.size(2) <= L, "amax span ", amax.size(2), " is longer than the cache the block tables address (",
              L, " keys)");
  TORCH_CHECK(amax.is_contiguous(), "amax must be contiguous (it is updated in place)");
  if (row.has_value()) check_out_buf(*row, "row", {B, L}, at::kFloat, dev);
}

}  // namespace fastrag::glue
