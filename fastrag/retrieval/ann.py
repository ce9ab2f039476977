"""The faiss index behind dense retrieval: exact or approximate nearest neighbours by inner product.

| index   | faiss class      | build options                          | search options | memory per vector      |
|---------|------------------|----------------------------------------|----------------|------------------------|
| `flat`  | `IndexFlatIP`    | (none: exact, the default)             | (none)         | 4 * dim bytes          |
| `ivf`   | `IndexIVFFlat`   | `nlist` (None: sqrt(n) lists)          | `nprobe`       | 4 * dim + 8            |
| `hnsw`  | `IndexHNSWFlat`  | `M`, `ef_construction`                 | `ef_search`    | 4 * dim + about 8 * M  |
| `ivfpq` | `IndexIVFPQ`     | `nlist`, `m` (divides dim), `nbits`    | `nprobe`       | m * nbits / 8 + 8      |

Defaults: nprobe 16, M 32, ef_construction 40 (faiss's), ef_search 64, nbits 8, m the largest divisor of dim up to
dim / 8 (48 codes of 8 dimensions for a 384-dimensional encoder: fewer, wider sub-vectors lose much of the recall).

The build options shape the saved index, so they are written to the index manifest (a changed one builds the index
again); the search options (`nprobe`, `ef_search`) only set how much of it a search visits, so they apply to a
saved index as it is loaded, without a rebuild. IVF lists are trained (k-means) on at most `TRAIN_PER_LIST` vectors
a list drawn with a fixed seed, so that a build of millions of passages trains in seconds, and the same corpus
always gives the same index. Vectors are added in chunks of `ADD_CHUNK` under a tqdm bar.

On a machine where faiss sees a GPU (`faiss.get_num_gpus() > 0`) flat, ivf and ivfpq indexes are trained, filled and
searched there; HNSW has no GPU version in faiss and stays on the CPU. A GPU that refuses an index (e.g. an ivfpq
code size it does not support) leaves it on the CPU, with a warning.

`recall_vs_exact` measures how many of the exact top-k an index returns (the build records it in the index folder).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "ivf", "hnsw", "ivfpq")
TRAIN_PER_LIST = 64  # k-means training vectors per IVF list (faiss warns under 39)
ADD_CHUNK = 65_536
# the options each index type takes (all others are refused: an option that would be ignored is a mistake)
_BUILD = {"flat": (), "ivf": ("nlist",), "hnsw": ("M", "ef_construction"), "ivfpq": ("nlist", "m", "nbits")}
_SEARCH = {"flat": (), "ivf": ("nprobe",), "hnsw": ("ef_search",), "ivfpq": ("nprobe",)}


@dataclass(frozen=True)
class AnnOptions:
    """How the dense index is built and searched (see the module docstring); a bad value raises ValueError naming
    the option. Options default per index type; one given for another type is refused."""

    index: str = "flat"
    nlist: int | None = None
    nprobe: int | None = None
    M: int | None = None
    ef_construction: int | None = None
    ef_search: int | None = None
    m: int | None = None
    nbits: int | None = None

    def __post_init__(self):
        if self.index not in INDEX_TYPES:
            raise ValueError(f"index {self.index!r}: expected one of {', '.join(INDEX_TYPES)}")
        allowed = _BUILD[self.index] + _SEARCH[self.index]
        defaults = {"nprobe": 16, "M": 32, "ef_construction": 40, "ef_search": 64, "nbits": 8}
        for name, value in asdict(self).items():
            if name == "index" or value is None:
                if name in allowed and name in defaults:
                    object.__setattr__(self, name, defaults[name])
                continue
            if name not in allowed:
                takes = ", ".join(allowed) or "no options"
                raise ValueError(f"option {name}={value!r} does not apply to index {self.index!r} (it takes {takes})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"option {name} must be an integer >= 1, got {value!r}")
        if self.nbits is not None and self.nbits > 16:
            raise ValueError(f"option nbits must be between 1 and 16, got {self.nbits}")

    @classmethod
    def of(cls, index: str = "flat", **options) -> AnnOptions:
        """From keyword options, an unknown name refused by name."""
        known = set(cls.__dataclass_fields__) - {"index"}
        for name in options:
            if name not in known:
                raise ValueError(f"unknown dense index option {name!r}: expected one of {', '.join(sorted(known))}")
        return cls(index=index, **options)

    def build_key(self) -> dict:
        """The options that shape the saved index (the manifest's `ann` entry)."""
        return {"index": self.index, **{k: getattr(self, k) for k in _BUILD[self.index]}}

    def search_params(self) -> dict:
        return {k: getattr(self, k) for k in _SEARCH[self.index]}


def parse_option(text: str) -> tuple[str, int]:
    """One `NAME=INTEGER` of the command line's --index-option."""
    name, eq, value = text.partition("=")
    if not eq or not name.strip():
        raise ValueError(f"index option {text!r}: expected NAME=VALUE, e.g. nprobe=32")
    try:
        return name.strip(), int(value)
    except ValueError:
        raise ValueError(f"index option {name.strip()}: expected an integer, got {value!r}") from None


def auto_nlist(n: int) -> int:
    """The IVF list count for n vectors when none is given: about sqrt(n), and at most n / 39 (faiss's floor of
    training points a list)."""
    return max(1, min(int(round(math.sqrt(n))), n // 39))


def auto_m(dim: int) -> int:
    """The ivfpq sub-vector count for `dim` when none is given: the largest divisor of dim up to dim / 8."""
    return max(d for d in range(1, max(1, dim // 8) + 1) if dim % d == 0)


def resolved(opts: AnnOptions, n: int, dim: int) -> dict:
    """The build options as a build over n vectors of `dim` uses them (nlist and m chosen where not given)."""
    out = opts.build_key()
    if "nlist" in out and out["nlist"] is None:
        out["nlist"] = auto_nlist(n)
    if "m" in out and out["m"] is None:
        out["m"] = auto_m(dim)
    return out


def _new_index(faiss, dim: int, opts: AnnOptions, n: int):
    ip = faiss.METRIC_INNER_PRODUCT
    if opts.index == "flat":
        return faiss.IndexFlatIP(dim)
    if opts.index == "hnsw":
        index = faiss.IndexHNSWFlat(dim, opts.M, ip)
        index.hnsw.efConstruction = opts.ef_construction
        return index
    nlist = opts.nlist or auto_nlist(n)
    m = opts.m or auto_m(dim)
    if nlist > n:
        raise ValueError(f"option nlist={nlist} exceeds the {n} passages to index (each list needs passages)")
    if opts.index == "ivf":
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, ip)
    if dim % m:
        raise ValueError(f"option m={m} must divide the embedding dimension {dim}")
    if n < 2 ** opts.nbits:
        raise ValueError(f"option nbits={opts.nbits}: ivfpq trains {2 ** opts.nbits} centroids per sub-vector, "
                         f"more than the {n} passages to index")
    return faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, m, opts.nbits, ip)


def use_gpu(faiss, opts: AnnOptions) -> bool:
    return opts.index != "hnsw" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def to_gpu(faiss, index, opts: AnnOptions):
    """(index on the GPU, its resources) when faiss has one for it, else (index, None)."""
    if not use_gpu(faiss, opts):
        return index, None
    try:
        res = faiss.StandardGpuResources()
        return faiss.index_cpu_to_gpu(res, 0, index), res
    except Exception as e:  # noqa: BLE001 (faiss raises RuntimeError for an index the GPU does not take)
        warnings.warn(f"faiss GPU refused the {opts.index} index ({e}); it stays on the CPU", RuntimeWarning,
                      stacklevel=2)
        return index, None


def set_search_params(index, opts: AnnOptions) -> None:
    """Apply the search options (nprobe, ef_search) to a CPU or GPU index."""
    if opts.index in ("ivf", "ivfpq"):
        index.nprobe = opts.nprobe
    elif opts.index == "hnsw":
        index.hnsw.efSearch = opts.ef_search


def build_index(emb: np.ndarray, opts: AnnOptions, progress: bool = False):
    """A CPU faiss index of the rows of `emb` ([n, dim] float32, L2-normalised), trained when the type needs it and
    filled in chunks (a tqdm bar with `progress`), search options applied. A GPU does the work where there is one."""
    import faiss
    from tqdm import tqdm

    n, dim = emb.shape
    cpu = _new_index(faiss, dim, opts, n)
    index, res = to_gpu(faiss, cpu, opts)
    if not index.is_trained:
        nlist = opts.nlist or auto_nlist(n)
        take = min(n, TRAIN_PER_LIST * max(nlist, 2 ** (opts.nbits or 0)))
        rows = np.sort(np.random.default_rng(0).choice(n, take, replace=False)) if take < n else slice(None)
        log.info("training the %s index on %d of %d vectors", opts.index, take, n)
        index.train(np.ascontiguousarray(emb[rows]))
    for lo in tqdm(range(0, n, ADD_CHUNK), desc=f"dense {opts.index} index", unit="chunk", disable=not progress):
        index.add(np.ascontiguousarray(emb[lo:lo + ADD_CHUNK]))
    if res is not None:
        index = faiss.index_gpu_to_cpu(index)
    set_search_params(index, opts)
    return index


def recall_vs_exact(index, emb: np.ndarray, k: int = 10, queries: int = 200, seed: int = 0) -> float:
    """Mean over `queries` rows of `emb` (drawn with `seed`, used as queries) of |index top-k & exact top-k| / k,
    the exact top-k by a brute-force inner product over all of `emb`."""
    import faiss

    n = emb.shape[0]
    k = min(k, n)
    rows = np.random.default_rng(seed).choice(n, min(queries, n), replace=False)
    q = np.ascontiguousarray(emb[rows])
    exact = faiss.IndexFlatIP(emb.shape[1])
    exact.add(emb)
    _, want = exact.search(q, k)
    _, got = index.search(q, k)
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(want, got)]))


def index_bytes(index) -> int:
    """The bytes of a CPU index as faiss serialises it (its vectors, codes, lists and graph)."""
    import faiss

    return int(faiss.serialize_index(index).nbytes)
