// BM25 best_fields search over bm25s' saved score matrices (fastrag/retrieval/bm25.py, `_search_native`).
//
// bm25s stores each field's BM25 scores as a CSC matrix: the postings of term t are indices[indptr[t]:indptr[t+1]]
// (passage numbers) with their scores in data[...]. A query's score in a field is the float32 sum of its terms'
// postings, added in the query's term order (numpy's zeros + np.add.at over the concatenated postings, the
// reference path, adds in that same order, so the sums agree to the bit). Two fields combine as
// double(max) + float32(tie_breaker * min), numpy's dtypes for `hi.astype(float64) + tie_breaker * lo`; passages
// scoring > 0 are ranked by (score descending, passage number ascending) and the first k kept.
//
// The sums go into a caller-owned scratch [2, N] float32 and a mark [N] uint8, both all zero and left so. A query
// whose postings reach less than an eighth of the corpus visits only the passages it touched; a denser one (most
// real queries: common terms) combines the fields in one sequential sweep of the scratch in blocks, each skipped
// unless its best passage beats the worst of the k kept. The numpy path instead makes two dense [N] score vectors
// and about ten dense passes to combine them (benchmarks/results/bm25_scale_cpu.md: 3.4x at 1M passages). The GIL
// is released while it runs (searches run on a thread beside the decode steps).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "glue.h"

namespace fastrag::glue {

namespace {

struct Field {
  const float* data = nullptr;
  const void* indices = nullptr;
  const void* indptr = nullptr;
  bool idx64 = false, ptr64 = false;
  int64_t vocab = 0;  // number of terms (indptr has vocab + 1 entries)
  const int64_t* terms = nullptr;
  const int64_t* offsets = nullptr;

  int64_t ptr(int64_t t) const {
    return ptr64 ? static_cast<const int64_t*>(indptr)[t] : static_cast<const int32_t*>(indptr)[t];
  }
  int64_t doc(int64_t j) const {
    return idx64 ? static_cast<const int64_t*>(indices)[j] : static_cast<const int32_t*>(indices)[j];
  }
};

// double(max) + float32(tie_breaker * min): numpy's `hi.astype(float64) + tie_breaker * lo` (a Python float times a
// float32 array is a float32 product)
inline double combine(float s0, float s1, float tb) {
  const float lo_weighted = tb * std::min(s0, s1);
  return static_cast<double>(std::max(s0, s1)) + static_cast<double>(lo_weighted);
}

// The k best (score, passage) pairs offered, by score descending then passage ascending, of those scoring > 0:
// a heap whose top is the worst kept.
class TopK {
 public:
  explicit TopK(int64_t k) : k_(static_cast<size_t>(k)) {}
  void clear() { heap_.clear(); }
  // what a score must exceed to be kept by a passage after every one kept so far: 0 until k are kept, then the
  // worst kept score
  double floor() const { return heap_.size() < k_ ? 0.0 : heap_.front().first; }
  void offer(double score, int64_t d) {
    if (!(score > 0.0)) return;
    const std::pair<double, int64_t> x{score, d};
    if (heap_.size() < k_) {
      heap_.push_back(x);
      std::push_heap(heap_.begin(), heap_.end(), better);
    } else if (better(x, heap_.front())) {
      std::pop_heap(heap_.begin(), heap_.end(), better);
      heap_.back() = x;
      std::push_heap(heap_.begin(), heap_.end(), better);
    }
  }
  const std::vector<std::pair<double, int64_t>>& sorted() {
    std::sort_heap(heap_.begin(), heap_.end(), better);  // (ascending in `better`'s order: best first)
    return heap_;
  }

 private:
  // a is better than b: a higher score, or the same score and an earlier passage
  static bool better(const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
  size_t k_;
  std::vector<std::pair<double, int64_t>> heap_;
};

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> bm25_best_fields(std::vector<torch::Tensor> data,
                                                           std::vector<torch::Tensor> indices,
                                                           std::vector<torch::Tensor> indptr,
                                                           std::vector<torch::Tensor> terms,
                                                           std::vector<torch::Tensor> offsets, torch::Tensor scratch,
                                                           torch::Tensor mark, double tie_breaker, int64_t k) {
  constexpr int F = 2;
  TORCH_CHECK(data.size() == F && indices.size() == F && indptr.size() == F && terms.size() == F &&
                  offsets.size() == F,
              "data, indices, indptr, terms and offsets must each hold one tensor per field (2)");
  TORCH_CHECK(k > 0, "k must be positive, got ", k);
  TORCH_CHECK(scratch.device().is_cpu() && scratch.scalar_type() == at::kFloat && scratch.dim() == 2 &&
                  scratch.size(0) == F && scratch.is_contiguous(),
              "scratch must be a contiguous CPU float32 tensor [2, N], got ", scratch.scalar_type(), " ",
              scratch.sizes());
  const int64_t N = scratch.size(1);
  TORCH_CHECK(mark.device().is_cpu() && mark.scalar_type() == at::kByte && mark.dim() == 1 && mark.size(0) == N &&
                  mark.is_contiguous(),
              "mark must be a contiguous CPU uint8 tensor [", N, "], got ", mark.scalar_type(), " ", mark.sizes());
  int64_t Q = -1;
  Field fields[F];
  for (int f = 0; f < F; ++f) {
    const std::string at = "field " + std::to_string(f) + ": ";
    for (const torch::Tensor* t : {&data[f], &indices[f], &indptr[f], &terms[f], &offsets[f]})
      TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->is_contiguous(), at,
                  "data, indices, indptr, terms and offsets must be contiguous 1-d CPU tensors");
    TORCH_CHECK(data[f].scalar_type() == at::kFloat, at, "data must be float32, got ", data[f].scalar_type());
    const auto it = indices[f].scalar_type(), pt = indptr[f].scalar_type();
    TORCH_CHECK(it == at::kInt || it == at::kLong, at, "indices must be int32 or int64, got ", it);
    TORCH_CHECK(pt == at::kInt || pt == at::kLong, at, "indptr must be int32 or int64, got ", pt);
    TORCH_CHECK(indices[f].size(0) == data[f].size(0), at, "indices (", indices[f].size(0), ") and data (",
                data[f].size(0), ") must have one entry per posting");
    TORCH_CHECK(indptr[f].size(0) >= 1, at, "indptr must have vocab + 1 entries");
    TORCH_CHECK(terms[f].scalar_type() == at::kLong && offsets[f].scalar_type() == at::kLong, at,
                "terms and offsets must be int64");
    TORCH_CHECK(offsets[f].size(0) >= 1, at, "offsets must have one entry per query, and one more");
    if (Q < 0) Q = offsets[f].size(0) - 1;
    TORCH_CHECK(offsets[f].size(0) - 1 == Q, at, "offsets describe ", offsets[f].size(0) - 1, " queries, field 0 ",
                Q);
    Field& fd = fields[f];
    fd.data = data[f].data_ptr<float>();
    fd.indices = indices[f].data_ptr();
    fd.indptr = indptr[f].data_ptr();
    fd.idx64 = it == at::kLong;
    fd.ptr64 = pt == at::kLong;
    fd.vocab = indptr[f].size(0) - 1;
    fd.terms = terms[f].data_ptr<int64_t>();
    fd.offsets = offsets[f].data_ptr<int64_t>();
    const int64_t T = terms[f].size(0);
    TORCH_CHECK(fd.offsets[0] == 0 && fd.offsets[Q] == T, at, "offsets must run from 0 to len(terms) = ", T);
    for (int64_t q = 0; q < Q; ++q)
      TORCH_CHECK(fd.offsets[q] <= fd.offsets[q + 1], at, "offsets must not decrease (query ", q, ")");
    for (int64_t i = 0; i < T; ++i)
      TORCH_CHECK(fd.terms[i] >= 0 && fd.terms[i] < fd.vocab, at, "term id ", fd.terms[i], " is outside [0, ",
                  fd.vocab, ")");
    const int64_t nnz = data[f].size(0);
    TORCH_CHECK(fd.ptr(0) >= 0 && fd.ptr(fd.vocab) <= nnz, at, "indptr must lie in [0, ", nnz, "]");
  }
  torch::Tensor ids = torch::full({Q, k}, -1, torch::dtype(torch::kLong));
  torch::Tensor scores = torch::zeros({Q, k}, torch::dtype(torch::kDouble));
  int64_t* out_id = ids.data_ptr<int64_t>();
  double* out_score = scores.data_ptr<double>();
  float* acc = scratch.data_ptr<float>();
  uint8_t* seen = mark.data_ptr<uint8_t>();
  const float tb = static_cast<float>(tie_breaker);  // (numpy: a Python float times a float32 array is float32)
  int64_t bad_doc = -1, bad_field = -1;
  {
    pybind11::gil_scoped_release no_gil;
    std::vector<int64_t> touched;
    TopK best(k);
    for (int64_t q = 0; q < Q && bad_doc < 0; ++q) {
      // A query whose postings cover a good share of the corpus is combined in one sequential sweep of the
      // scratch (the touched list would visit its entries in scattered order); a sparser one visits only the
      // passages it touched, in the order it touched them.
      int64_t postings = 0;
      for (int f = 0; f < F; ++f)
        for (int64_t i = fields[f].offsets[q]; i < fields[f].offsets[q + 1]; ++i)
          postings += fields[f].ptr(fields[f].terms[i] + 1) - fields[f].ptr(fields[f].terms[i]);
      const bool sweep = postings * 8 > N;
      touched.clear();
      for (int f = 0; f < F && bad_doc < 0; ++f) {
        const Field& fd = fields[f];
        float* a = acc + f * N;
        for (int64_t i = fd.offsets[q]; i < fd.offsets[q + 1] && bad_doc < 0; ++i) {
          const int64_t t = fd.terms[i], end = fd.ptr(t + 1);
          for (int64_t j = fd.ptr(t); j < end; ++j) {
            const int64_t d = fd.doc(j);
            if (d < 0 || d >= N) {
              bad_doc = d;
              bad_field = f;
              break;
            }
            a[d] += fd.data[j];
            if (!sweep && !seen[d]) {
              seen[d] = 1;
              touched.push_back(d);
            }
          }
        }
      }
      best.clear();
      if (sweep) {
        // blocks of combined scores (a loop the compiler vectorises), then a scan of each block against the worst
        // score kept, which rarely passes once k are kept: passages come in ascending order, so one that only ties
        // the worst kept comes later than it and loses the tie
        constexpr int64_t kBlock = 1024;
        double block[kBlock];
        for (int64_t d0 = 0; d0 < N; d0 += kBlock) {
          const int64_t m = std::min(kBlock, N - d0);
          const float* a0 = acc + d0;
          const float* a1 = acc + N + d0;
          double top = 0.0;
#pragma omp simd reduction(max : top)
          for (int64_t i = 0; i < m; ++i) {
            block[i] = combine(a0[i], a1[i], tb);
            top = std::max(top, block[i]);
          }
          double floor = best.floor();
          if (!(top > floor)) continue;  // (the common case once k are kept: nothing in the block is)
          for (int64_t i = 0; i < m; ++i) {
            if (block[i] > floor) {
              best.offer(block[i], d0 + i);
              floor = best.floor();
            }
          }
        }
        std::fill(acc, acc + F * N, 0.0f);
      } else {
        for (const int64_t d : touched) {
          const float s0 = acc[d], s1 = acc[N + d];
          acc[d] = 0.0f;
          acc[N + d] = 0.0f;
          seen[d] = 0;
          best.offer(combine(s0, s1, tb), d);
        }
      }
      const auto& kept = best.sorted();
      for (size_t r = 0; r < kept.size(); ++r) {
        out_id[q * k + static_cast<int64_t>(r)] = kept[r].second;
        out_score[q * k + static_cast<int64_t>(r)] = kept[r].first;
      }
    }
    if (bad_doc >= 0) {  // (a query stopped part-way: set back what it wrote, so the scratch stays all zero)
      for (int64_t d = 0; d < N; ++d) {
        acc[d] = 0.0f;
        acc[N + d] = 0.0f;
        seen[d] = 0;
      }
    }
  }
  TORCH_CHECK(bad_doc < 0, "field ", bad_field, ": a posting names passage ", bad_doc, ", outside [0, ", N,
              "): the index does not match its corpus");
  return {ids, scores};
}

}  // namespace fastrag::glue
