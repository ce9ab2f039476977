// Decode attention over the paged KV cache on the CPU: one new query per sequence attends to the run-wide shared
// prefix and to its own blocks, read in place from the pool (no gathered copy of the context).
//
// Registered as the torch operator `fastrag::paged_decode_attention` (TORCH_LIBRARY), so it needs no entry in
// bindings.cpp; Python reaches it as torch.ops.fastrag.paged_decode_attention after `import fastrag._C`.
//
//   q:            [B, H, D] float32 (the new token's query, rotary already applied)
//   k_pool/v_pool:[Hkv, num_slots, D] float32, last dim contiguous
//   prefix_slots: [P] int64, pool slots of the shared prefix (P may be 0)
//   ctx_blocks:   [B, NB] int64, each sequence's blocks after the prefix (padded rows are never read)
//   ctx_lens:     [B] int64, context entries of each sequence (the new token included)
//   returns       [B, H, D] float32: softmax(q . k * scale) @ v over the prefix followed by the context
//
// `paged_decode_attention_lse` takes the same arguments and also returns lse [B, H] = log sum exp of the scores,
// so a caller can merge this part with attention over other keys (the engine computes the shared prefixes of a
// decode batch as one GEMM per prefix and merges them with each sequence's own context here). A sequence with no
// key at all (P = 0, ctx_lens[b] = 0) gets out = 0 and lse = -inf, the neutral element of that merge.
//
// Work item = (kv head, sequence): the G = H / Hkv query heads of a group share each key/value row, so every row
// is read once per sequence; items of one kv head are adjacent, so that head's prefix stays in cache across the
// batch. Scores are kept per item (at most G x (P + ctx) floats), then exp-normalised in one vectorised pass.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "row_softmax.h"

namespace {

// dot/axpy/exp are inlined into attend_item, which is the one function compiled per ISA (dispatch once per item,
// not once per key row).
inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline __attribute__((always_inline)) void axpy(float* y, float w, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

using fastrag::row_softmax::exp_nonpos;  // (row_softmax.h)

// An item with no key (P = 0, own length 0): out = 0, lse = -inf, the neutral element of an LSE merge.
inline void no_keys(float* og, int64_t G, int64_t D, float* lse) {
  std::fill(og, og + G * D, 0.f);
  if (lse)
    for (int64_t h = 0; h < G; ++h) lse[h] = -std::numeric_limits<float>::infinity();
}

// Element offset inside one kv head's slab of each key/value row: the prefix slots, then the sequence's blocks.
inline void row_offsets(std::vector<int64_t>& rows, const int64_t* pre_p, int64_t P, const int64_t* blocks,
                        int64_t n, int64_t block_size, int64_t ss) {
  rows.resize(P + n);
  for (int64_t j = 0; j < P; ++j) rows[j] = pre_p[j] * ss;
  for (int64_t i = 0; i < n; ++i) rows[P + i] = (blocks[i / block_size] * block_size + i % block_size) * ss;
}

// Scores sp [G, L] -> exp((s - max) * sc) in place; den[h] = their sum; lse[h] (when asked) = log sum exp(s * sc).
inline __attribute__((always_inline)) void exp_normalise(float* sp, int64_t L, int64_t G, float sc, float* den,
                                                         float* lse) {
  for (int64_t h = 0; h < G; ++h) {
    float* sh_ = sp + h * L;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < L; ++j) mx = std::max(mx, sh_[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < L; ++j) {
      const float e = exp_nonpos((sh_[j] - mx) * sc);
      sh_[j] = e;
      sum += e;
    }
    den[h] = sum;
    if (lse) lse[h] = mx * sc + std::log(sum);
  }
}

// Rows of one sequence lie in blocks of block_size rows scattered over the pool; the hardware prefetcher does not
// follow a jump to the next block, so each row loop asks for the row kPrefetch ahead itself (it brings the kernel
// close to the machine's read bandwidth: docs/performance.md).
constexpr int64_t kPrefetch = 8;

inline __attribute__((always_inline)) void prefetch_row(const float* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(float)); c += 64) __builtin_prefetch(p + c);
}

// One (kv head, sequence) item: scores of the G query heads against every key row (each row loaded once for the
// G heads), a max per head, exp-normalise in one vectorised pass, then the weighted sum of value rows.
FASTRAG_CLONES void attend_item(const float* qg, const float* kh, const float* vh, float* og, const int64_t* pre_p,
                                int64_t P, const int64_t* blocks, int64_t n, int64_t block_size, int64_t ss,
                                int64_t G, int64_t D, float sc, std::vector<float>& s, std::vector<float>& den,
                                std::vector<int64_t>& rows, float* lse) {
  const int64_t L = P + n;
  if (L == 0) {
    no_keys(og, G, D, lse);
    return;
  }
  row_offsets(rows, pre_p, P, blocks, n, block_size, ss);
  s.resize(G * L);
  float* sp = s.data();
  for (int64_t j = 0; j < L; ++j) {
    const float* krow = kh + rows[j];
    if (j + kPrefetch < L) prefetch_row(kh + rows[j + kPrefetch], D);
    for (int64_t h = 0; h < G; ++h) sp[h * L + j] = dot(qg + h * D, krow, D);
  }
  den.resize(G);
  exp_normalise(sp, L, G, sc, den.data(), lse);
  std::fill(og, og + G * D, 0.f);
  for (int64_t j = 0; j < L; ++j) {
    const float* vrow = vh + rows[j];
    if (j + kPrefetch < L) prefetch_row(vh + rows[j + kPrefetch], D);
    for (int64_t h = 0; h < G; ++h) axpy(og + h * D, sp[h * L + j], vrow, D);
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.f / den[h];
    for (int64_t d = 0; d < D; ++d) og[h * D + d] *= inv;
  }
}

// The same item with the group size and head dim known at compile time (the common model shapes): the dot
// products unroll fully and the G x D output accumulates in registers instead of memory (1.1-1.5x on top of the
// prefetch). Same arithmetic in the same order as attend_item.
template <int G, int D>
FASTRAG_CLONES void attend_item_fixed(const float* __restrict qg, const float* __restrict kh,
                                      const float* __restrict vh, float* __restrict og, const int64_t* pre_p,
                                      int64_t P, const int64_t* blocks, int64_t n, int64_t block_size, int64_t ss,
                                      float sc, std::vector<float>& s, std::vector<int64_t>& rows, float* lse) {
  const int64_t L = P + n;
  if (L == 0) {
    no_keys(og, G, D, lse);
    return;
  }
  row_offsets(rows, pre_p, P, blocks, n, block_size, ss);
  s.resize(G * L);
  float* __restrict sp = s.data();
  float q[G * D];  // a local copy the compiler keeps in registers across the rows
  for (int i = 0; i < G * D; ++i) q[i] = qg[i];
  for (int64_t j = 0; j < L; ++j) {
    const float* __restrict krow = kh + rows[j];
    if (j + kPrefetch < L) prefetch_row(kh + rows[j + kPrefetch], D);
    for (int h = 0; h < G; ++h) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int d = 0; d < D; ++d) acc += q[h * D + d] * krow[d];
      sp[h * L + j] = acc;
    }
  }
  float den[G];
  exp_normalise(sp, L, G, sc, den, lse);
  float acc[G * D];
  for (int i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    const float* __restrict vrow = vh + rows[j];
    if (j + kPrefetch < L) prefetch_row(vh + rows[j + kPrefetch], D);
    for (int h = 0; h < G; ++h) {
      const float w = sp[h * L + j];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[h * D + d] += w * vrow[d];
    }
  }
  for (int h = 0; h < G; ++h) {
    const float inv = 1.f / den[h];
    for (int d = 0; d < D; ++d) og[h * D + d] = acc[h * D + d] * inv;
  }
}

using FixedItem = void (*)(const float*, const float*, const float*, float*, const int64_t*, int64_t, const int64_t*,
                           int64_t, int64_t, int64_t, float, std::vector<float>&, std::vector<int64_t>&, float*);

// group sizes (H / Hkv) 1-4 and 8 at head dims 64 and 128: Llama-2 (1 x 128), Llama-3 / Mistral (4 x 128),
// SmolLM2-135M/360M (3 x 64), ...; other shapes take attend_item
template <int D>
FixedItem fixed_for_group(int64_t G) {
  switch (G) {
    case 1: return &attend_item_fixed<1, D>;
    case 2: return &attend_item_fixed<2, D>;
    case 3: return &attend_item_fixed<3, D>;
    case 4: return &attend_item_fixed<4, D>;
    case 8: return &attend_item_fixed<8, D>;
    default: return nullptr;
  }
}

FixedItem fixed_item(int64_t G, int64_t D) {
  if (D == 64) return fixed_for_group<64>(G);
  if (D == 128) return fixed_for_group<128>(G);
  return nullptr;
}

void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& prefix_slots, const at::Tensor& ctx_blocks, const at::Tensor& ctx_lens,
                           int64_t block_size, double scale, at::Tensor& out, at::Tensor* lse_out) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_decode_attention: q, k_pool and v_pool must be CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat,
              "paged_decode_attention: q, k_pool and v_pool must be float32");
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [B, H, D], got ", q.dim(), " dims");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode_attention: k_pool and v_pool must both be [Hkv, num_slots, D]");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && k_pool.strides() == v_pool.strides(),
              "paged_decode_attention: k_pool/v_pool last dim must be contiguous and their strides equal");
  TORCH_CHECK(prefix_slots.scalar_type() == at::kLong && ctx_blocks.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong,
              "paged_decode_attention: prefix_slots, ctx_blocks and ctx_lens must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(0), num_slots = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D, "paged_decode_attention: head dim of k_pool (", k_pool.size(2),
              ") != head dim of q (", D, ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_decode_attention: H=", H, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK(ctx_blocks.dim() == 2 && ctx_blocks.size(0) == B, "paged_decode_attention: ctx_blocks must be [B, NB]");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.size(0) == B, "paged_decode_attention: ctx_lens must be [B]");
  TORCH_CHECK(block_size > 0, "paged_decode_attention: block_size must be positive");
  TORCH_CHECK(scale > 0, "paged_decode_attention: scale must be positive, got ", scale);
  const int64_t NB = ctx_blocks.size(1);
  const int64_t P = prefix_slots.numel();

  at::Tensor qc = q.contiguous(), pre = prefix_slots.contiguous(), blk = ctx_blocks.contiguous(),
             lens = ctx_lens.contiguous();
  const int64_t* pre_p = pre.data_ptr<int64_t>();
  const int64_t* blk_p = blk.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i)
    TORCH_CHECK(pre_p[i] >= 0 && pre_p[i] < num_slots, "paged_decode_attention: prefix slot ", pre_p[i],
                " outside the pool (", num_slots, " slots)");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = len_p[b];
    TORCH_CHECK(n >= 0 && n <= NB * block_size, "paged_decode_attention: ctx_lens[", b, "]=", n,
                " exceeds its block table (", NB, " blocks of ", block_size, ")");
    TORCH_CHECK(lse_out != nullptr || n + P > 0, "paged_decode_attention: sequence ", b,
                " has no key to attend to");
    for (int64_t i = 0; i < (n + block_size - 1) / block_size; ++i) {
      const int64_t blkid = blk_p[b * NB + i];
      TORCH_CHECK(blkid >= 0 && (blkid + 1) * block_size <= num_slots, "paged_decode_attention: ctx_blocks[", b,
                  ", ", i, "]=", blkid, " outside the pool");
    }
  }

  out = at::empty({B, H, D}, q.options());
  float* lp = nullptr;
  if (lse_out) {
    *lse_out = at::empty({B, H}, q.options());
    lp = lse_out->data_ptr<float>();
  }
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sh = k_pool.stride(0), ss = k_pool.stride(1);
  const int64_t G = H / Hkv;
  const float sc = static_cast<float>(scale);

  const FixedItem fixed = fixed_item(G, D);
  at::parallel_for(0, Hkv * B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, den;
    std::vector<int64_t> rows;  // element offset of each key/value row inside one kv head's slab
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / B, b = item % B;
      if (fixed) {
        fixed(qp + (b * H + g * G) * D, kp + g * sh, vp + g * sh, op + (b * H + g * G) * D, pre_p, P,
              blk_p + b * NB, len_p[b], block_size, ss, sc, s, rows, lp ? lp + b * H + g * G : nullptr);
        continue;
      }
      attend_item(qp + (b * H + g * G) * D, kp + g * sh, vp + g * sh, op + (b * H + g * G) * D, pre_p, P,
                  blk_p + b * NB, len_p[b], block_size, ss, G, D, sc, s, den, rows,
                  lp ? lp + b * H + g * G : nullptr);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& prefix_slots, const at::Tensor& ctx_blocks,
                                  const at::Tensor& ctx_lens, int64_t block_size, double scale) {
  at::Tensor out;
  decode_attention_impl(q, k_pool, v_pool, prefix_slots, ctx_blocks, ctx_lens, block_size, scale, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(const at::Tensor& q, const at::Tensor& k_pool,
                                                              const at::Tensor& v_pool,
                                                              const at::Tensor& prefix_slots,
                                                              const at::Tensor& ctx_blocks,
                                                              const at::Tensor& ctx_lens, int64_t block_size,
                                                              double scale) {
  at::Tensor out, lse;
  decode_attention_impl(q, k_pool, v_pool, prefix_slots, ctx_blocks, ctx_lens, block_size, scale, out, &lse);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(fastrag, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor prefix_slots, Tensor ctx_blocks, "
        "Tensor ctx_lens, int block_size, float scale) -> Tensor");
  m.def("paged_decode_attention_lse(Tensor q, Tensor k_pool, Tensor v_pool, Tensor prefix_slots, "
        "Tensor ctx_blocks, Tensor ctx_lens, int block_size, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastrag, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_lse", &paged_decode_attention_lse);
}
