// Python bindings of fastrag._C: host glue only (argument checks, dtype dispatch, output allocation).
// Kernels live in signals_cpu.cpp / decode_cpu.cpp (CPU) and *.cu (CUDA, device code free of torch headers);
// the glue of the issue-3 entry points is in glue_cpu.cpp / glue_cuda.cpp. Every check names the offending argument; the Python launchers in
// fastrag/signals/ validate first with ValueError, these TORCH_CHECKs guard direct callers of fastrag._C.
#include <torch/extension.h>

#include <optional>
#include <tuple>

#include "glue.h"
#include "signals_cpu.h"

namespace {

// `name` is the Python argument name, so messages point at what the caller passed.
#define CHECK_CPU(x, name) TORCH_CHECK((x).device().is_cpu(), name " must be a CPU tensor, got ", (x).device())
#define CHECK_DIM(x, n, name) TORCH_CHECK((x).dim() == (n), name " must have ", (n), " dims, got shape ", (x).sizes())
#define CHECK_DTYPE(x, t, name) \
  TORCH_CHECK((x).scalar_type() == (t), name " must be ", (t), ", got ", (x).scalar_type())

// An output buffer must be written in place, so it must already be contiguous (no silent copy).
void check_out(const torch::Tensor& out, const char* name, at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(out.device().is_cpu(), name, " must be a CPU tensor, got ", out.device());
  TORCH_CHECK(out.sizes() == shape, name, " must have shape ", shape, ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == dtype, name, " must be ", dtype, ", got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), name, " must be contiguous");
}

// logits: [B, V] fp32/bf16/fp16; chosen: [B] int64 or None. Returns (entropy [B] f32, logprob [B] f32, argmax [B] i64).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> token_signals(
    torch::Tensor logits, std::optional<torch::Tensor> chosen, double temperature,
    std::optional<torch::Tensor> entropy, std::optional<torch::Tensor> logprob, std::optional<torch::Tensor> argmax) {
  CHECK_CPU(logits, "logits");
  CHECK_DIM(logits, 2, "logits");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(temperature > 0.0, "temperature must be > 0, got ", temperature);
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits must have a non-empty vocabulary dimension");
  logits = logits.contiguous();
  torch::Tensor ch;
  if (chosen.has_value()) {
    ch = chosen.value();
    CHECK_CPU(ch, "chosen");
    CHECK_DIM(ch, 1, "chosen");
    CHECK_DTYPE(ch, at::kLong, "chosen");
    TORCH_CHECK(ch.size(0) == B, "chosen must have shape [", B, "], got ", ch.sizes());
    ch = ch.contiguous();
    const int64_t* c = ch.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(c[b] >= 0 && c[b] < V, "chosen[", b, "] = ", c[b], " is outside the vocabulary [0, ", V, ")");
  }
  auto f32 = logits.options().dtype(at::kFloat);
  torch::Tensor ent = entropy.has_value() ? entropy.value() : torch::empty({B}, f32);
  torch::Tensor lp = logprob.has_value() ? logprob.value() : torch::empty({B}, f32);
  torch::Tensor am = argmax.has_value() ? argmax.value() : torch::empty({B}, f32.dtype(at::kLong));
  check_out(ent, "entropy", {B}, at::kFloat);
  check_out(lp, "logprob", {B}, at::kFloat);
  check_out(am, "argmax", {B}, at::kLong);
  const int64_t* cp = ch.defined() ? ch.data_ptr<int64_t>() : nullptr;
  const float t = static_cast<float>(temperature);
  float* e = ent.data_ptr<float>();
  float* l = lp.data_ptr<float>();
  int64_t* a = am.data_ptr<int64_t>();
  if (dt == at::kFloat) {
    fastrag::token_signals_cpu(logits.data_ptr<float>(), cp, B, V, t, e, l, a);
  } else if (dt == at::kBFloat16) {
    fastrag::token_signals_cpu(logits.data_ptr<c10::BFloat16>(), cp, B, V, t, e, l, a);
  } else {
    fastrag::token_signals_cpu(logits.data_ptr<c10::Half>(), cp, B, V, t, e, l, a);
  }
  return {ent, lp, am};
}

// q: [B, H, T, D] f32, k: [B, Hkv, T, D] f32, lengths: [B] int64. Returns [B, T] f32.
torch::Tensor causal_attn_colmax(torch::Tensor q, torch::Tensor k, torch::Tensor lengths, double scale,
                                 std::optional<torch::Tensor> out) {
  CHECK_CPU(q, "q");
  CHECK_CPU(k, "k");
  CHECK_CPU(lengths, "lengths");
  CHECK_DIM(q, 4, "q");
  CHECK_DIM(k, 4, "k");
  CHECK_DIM(lengths, 1, "lengths");
  CHECK_DTYPE(q, at::kFloat, "q");
  CHECK_DTYPE(k, at::kFloat, "k");
  CHECK_DTYPE(lengths, at::kLong, "lengths");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D, "k must have shape [", B, ", Hkv, ", T, ", ", D,
              "], got ", k.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "q heads (", H, ") must be a multiple of k heads (", Hkv, ")");
  TORCH_CHECK(lengths.size(0) == B, "lengths must have shape [", B, "], got ", lengths.sizes());
  q = q.contiguous();
  k = k.contiguous();
  lengths = lengths.contiguous();
  const int64_t* n = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(n[b] >= 0 && n[b] <= T, "lengths[", b, "] = ", n[b], " is outside [0, ", T, "]");
  torch::Tensor o = out.has_value() ? out.value() : torch::empty({B, T}, q.options());
  check_out(o, "out", {B, T}, at::kFloat);
  fastrag::causal_attn_colmax_cpu(q.data_ptr<float>(), k.data_ptr<float>(), n, B, H, Hkv, T, D,
                                  static_cast<float>(scale), o.data_ptr<float>());
  return o;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastrag C++ kernels for retrieval signals (see fastrag/signals/reference.py for definitions)";
  m.def("token_signals", &token_signals, "entropy, logprob of chosen, argmax of softmax(logits / temperature)",
        py::arg("logits"), py::arg("chosen") = py::none(), py::arg("temperature") = 1.0,
        py::arg("entropy") = py::none(), py::arg("logprob") = py::none(), py::arg("argmax") = py::none());
  m.def("causal_attn_colmax", &causal_attn_colmax, "mean over heads of the column max of causal attention",
        py::arg("q"), py::arg("k"), py::arg("lengths"), py::arg("scale"), py::arg("out") = py::none());
  namespace g = fastrag::glue;
  m.def("decode_signals", &g::decode_signals,
        "fused decode-step signals (chosen, entropy, logprob, prob, nonstop flag) of logits [B, V], CPU",
        py::arg("logits"), py::arg("temperature"), py::arg("rng_keys"), py::arg("chosen"), py::arg("nonstop"),
        py::arg("out_chosen"), py::arg("out_entropy"), py::arg("out_logprob"), py::arg("out_prob"),
        py::arg("out_flag"), py::arg("top_p") = 1.0);
  m.def("attn_decode_update", &g::attn_decode_update,
        "running per-head max attention over the generated span (+ QFS row) for one decode step, CPU",
        py::arg("q"), py::arg("k_cache"), py::arg("block_tables"), py::arg("ctx_lens"), py::arg("span_start"),
        py::arg("lse"), py::arg("block_size"), py::arg("scale"), py::arg("amax"), py::arg("row") = py::none());
  m.def("causal_attn_rows", &g::causal_attn_rows, "head-mean causal attention of selected query rows, CPU",
        py::arg("q"), py::arg("k"), py::arg("lengths"), py::arg("rows"), py::arg("scale"),
        py::arg("out") = py::none());
  m.def("bm25_best_fields", &g::bm25_best_fields,
        "BM25 best_fields top-k over two fields' CSC score matrices, work proportional to the postings read, CPU",
        py::arg("data"), py::arg("indices"), py::arg("indptr"), py::arg("terms"), py::arg("offsets"),
        py::arg("scratch"), py::arg("mark"), py::arg("tie_breaker"), py::arg("k"));
  m.def("bm25_tokens", &g::bm25_tokens,
        "the \\w+ and Han/hiragana tokens of texts, numbered: (distinct, ids, counts), CPU",
        py::arg("texts"));
#ifdef FASTRAG_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("decode_signals_cuda", &g::decode_signals_cuda, "fused decode-step signals, CUDA", py::arg("logits"),
        py::arg("temperature"), py::arg("rng_keys"), py::arg("chosen"), py::arg("nonstop"), py::arg("out_chosen"),
        py::arg("out_entropy"), py::arg("out_logprob"), py::arg("out_prob"), py::arg("out_flag"),
        py::arg("num_splits") = 0, py::arg("top_p") = 1.0, py::arg("greedy") = false);
  m.def("attn_decode_update_cuda", &g::attn_decode_update_cuda, "decode attention statistics, CUDA", py::arg("q"),
        py::arg("k_cache"), py::arg("block_tables"), py::arg("ctx_lens"), py::arg("span_start"), py::arg("lse"),
        py::arg("block_size"), py::arg("scale"), py::arg("amax"), py::arg("row") = py::none());
  m.def("causal_attn_stats_cuda", &g::causal_attn_stats_cuda, "prefill attention statistics (colmax, rows), CUDA",
        py::arg("q"), py::arg("k"), py::arg("lengths"), py::arg("scale"), py::arg("colmax") = py::none(),
        py::arg("rows") = py::none(), py::arg("rows_out") = py::none());
#else
  m.attr("with_cuda") = false;
#endif
}
