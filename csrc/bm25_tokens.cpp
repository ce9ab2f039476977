// The token scan of a BM25 index build (fastrag/retrieval/bm25_build.py, `analyse_passages`).
//
// The passages' terms are the matches of `\w+|[Han, hiragana]` in each passage lowered, with its Han and hiragana
// characters stood apart by spaces (bm25s's tokenizer with the project's pattern): every run of word characters,
// one-character runs included, as Elasticsearch's standard tokenizer keeps them. Python's regex engine finds them
// and makes a str object of each, which then has to be looked up in dicts in Python: bm25s's tokenizer took 1.29 s
// for a chunk of 20,000 DPR-shaped passages (both fields, 2-core VM). Here one pass over the code points finds the
// same tokens and numbers them in a hash table of its own: the caller gets each distinct token once, as a str, in
// the order first seen, and every token's number. The chunk then takes 0.40 s in all, stemming included.
//
// `\w` is Python's: a code point that str.isalnum() accepts (Py_UNICODE_ISALNUM: alphabetic, decimal, digit or
// numeric) or '_'. A Han or hiragana code point is a token of its own whatever its class (the pattern's second
// branch; the spaces put round it end the word before and after). Each text gets those spaces and is then lowered
// (str.lower(): its final-sigma rule looks at neighbours, so it runs on the spaced text, as bm25s's does).
// tests/test_bm25_tokens.py compares the tokens with the regex's on random text drawn from every plane.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "glue.h"

namespace fastrag::glue {

namespace {

inline bool is_spaced(Py_UCS4 c) {  // bm25_build._CJK
  return (c >= 0x3040 && c <= 0x309f) || (c >= 0x3400 && c <= 0x4dbf) || (c >= 0x4e00 && c <= 0x9fff) ||
         (c >= 0xf900 && c <= 0xfaff);
}

struct Latin1Word {  // \w for the code points below 256, the only ones in most passages
  bool w[256];
  Latin1Word() {
    for (int c = 0; c < 256; ++c) w[c] = Py_UNICODE_ISALNUM(static_cast<Py_UCS4>(c)) || c == '_';
  }
};
const Latin1Word kLatin1;

inline bool is_word(Py_UCS4 c) { return c < 256 ? kLatin1.w[c] : (Py_UNICODE_ISALNUM(c) || c == '_'); }

// Open addressing, linear probing, at most half full. A slot holds a token's number + 1 (0: empty); the tokens'
// code points lie end to end in `chars`.
class Vocab {
 public:
  Vocab() : slots_(1 << 16, 0), hashes_(1 << 16, 0) {}

  // The number of chars[start:], a token just appended, appending it to the table if new (else dropping it).
  int32_t intern(size_t start, uint64_t h) {
    const size_t len = chars.size() - start;
    size_t mask = slots_.size() - 1, i = h & mask;
    while (uint32_t s = slots_[i]) {
      const uint32_t id = s - 1;
      if (hashes_[i] == h && lens[id] == len &&
          std::memcmp(&chars[starts[id]], &chars[start], len * sizeof(Py_UCS4)) == 0) {
        chars.resize(start);
        return static_cast<int32_t>(id);
      }
      i = (i + 1) & mask;
    }
    const uint32_t id = static_cast<uint32_t>(starts.size());
    starts.push_back(start);
    lens.push_back(static_cast<uint32_t>(len));
    slots_[i] = id + 1;
    hashes_[i] = h;
    if (2 * starts.size() > slots_.size()) grow();
    return static_cast<int32_t>(id);
  }

  std::vector<Py_UCS4> chars;
  std::vector<size_t> starts;
  std::vector<uint32_t> lens;

 private:
  void grow() {
    std::vector<uint32_t> slots(2 * slots_.size(), 0);
    std::vector<uint64_t> hashes(slots.size(), 0);
    const size_t mask = slots.size() - 1;
    for (size_t j = 0; j < slots_.size(); ++j) {
      if (!slots_[j]) continue;
      size_t i = hashes_[j] & mask;
      while (slots[i]) i = (i + 1) & mask;
      slots[i] = slots_[j];
      hashes[i] = hashes_[j];
    }
    slots_.swap(slots);
    hashes_.swap(hashes);
  }

  std::vector<uint32_t> slots_;
  std::vector<uint64_t> hashes_;
};

inline uint64_t mix(uint64_t h, Py_UCS4 c) { return (h ^ c) * 0x100000001b3ULL; }       // FNV-1a a code point
inline uint64_t finish(uint64_t h) { h ^= h >> 29; h *= 0xbf58476d1ce4e5b9ULL; return h ^ (h >> 32); }

template <typename T>
void scan(const T* s, Py_ssize_t n, Vocab& v, std::vector<int32_t>& ids) {
  Py_ssize_t i = 0;
  while (i < n) {
    const Py_UCS4 c = s[i];
    if (sizeof(T) > 1 && is_spaced(c)) {  // (no Han or hiragana below 256)
      const size_t start = v.chars.size();
      v.chars.push_back(c);
      ids.push_back(v.intern(start, finish(mix(0xcbf29ce484222325ULL, c))));
      ++i;
      continue;
    }
    if (!is_word(c)) {
      ++i;
      continue;
    }
    Py_ssize_t j = i + 1;
    while (j < n && is_word(s[j]) && !(sizeof(T) > 1 && is_spaced(s[j]))) ++j;
    const size_t start = v.chars.size();  // (a run of any length is a token: `\w+`, not `\w\w+`)
    uint64_t h = 0xcbf29ce484222325ULL;
    for (Py_ssize_t k = i; k < j; ++k) {
      v.chars.push_back(s[k]);
      h = mix(h, s[k]);
    }
    ids.push_back(v.intern(start, finish(h)));
    i = j;
  }
}

// `text` with a space before and after each Han or hiragana code point (bm25_build.analyse's re.sub), or a new
// reference to `text` itself when it holds none.
PyObject* spaced(PyObject* text) {
  const int kind = PyUnicode_KIND(text);
  const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
  const void* data = PyUnicode_DATA(text);
  Py_ssize_t found = 0;
  if (kind != PyUnicode_1BYTE_KIND)
    for (Py_ssize_t i = 0; i < n; ++i) found += is_spaced(PyUnicode_READ(kind, data, i));
  if (!found) {
    Py_INCREF(text);
    return text;
  }
  std::vector<Py_UCS4> out;
  out.reserve(static_cast<size_t>(n + 2 * found));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const Py_UCS4 c = PyUnicode_READ(kind, data, i);
    if (is_spaced(c)) {
      out.push_back(' ');
      out.push_back(c);
      out.push_back(' ');
    } else {
      out.push_back(c);
    }
  }
  return PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, out.data(), static_cast<Py_ssize_t>(out.size()));
}

}  // namespace

py::tuple bm25_tokens(py::sequence texts) {
  const Py_ssize_t n = static_cast<Py_ssize_t>(py::len(texts));
  Vocab v;
  std::vector<int32_t> ids;
  torch::Tensor counts = torch::empty({n}, torch::kInt64);
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (Py_ssize_t t = 0; t < n; ++t) {
    py::object o = texts[t];
    TORCH_CHECK(PyUnicode_Check(o.ptr()), "texts[", t, "] must be a str, got ", Py_TYPE(o.ptr())->tp_name);
    // (str.lower of the spaced text, as bm25s lowers what analyse hands it)
    py::object s = py::reinterpret_steal<py::object>(spaced(o.ptr()));
    if (!s) throw py::error_already_set();
    o = py::reinterpret_steal<py::object>(PyObject_CallMethod(s.ptr(), "lower", nullptr));
    if (!o) throw py::error_already_set();
    PyObject* p = o.ptr();
    const Py_ssize_t len = PyUnicode_GET_LENGTH(p);
    const size_t before = ids.size();
    switch (PyUnicode_KIND(p)) {
      case PyUnicode_1BYTE_KIND: scan(PyUnicode_1BYTE_DATA(p), len, v, ids); break;
      case PyUnicode_2BYTE_KIND: scan(PyUnicode_2BYTE_DATA(p), len, v, ids); break;
      default: scan(PyUnicode_4BYTE_DATA(p), len, v, ids); break;
    }
    cnt[t] = static_cast<int64_t>(ids.size() - before);
  }
  py::list distinct(v.starts.size());
  for (size_t d = 0; d < v.starts.size(); ++d) {
    PyObject* s = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, &v.chars[v.starts[d]], v.lens[d]);
    if (s == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(distinct.ptr(), static_cast<Py_ssize_t>(d), s);
  }
  torch::Tensor out = torch::empty({static_cast<int64_t>(ids.size())}, torch::kInt32);
  if (!ids.empty()) std::memcpy(out.data_ptr<int32_t>(), ids.data(), ids.size() * sizeof(int32_t));
  return py::make_tuple(distinct, out, counts);
}

}  // namespace fastrag::glue
