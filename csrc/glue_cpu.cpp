// CPU host glue for the issue-3 kernels (decode_cpu.cpp): checks, contiguity, dtype dispatch.
#include "glue.h"

#include "glue_common.h"
#include "signals_cpu.h"

namespace fastrag::glue {
namespace {

#define FR_CHECK_CPU(x, name) TORCH_CHECK((x).device().is_cpu(), name " must be a CPU tensor, got ", (x).device())

template <typename Fn>
void dispatch_float(at::ScalarType dt, Fn&& fn) {
  if (dt == at::kFloat) {
    fn(float{});
  } else if (dt == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    fn(c10::Half{});
  }
}

}  // namespace

void decode_signals(torch::Tensor logits, double temperature, std::optional<torch::Tensor> rng_keys,
                    std::optional<torch::Tensor> chosen, std::optional<torch::Tensor> nonstop,
                    torch::Tensor out_chosen, torch::Tensor out_entropy, torch::Tensor out_logprob,
                    torch::Tensor out_prob, std::optional<torch::Tensor> out_flag, double top_p) {
  FR_CHECK_CPU(logits, "logits");
  check_decode_args(logits, temperature, top_p, rng_keys, chosen, nonstop, out_chosen, out_entropy, out_logprob,
                    out_prob, out_flag);
  const int64_t B = logits.size(0), V = logits.size(1);
  logits = logits.contiguous();
  torch::Tensor ch, keys, ns;
  if (chosen.has_value()) {
    ch = chosen->contiguous();
    const int64_t* c = ch.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(c[b] >= 0 && c[b] < V, "chosen[", b, "] = ", c[b], " is outside the vocabulary [0, ", V, ")");
  }
  const bool sample = temperature > 0.0 && !chosen.has_value();
  if (sample) keys = rng_keys->contiguous();
  if (nonstop.has_value()) ns = nonstop->contiguous();
  const int64_t* cp = ch.defined() ? ch.data_ptr<int64_t>() : nullptr;
  const int64_t* kp = keys.defined() ? keys.data_ptr<int64_t>() : nullptr;
  const uint8_t* np = ns.defined() ? reinterpret_cast<const uint8_t*>(ns.data_ptr<bool>()) : nullptr;
  uint8_t* fp = ns.defined() ? reinterpret_cast<uint8_t*>(out_flag->data_ptr<bool>()) : nullptr;
  dispatch_float(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    fastrag::decode_signals_cpu(logits.data_ptr<T>(), B, V, static_cast<float>(temperature),
                                static_cast<float>(top_p), sample, kp, cp, np,
                                out_chosen.data_ptr<int64_t>(), out_entropy.data_ptr<float>(),
                                out_logprob.data_ptr<float>(), out_prob.data_ptr<float>(), fp);
  });
}

void attn_decode_update(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables, torch::Tensor ctx_lens,
                        torch::Tensor span_start, torch::Tensor lse, int64_t block_size, double scale,
                        torch::Tensor amax, std::optional<torch::Tensor> row) {
  FR_CHECK_CPU(q, "q");
  if (block_tables.scalar_type() == at::kInt) block_tables = block_tables.to(at::kLong);
  check_attn_decode_args(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, amax, row);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  const int64_t NB = block_tables.size(1), L = NB * block_size;
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  span_start = span_start.contiguous();
  lse = lse.contiguous();
  const int64_t* n = ctx_lens.data_ptr<int64_t>();
  const int64_t* s0 = span_start.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(n[b] >= 0 && n[b] <= L, "ctx_lens[", b, "] = ", n[b], " is outside [0, ", L, "]");
    TORCH_CHECK(s0[b] >= 0 && s0[b] <= L, "span_start[", b, "] = ", s0[b], " is outside [0, ", L, "]");
  }
  dispatch_float(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    fastrag::attn_decode_update_cpu(q.data_ptr<T>(), k_cache.data_ptr<T>(), k_cache.stride(0), k_cache.stride(1),
                                    block_tables.data_ptr<int64_t>(), n, s0, lse.data_ptr<float>(), B, H, Hkv, D,
                                    NB, k_cache.size(1) / block_size, block_size, amax.size(2),
                                    static_cast<float>(scale), amax.data_ptr<float>(),
                                    row.has_value() ? row->data_ptr<float>() : nullptr);
  });
}

torch::Tensor causal_attn_rows(torch::Tensor q, torch::Tensor k, torch::Tensor lengths, torch::Tensor rows,
                               double scale, std::optional<torch::Tensor> out) {
  FR_CHECK_CPU(q, "q");
  FR_CHECK_CPU(k, "k");
  FR_CHECK_CPU(lengths, "lengths");
  FR_CHECK_CPU(rows, "rows");
  FR_CHECK_DIM(q, 4, "q");
  FR_CHECK_DIM(k, 4, "k");
  FR_CHECK_DIM(rows, 2, "rows");
  FR_CHECK_DTYPE(q, at::kFloat, "q");
  FR_CHECK_DTYPE(k, at::kFloat, "k");
  FR_CHECK_DTYPE(lengths, at::kLong, "lengths");
  FR_CHECK_DTYPE(rows, at::kLong, "rows");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), R = rows.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D, "k must have shape [", B, ", Hkv, ", T, ", ", D,
              "], got ", k.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "q heads (", H, ") must be a multiple of k heads (", Hkv, ")");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B, "lengths must have shape [", B, "], got ", lengths.sizes());
  TORCH_CHECK(rows.size(0) == B, "rows must have ", B, " rows, got ", rows.sizes());
  q = q.contiguous();
  k = k.contiguous();
  lengths = lengths.contiguous();
  rows = rows.contiguous();
  const int64_t* n = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(n[b] >= 0 && n[b] <= T, "lengths[", b, "] = ", n[b], " is outside [0, ", T, "]");
  torch::Tensor o = out.has_value() ? *out : torch::empty({B, R, T}, q.options());
  check_out_buf(o, "out", {B, R, T}, at::kFloat, q.device());
  fastrag::causal_attn_rows_cpu(q.data_ptr<float>(), k.data_ptr<float>(), n, rows.data_ptr<int64_t>(), B, H, Hkv, T,
                                D, R, static_cast<float>(scale), o.data_ptr<float>());
  return o;
}

}  // namespace fastrag::glue
