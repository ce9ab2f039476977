"""Run options of a batch evaluation (`fastrag run`): what to run, on which data, written where, decoded how;
validated when built, so a bad option fails before the model loads."""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass
from pathlib import Path

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "bundled"


@dataclass(slots=True)
class RunOptions:
    method: str
    dataset: str
    data: str | None  # None: the caller hands run_many the examples (fastrag.api's questions in memory)
    corpus: str | None  # None only with write False (a retriever given built, whose corpus is not known)
    output: str | None  # the results folder; None only with write=False
    model: str = "smollm2"
    config: str | dict | None = None  # a JSON file's path, or its object (fastrag.config.InlineConfig)
    limit: int | None = None
    batch_size: int = 32
    signals: str | None = None
    kv_cache_gb: float | None = None  # None: 8 GiB on a CPU, sized from the device's memory on a GPU (auto_kv_cache_gb)
    # share the KV of full prompt blocks any sequence already computed (fastrag/cache/kv.py); off: every prompt
    # prefills all but the shared demos and its own sequence's cached tokens
    prefix_caching: bool = True
    threads: int | None = None
    # the methods' host logic runs while the device decodes the next step (QuestionLoop.overlap); None: on a GPU
    overlap: bool | None = None
    # processes for the methods' spaCy work (QuestionLoop.text_workers; 0: on the scheduler's thread); None: chosen by
    # the run (fastrag.text.pool.auto_text_workers: on a GPU the host's cores beyond two, at most 8; on a CPU 0)
    text_workers: int | None = None
    # the host CPUs that auto text workers are counted from; None: this process's (a Ray run's GPU shard: the
    # cluster's CPUs a GPU, as its siblings on the node share the cores)
    text_worker_cpus: int | None = None
    # retrieval batches in flight at once (QuestionLoop.search_concurrency); None: what the retriever serves
    # (Retriever.concurrent_searches: 1 for the bundled ones)
    search_concurrency: int | None = None
    progress: bool = True
    retriever: str = "bm25"  # bm25 | dense | elasticsearch (fastrag.retrieval.RETRIEVERS)
    # dense only: the faiss index and its options (fastrag.retrieval.ann.AnnOptions: {"index": "hnsw", "M": 32});
    # None: the exact flat index
    retriever_options: dict | None = None
    qids: tuple[str, ...] | None = None  # only these questions of the file (a shard of a distributed run)
    # decoding: greedy by default (parity and the committed tables); temperature > 0 samples inside the fused
    # signal kernel, from the top-p nucleus when top_p < 1 (the published DRAGIN runs sampled with T = 0.6,
    # top-p 0.9). Keys derive from (seed, question id, call number, token index), so a resumed or sharded run
    # draws what one uninterrupted run would.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # with temperature > 0: only the k most likely tokens (ties kept) before top-p, transformers' order (its
    # generation default is 50: the published DRAGIN runs sampled with T 0.6, top-k 50, top-p 0.9); 0: off
    top_k: int = 0
    # gold-answer aliases keyed by each question's answer_id (2WikiMultihopQA's id_aliases.json, as the published
    # DRAGIN evaluation reads it): scoring only, so a rerun into a finished folder rescores its answers with them
    answer_aliases: str | None = None
    # False: nothing is written (no folder, no resume), the records stay in memory (fastrag.api's RAG.run without
    # out=); the run's metrics are computed the same way
    write: bool = True

    def __post_init__(self):
        from fastrag.methods.registry import get_method

        from fastrag.retrieval import RETRIEVERS

        get_method(self.method)  # raises with the list of available methods
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"--retriever {self.retriever!r}: expected one of {', '.join(RETRIEVERS)}")
        if self.retriever_options:
            if self.retriever != "dense":
                raise ValueError(f"--dense-index / --index-option apply to --retriever dense, not {self.retriever}")
            from fastrag.retrieval.ann import AnnOptions

            AnnOptions.of(**self.retriever_options)  # (a bad option fails here, naming it)
            self.retriever_options = dict(self.retriever_options)
        from fastrag.engine import as_int, check_seed

        # (any integer type, numpy's included, kept as a Python int; floats, bools and strings refused by name)
        for name, flag in (("batch_size", "--batch-size"), ("limit", "--limit")):
            value = getattr(self, name)
            if value is None and name == "limit":
                continue
            if as_int(value) is None or value <= 0:
                raise ValueError(f"{flag} must be a positive int, got {value!r}")
            setattr(self, name, as_int(value))
        if (self.write or self.output is not None) and (not isinstance(self.output, (str, os.PathLike))
                                        or not str(self.output).strip()):
            raise ValueError(f"--output must name a folder, got {self.output!r} (an empty path would write into "
                             "the current directory)")
        from fastrag.signals.checks import MIN_TEMPERATURE

        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"--top-p must be in (0, 1] (1: no nucleus filtering), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top-k must be an int >= 0 (0: no top-k filtering), got {self.top_k!r}")
        if self.top_k and self.temperature == 0:
            raise ValueError(f"--top-k {self.top_k} applies only when sampling: give --temperature > 0 too "
                             "(greedy decoding takes the most likely token whatever k is)")
        if self.top_p < 1 and self.temperature == 0:
            raise ValueError(f"--top-p {self.top_p} applies only when sampling: give --temperature > 0 too "
                             "(greedy decoding has no nucleus)")
        self.seed = check_seed(self.seed, "--seed")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"--threads must be an int >= 1, got {self.threads!r}")
        if self.text_workers is not None and (isinstance(self.text_workers, bool)
                                              or not isinstance(self.text_workers, int) or self.text_workers < 0):
            raise ValueError(f"--text-workers must be an int >= 0 (0: no worker processes), got {self.text_workers!r}")
        if self.search_concurrency is not None and (isinstance(self.search_concurrency, bool)
                                                    or not isinstance(self.search_concurrency, int)
                                                    or self.search_concurrency < 1):
            raise ValueError(f"--search-concurrency must be an int >= 1, got {self.search_concurrency!r}")
        if self.qids is not None:
            if isinstance(self.qids, (str, bytes)) or not isinstance(self.qids, (list, tuple, set, frozenset)) \
                    or not all(isinstance(q, str) for q in self.qids):
                raise ValueError(f"qids must be a list or tuple of question ids (strings), got {self.qids!r:.80}")
            self.qids = tuple(self.qids)
        for name in ("data", "corpus", "answer_aliases"):
            if getattr(self, name) is None and (name in ("answer_aliases", "data") or not self.write):
                continue  # (no data file: the caller's examples; no corpus: a retriever given, nothing written)
            p, flag = Path(getattr(self, name)), "--" + name.replace("_", "-")
            try:
                p.stat()
            except FileNotFoundError:
                pass  # (said below, by name)
            except OSError as e:  # (a folder on its path that cannot be entered: [Errno 13] alone named nothing)
                raise type(e)(f"{flag} {p}: {path_problem(e)}") from None
            if p.is_dir():
                raise ValueError(f"{flag} {p}: is a directory, expected a file")
            if not p.exists():
                raise FileNotFoundError(f"{flag} {p}: no such file")
            if not p.is_file():
                raise ValueError(f"{flag} {p}: not a regular file (a pipe or a device?): give a file on disk")
            if not os.access(p, os.R_OK):
                raise PermissionError(f"{flag} {p}: not readable")


def path_problem(e: OSError) -> str:
    """What an OSError on a path given as an option means to its user, and what to do."""
    if e.errno == errno.EACCES:
        return (f"cannot be reached ({e.strerror}): this user may not enter a folder on its path (or use the file "
                "itself); fix the permissions, or give a path under a folder this user can use")
    return f"cannot be reached ({e.strerror or e})"


def select_qids(examples: list, opts: RunOptions, what: str = "question") -> list:
    """The examples `opts.qids` names (all with qids None); an id not among them is a ValueError naming it (a run
    of none of the file's questions used to end as a success with nothing written)."""
    if opts.qids is None:
        return examples
    wanted = set(opts.qids)
    missing = wanted - {e.qid for e in examples}
    if missing:
        among = f"the first {opts.limit} questions" if opts.limit is not None else "the questions"
        # (no data file: the questions were handed over in memory, fastrag.api)
        source = f"of {opts.data}" if opts.data is not None else "given"
        raise ValueError(f"{len(missing)} {what} id(s) of qids are not among {among} {source}: "
                         f"{sorted(missing)[:3]}")
    return [e for e in examples if e.qid in wanted]


def method_config(opts: RunOptions):
    from fastrag.methods.registry import make_config

    return make_config(opts.method, opts.dataset, opts.config)



class RunError(RuntimeError):
    """A run that cannot finish as asked (e.g. a Ray shard that failed every retry): the CLI prints it as an error;
    the answers already written stay for a rerun."""



def sampling_of(opts: RunOptions):
    """The engine's SamplingParams for a run's --temperature / --top-k / --top-p / --seed."""
    from fastrag.engine import SamplingParams

    return SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, top_k=opts.top_k)

