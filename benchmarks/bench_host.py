"""The host-side work around the engine's steps: what a GPU run cannot hide behind its decode steps.

Seven measurements (the first with a second part), each with its baseline in the same run:
1. Host preparation of a graphed decode step: `ModelRunner.decode_graphed` at batch 128 with the graph's forward stubbed
   out (inputs, positions, KV slots and the block table of every row): the work the launch does before the device can
   start, per step.
   The engine's whole host time per decode step at the same batch (`step_launch` + `step_finish`, the forward
   and the signal kernels stubbed out), of which 1. is a part; and at batch 256 after a 640-token shared prefix
   with 256 sequences waiting (a 1,000-question run's decode steps on a GPU).
2. spaCy on worker processes (fastrag.text.pool): sentence splits of real passages per second in this process, and
   through 1 and 2 workers (N for `--workers`).
3. Torch operations of one packed prefill forward (12 sequences of random lengths 16-600 after a 1,536-token prefix):
   per layer and fixed, counted with the GPU's bucket rule (similar lengths share an attention call) against one
   attention call per sequence (the CPU's rule), then as a GPU runs it: the small operations fused
   (kernels/fused_decode.py), with the attention buckets and with the paged prefill kernel ($FASTRAG_PAGED_PREFILL,
   kernels/paged_prefill.py); there each Triton kernel counts as one operation (one launch). Views and other
   operations that launch nothing are counted too: each costs the host its dispatch. Likewise DRAGIN's attention
   pass (`last_layer_qk`) with the masked call and with the paged kernel.
4. Decode-step signals over [B, 49152] logits on the CPU: the torch backend against the C++ one (`cpp`).
5. Host preparation of a prefill and of an attention pass replayed from CUDA graphs (`PrefillGraphs.run`,
   `PassGraphs.run`, fastrag/cuda_graphs/) with the graph's forward stubbed out: the buffers' host images, their
   two copies, and for a pass the q and k put back in [B, T] order; against 3.'s eager forwards.
6. A graphed decode step whose every sequence tracks its attention (dragin-streaming, in context): the torch
   operations `step_launch` dispatches (on a GPU each is a launch or at least a dispatch) and its host ms, at batch
   64 and 256, with every
   span a different length. Baseline in the same run: each sequence's maxima in a tensor of its span's exact
   length, so each is a capacity of its own (as before `fastrag.engine.track_capacity`); against the engine's
   power-of-two capacities. Graph forward, signal kernels and the tracking kernel stubbed out.
7. The launch of 1.'s second step (batch 256 after a 640-token prefix, 256 waiting) beside another thread that takes
   the GIL, at three interpreter switch intervals (`sys.setswitchinterval`, default 5 ms): alone, beside a BM25 search
   loop (the engine's retriever over the bundled corpus) and beside a pure-Python loop. Every torch call gives the GIL
   up while it runs, so a thread that runs Python meanwhile can hold the launch off for up to a switch interval per
   call. Baseline in the same run: the launch alone. Read with the step trace's `launch_cpu_s` share: a launch that
   waits for the GIL spends a small share of its wall on its CPU.

    python benchmarks/bench_host.py              # writes benchmarks/results/host_<device>.md

Medians of repeated runs; the machine's other load moves them (say what else ran).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import random
import shlex
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fastrag.provenance import cpu_name  # noqa: E402
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

RESULTS = ROOT / "benchmarks" / "results"


def _tiny_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, eos_token_id=None)
    return LlamaConfig(**(base | kw))


class _Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


@contextlib.contextmanager
def _decoding_engine(max_new: int, batch: int = 128, prefix: int = 0, waiting: int = 0):
    """An engine holding `batch` prefilled sequences of 500-700 tokens (tiny model, graphs emulated), after a shared
    prefix of `prefix` tokens when > 0, with `waiting` more sequences waiting for room in the batch, and the graph's
    forward stubbed out (constant logits) while inside: what is left of a decode step is the host's work."""
    from fastrag.cuda_graphs import DecodeGraphs
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    m = LlamaModel.from_hf_config(_tiny_config(), seed=5)
    eng = Engine(m, _Tok(), kv_cache_gb=0.3 * (batch + waiting) / 128, max_batch=batch, cuda_graphs=True)
    pre = [i % 90 for i in range(prefix)]
    if prefix:
        eng.set_prefix(" ".join(map(str, pre)))
    rng = random.Random(0)
    for _ in range(batch + waiting):
        eng.start(eng.new_sequence(), pre + [rng.randrange(96) for _ in range(rng.randint(500, 700))], max_new)
    eng.max_prefill_tokens = 10**6
    eng.step()
    eng.max_prefill_tokens = 4096
    if len(eng.running) != batch or len(eng.waiting) != waiting:
        raise RuntimeError(f"expected {batch} running and {waiting} waiting, got {len(eng.running)} and "
                           f"{len(eng.waiting)}")
    logits = torch.zeros(batch, 96)
    forward = DecodeGraphs._forward
    DecodeGraphs._forward = lambda self, g: logits[: g.ids.shape[0]]
    try:
        yield eng
    finally:
        DecodeGraphs._forward = forward


def host_prep(reps: int) -> dict:
    with _decoding_engine(200) as eng:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            with torch.inference_mode():
                eng.runner.decode_graphed(eng.running, [None])
            ts.append(time.perf_counter() - t)
            for s in eng.running:
                s.tokens.append(1)
    blocks = sum(len(s.table.blocks) for s in eng.running) / len(eng.running)
    return {"batch": len(eng.running), "blocks_per_row": round(blocks, 1),
            "median_ms": statistics.median(ts) * 1e3}


class _ConstantSignals:
    """An engine's signals backend whose decode-step kernel is replaced by a constant result (token 1, entropy and
    log-probability 0) for up to `batch` rows; everything else is the backend's."""

    def __init__(self, inner, batch: int):
        self.inner = inner
        self.one, self.zero = torch.ones(batch, dtype=torch.long), torch.zeros(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode_signals(self, lg, **kw):
        B = lg.shape[0]
        return types.SimpleNamespace(chosen=self.one[:B], entropy=self.zero[:B], logprob=self.zero[:B])


def step_host(reps: int, batch: int = 128, prefix: int = 0, waiting: int = 0) -> dict:
    """The engine's whole host time per decode step at `batch` (after a shared prefix of `prefix` tokens, with
    `waiting` sequences waiting for room: _decoding_engine): `step_launch` (batch bookkeeping, KV slots, the graph's
    inputs, the signals launch) and `step_finish` (reading the sampled tokens, appending them, stop checks), with
    the graph's forward and the signal kernels stubbed out. This is what a step costs the host between two device
    steps, the most a device-side token feed (launching step N+1 before step N's tokens reach the host) could
    hide."""
    with _decoding_engine(reps + 10, batch, prefix, waiting) as eng:
        eng.signals = _ConstantSignals(eng.signals, batch)
        launch_ms, finish_ms = _time_steps(eng, reps)
    return {"batch": len(eng.running), "prefix": prefix, "waiting": waiting, "launch_ms": launch_ms,
            "finish_ms": finish_ms}


def _time_steps(eng, reps: int) -> tuple[float, float]:
    """Median host ms of `step_launch` and of `step_finish` over `reps` engine steps."""
    tl, tf = [], []
    for _ in range(reps):
        t = time.perf_counter()
        st = eng.step_launch()
        t1 = time.perf_counter()
        eng.step_finish(st)
        tl.append(t1 - t)
        tf.append(time.perf_counter() - t1)
    return statistics.median(tl) * 1e3, statistics.median(tf) * 1e3


def tracked_step(reps: int, batches: tuple[int, ...] = (64, 256)) -> list[dict]:
    """6. in the module doc: per batch and capacity rule, the torch operations one `step_launch` dispatches and the
    median host ms of `step_launch` and `step_finish`, every sequence tracked, every span of its own length."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastrag.cuda_graphs import DecodeGraphs
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    class Signals:  # the decode-step signals and the tracking update stubbed out (one operation each)
        def __init__(self, inner, B):
            self.inner, self.one, self.zero = inner, torch.ones(B, dtype=torch.long), torch.zeros(B)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode_signals(self, lg, **kw):
            B = lg.shape[0]
            return types.SimpleNamespace(chosen=self.one[:B], entropy=self.zero[:B], logprob=self.zero[:B])

        @staticmethod
        def attn_decode_update(q, k, blocks, lens, starts, lse, bs, scale, amax):
            amax.add_(0.0)

    rows = []
    forward = DecodeGraphs._forward
    try:
        for B in batches:
            logits = torch.zeros(B, 96)

            def stub(self, g, logits=logits):  # what the model's forward leaves for the tracking: q and lse
                c = self.model.c
                g.batch.last_layer.update(q=torch.zeros(g.ids.shape[0], c.num_heads, c.head_dim),
                                          lse=torch.zeros(g.ids.shape[0], c.num_heads))
                return logits[: g.ids.shape[0]]

            DecodeGraphs._forward = stub
            for rule in ("exact", "power of two"):
                m = LlamaModel.from_hf_config(_tiny_config(), seed=5)
                eng = Engine(m, _Tok(), kv_cache_gb=0.6, max_batch=B, cuda_graphs=True)
                rng = random.Random(0)
                for i in range(B):  # spans of 8 prompt tokens + 100-355 new ones: every one a different length
                    p = [rng.randrange(96) for _ in range(rng.randint(200, 400))]
                    s = eng.new_sequence()
                    eng.start(s, p, 100 + i, track_from=len(p) - 8)
                    if rule == "exact":
                        s.amax = torch.zeros(m.c.num_heads, 108 + i)
                eng.max_prefill_tokens = 10**6
                while eng.waiting:
                    eng.step()
                eng.signals = Signals(eng.signals, B)
                for _ in range(10):  # past the spans' prompt tokens: every step samples
                    eng.step_finish(eng.step_launch())
                with torch.inference_mode(), Count() as c:
                    st = eng.step_launch()
                eng.step_finish(st)
                launch_ms, finish_ms = _time_steps(eng, reps)
                if len(eng.running) != B or eng.graphs.stats["replays"] == 0:
                    raise RuntimeError("the tracked decode steps did not replay a full batch")
                rows.append({"batch": B, "capacities": rule,
                             "distinct": len({s.amax.shape[1] for s in eng.running}), "ops": c.n,
                             "launch_ms": launch_ms, "finish_ms": finish_ms})
    finally:
        DecodeGraphs._forward = forward
    return rows


CONTENDERS = ("none", "BM25 search", "Python loop")
SWITCH_INTERVALS_MS = (5.0, 0.5, 0.1)


@functools.cache
def _bundled_bm25():
    """The engine's BM25 retriever over the bundled corpus and the bundled questions (loaded once a process)."""
    from fastrag.eval import BUNDLED
    from fastrag.retrieval.bm25 import BM25Retriever

    retriever = BM25Retriever(BUNDLED / "wiki_passages.jsonl", show_progress=False)
    qs = [json.loads(x)["question_text"] for x in (BUNDLED / "hotpotqa_dev20.jsonl").read_text().splitlines()
          if x.strip()]
    return retriever, qs


def _contender(kind: str, stop: threading.Event):
    """A thread doing `kind`'s work until `stop` is set (None for "none"), and its loop count."""
    done = [0]
    if kind == "none":
        return None, done
    if kind == "BM25 search":  # the engine's retriever over the bundled corpus, batches of the bundled questions
        retriever, qs = _bundled_bm25()

        def work():
            while not stop.is_set():
                retriever.search(qs, 3)
                done[0] += 1
    elif kind == "Python loop":  # interpreted code only: it gives the GIL up only when asked to
        def work():
            x = 0
            while not stop.is_set():
                for i in range(2000):
                    x += i * i
                done[0] += 1
    else:
        raise ValueError(f"unknown contender {kind!r}")
    return threading.Thread(target=work, name=f"bench-contender-{kind}", daemon=True), done


def launch_beside_threads(reps: int, rounds: int = 2) -> list[dict]:
    """7. in the module doc: `step_launch` at batch 256 after a 640-token prefix, 256 waiting (graph forward and
    signal kernels stubbed out, as in 1.), alone and beside a thread that takes the GIL (a BM25 search loop; a
    pure-Python loop), at each interpreter switch interval (`sys.setswitchinterval`; Python's default is 5 ms).
    Per setting: the launch's median and 90th-percentile wall, and the median share of that wall the launching
    thread spent on its CPU (the step trace's `launch_cpu_s` / `launch_s`: the rest it waited). `rounds` passes over
    the settings, each `reps` steps, pooled (the sequences' contexts grow a little over the steps)."""
    settings = [(kind, iv) for kind in CONTENDERS for iv in SWITCH_INTERVALS_MS]
    samples = {k: ([], []) for k in settings}
    old = sys.getswitchinterval()
    with _decoding_engine(rounds * len(settings) * reps + 10, 256, 640, 256) as eng:
        eng.signals = _ConstantSignals(eng.signals, 256)
        try:
            for _ in range(rounds):
                for kind, iv in settings:
                    stop = threading.Event()
                    th, done = _contender(kind, stop)
                    if th is not None:
                        th.start()
                        while done[0] == 0:  # (its first loop is not part of the reading)
                            if not th.is_alive():  # (it failed: its traceback is on stderr; no endless wait)
                                raise RuntimeError(f"the {kind!r} contender thread stopped before its first loop")
                            time.sleep(0.001)
                    sys.setswitchinterval(iv / 1e3)
                    try:
                        for _ in range(reps):
                            t, c = time.perf_counter(), time.thread_time()
                            st = eng.step_launch()
                            wall, cpu = time.perf_counter() - t, time.thread_time() - c
                            eng.step_finish(st)
                            samples[(kind, iv)][0].append(wall)
                            samples[(kind, iv)][1].append(cpu / wall)
                    finally:
                        sys.setswitchinterval(old)
                        stop.set()
                        if th is not None:
                            th.join()
        finally:
            sys.setswitchinterval(old)
    if len(eng.running) != 256:
        raise RuntimeError(f"expected a batch of 256 throughout, got {len(eng.running)}")
    rows = []
    for kind, iv in settings:
        walls, shares = samples[(kind, iv)]
        walls = sorted(walls)
        rows.append({"contender": kind, "switch_interval_ms": iv, "steps": len(walls),
                     "median_ms": statistics.median(walls) * 1e3,
                     "p90_ms": walls[min(len(walls) - 1, int(0.9 * len(walls)))] * 1e3,
                     "cpu_share": statistics.median(shares)})
    return rows


def text_pool(n_texts: int, workers: list[int]) -> dict:
    from fastrag.eval import BUNDLED
    from fastrag.text.pool import TextPool
    from fastrag.text.sentences import split_sentences

    rows = [json.loads(x) for x in (BUNDLED / "wiki_passages.jsonl").read_text().splitlines() if x.strip()]
    rng = random.Random(0)
    texts = [rng.choice(rows)["text"][: rng.randrange(200, 800)] for _ in range(n_texts)]
    split_sentences(texts[0])  # the pipeline loaded
    t = time.perf_counter()
    for x in texts:
        split_sentences(x)
    here = time.perf_counter() - t
    out = {"texts": n_texts, "in_process_per_s": n_texts / here}
    for n in workers:
        pool = TextPool(n)
        try:
            for f in [pool.submit("sentences", "Warm up. Now.") for _ in range(n)]:
                f.result()
            t = time.perf_counter()
            for f in [pool.submit("sentences", x) for x in texts]:
                f.result()
            out[f"workers_{n}_per_s"] = n_texts / (time.perf_counter() - t)
        finally:
            pool.shutdown()
    return out


def packed_ops(reps: int = 20) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastrag.model.llama import AttnBatch, LlamaModel

    class Count(TorchDispatchMode):
        n = 0
        off = False  # inside a stubbed kernel: its own torch calls are not counted

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not Count.off
            return func(*args, **(kwargs or {}))

    def launch(make):  # a Triton kernel stubbed out: one launch, its output tensors made uncounted
        def call(*a, **k):
            Count.off = True
            try:
                return make(*a, **k)
            finally:
                Count.off = False
                Count.n += 1
        return call

    class Fused:  # kernels/fused_decode.py's launches, outputs of the right shapes
        add_rms_norm = staticmethod(launch(lambda x, delta, w, eps: (torch.empty_like(x), torch.empty_like(x))))
        rope_write_kv = staticmethod(launch(lambda qkv, cos, sin, slots, kp, vp, H, Hkv: torch.empty(
            qkv.shape[0], H, kp.shape[2], dtype=qkv.dtype)))
        silu_mul = staticmethod(launch(lambda gu: torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)))

    class Paged:  # kernels/paged_prefill.py: the host layout as it is, the kernel one launch
        def __init__(self):
            from fastrag.kernels import paged_prefill

            self.prefill_layout = paged_prefill.prefill_layout
            self.paged_prefill_attention = launch(lambda q, kp, vp, lay, scale, out=None: torch.empty(
                q.shape, dtype=q.dtype))

    def count(layers: int, fill: float, fused: bool = False, paged: bool = False, reps: int = 0,
              lo: int = 16, hi: int = 600, P: int = 1536):
        """Operations of one forward (reps = 0), else the median seconds of `reps` forwards without counting."""
        cfg = _tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2)
        m = LlamaModel.from_hf_config(cfg, seed=1)
        m.pack_below, m.bucket_fill_cpu = 1.0, fill
        if fused:
            m.fused_decode, m._fused_on_cpu, m.fused_prefill = Fused(), True, True
        if paged:
            m.paged_prefill, m._paged_prefill_on_cpu, m.paged_prefill_checks = Paged(), True, {"cpu float32": "on"}
        rng = random.Random(0)
        bs = 16
        lens = [rng.randint(lo, hi) for _ in range(12)]
        B, T = len(lens), max(lens)
        nb = (T + bs - 1) // bs + 1
        blocks = torch.arange(B * nb).view(B, nb) + P // bs
        kp = [torch.randn(2, (P // bs + B * nb) * bs, 16) for _ in range(layers)]
        vp = [torch.randn_like(kp[0]) for _ in range(layers)]
        valid = torch.arange(T).expand(B, T) < torch.tensor(lens).unsqueeze(1)
        batch = AttnBatch(write_slots=torch.tensor([int(blocks[b, i // bs]) * bs + i % bs for b in range(B)
                                                    for i in range(lens[b])]),
                          valid=valid, positions=(P + torch.arange(T)).expand(B, T) * valid, prefix_len=P,
                          prefix_slots=torch.arange(P), ctx_blocks=blocks, ctx_lens=torch.tensor(lens),
                          block_size=bs, prefix_start=0, lens=lens, ctx_lens_host=lens)
        ids, last = torch.randint(0, 128, (B, T)), torch.tensor([b * T + n - 1 for b, n in enumerate(lens)])
        if reps:
            times = []
            with torch.inference_mode():
                for _ in range(reps + 2):
                    t0 = time.perf_counter()
                    m(ids, batch, kp, vp, logits_index=last)
                    times.append(time.perf_counter() - t0)
            return statistics.median(times[2:])
        Count.n = 0
        with torch.inference_mode(), Count():
            m(ids, batch, kp, vp, logits_index=last)
        return Count.n

    def count_pass(layers: int, paged: bool, reps: int = 0, packed: bool = False):
        """Operations of one DRAGIN attention pass (`last_layer_qk`, 4 sequences of 20-120 tokens, the GPU's fused
        small operations and its rule of keys repeated per query head), through the masked call or the paged
        kernel (packed: over the real rows only, given the host lengths, as the engine calls it); reps > 0: median
        seconds, as above."""
        cfg = _tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2)
        m = LlamaModel.from_hf_config(cfg, seed=1)
        m.fused_decode, m._fused_on_cpu, m.fused_prefill, m.expand_gqa = Fused(), True, True, True
        if paged:
            m.paged_prefill, m._paged_prefill_on_cpu, m.paged_prefill_checks = Paged(), True, {"cpu float32": "on"}
        rng = random.Random(0)
        lens = torch.tensor([rng.randint(20, 120) for _ in range(4)])
        ids = torch.randint(0, 128, (4, int(lens.max())))
        host = lens.tolist() if packed else None
        with torch.inference_mode():
            if reps:
                times = []
                for _ in range(reps + 2):
                    t0 = time.perf_counter()
                    m.last_layer_qk(ids, lens, host)
                    times.append(time.perf_counter() - t0)
                return statistics.median(times[2:])
            Count.n = 0
            with Count():
                m.last_layer_qk(ids, lens, host)
        return Count.n

    out = {}
    for name, paged, packed in (("attention pass: masked call, fused small ops", False, False),
                                ("attention pass: paged kernel, fused small ops", True, False),
                                ("attention pass: paged kernel, packed rows, fused small ops", True, True)):
        one, four = count_pass(1, paged, packed=packed), count_pass(4, paged, packed=packed)
        per_layer = (four - one) / 3
        out[name] = {"per_layer": per_layer, "fixed": one - per_layer, "at_32_layers": one - per_layer + 32 * per_layer,
                     "ms_32_layers": 1e3 * count_pass(32, paged, reps=reps, packed=packed)}
    for name, fill, kw in (("gpu rule", 0.6, {}), ("cpu rule", 1.0, {}),
                           ("gpu rule, fused small ops", 0.6, dict(fused=True)),
                           ("paged kernel, fused small ops", 0.6, dict(fused=True, paged=True))):
        one, four = count(1, fill, **kw), count(4, fill, **kw)
        per_layer = (four - one) / 3
        out[name] = {"per_layer": per_layer, "fixed": one - per_layer, "at_32_layers": one - per_layer + 32 * per_layer,
                     # the host's time for such a forward where its compute is negligible (12 x 8-40 new tokens
                     # after a 128-token prefix, 32 layers): the dispatches' cost on this CPU
                     "ms_32_layers": 1e3 * count(32, fill, **kw, reps=reps, lo=8, hi=40, P=128)}
    return out


def graph_prep(reps: int) -> list[dict]:
    """5. in the module doc: median host ms of PrefillGraphs.run / PassGraphs.run per call, forwards stubbed (the
    replay of a GPU is one launch), for a few call shapes of a DRAGIN run after a 1,536-token prefix, in a model of
    4,096 tokens of context (its block tables' width)."""
    from fastrag.cuda_graphs import PassGraphs, PrefillGraphs
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    m = LlamaModel.from_hf_config(_tiny_config(max_position_embeddings=4096), seed=5)
    eng = Engine(m, _Tok(), kv_cache_gb=0.3, max_batch=128, cuda_graphs=False)
    pg = PrefillGraphs(m, eng.pool, ctx_blocks=4096 // 16, max_tokens=1024, max_seqs=16, emulate=True)
    sg = PassGraphs(m, max_tokens=1024, max_seqs=32, emulate=True)
    c = m.c
    for g in (pg, sg):
        g.applies = lambda: True  # (a CPU model: neither the paged kernel nor the fused operations by default)
    pg._forward = lambda M: torch.zeros(16, c.vocab_size)
    sg._forward = lambda M: torch.zeros(M, c.num_heads, c.head_dim)
    prefix = types.SimpleNamespace(length=1536, slots=torch.arange(1536))
    rng = random.Random(0)
    rows = []
    for B, n in ((1, 37), (2, 150), (1, 396), (16, 60)):
        toks = [[rng.randrange(96) for _ in range(n)] for _ in range(B)]
        own = [rng.randint(0, 200) for _ in range(B)]  # own tokens before this call
        ctx = [(list(range(100 * b, 100 * b + (o + n) // 16 + 1)), o + n) for b, o in enumerate(own)]
        write = [blk[(o + i) // 16] * 16 + (o + i) % 16 for (blk, _), o in zip(ctx, own) for i in range(n)]
        args = (toks, [1536 + o for o in own], write, ctx, [prefix] * B)
        ts = []
        with torch.inference_mode():
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                pg.run(*args)
                ts.append(time.perf_counter() - t0)
        rows.append({"call": f"prefill, {B} x {n} new tokens", "median_ms": statistics.median(ts[2:]) * 1e3})
    for B, lo, hi in ((4, 20, 120), (12, 5, 60)):
        lists = [[rng.randrange(96) for _ in range(rng.randint(lo, hi))] for _ in range(B)]
        ts = []
        with torch.inference_mode():
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                sg.run(lists)
                ts.append(time.perf_counter() - t0)
        rows.append({"call": f"attention pass, {B} lists of {lo}-{hi} tokens",
                     "median_ms": statistics.median(ts[2:]) * 1e3})
    if pg.stats["replays"] == 0 or sg.stats["replays"] == 0:
        raise RuntimeError("a graphed call did not replay: the measurement would time the eager fallback's check")
    return rows


def signals(reps: int) -> list[dict]:
    from fastrag.signals import get_backend

    tb, cb = get_backend("torch"), get_backend("cpp")
    torch.manual_seed(0)
    rows = []
    for B in (16, 41, 128):
        x = torch.randn(B, 49152) * 3
        t = {"torch": [], "cpp": []}
        for _ in range(reps):
            for name, be in (("torch", tb), ("cpp", cb)):
                t0 = time.perf_counter()
                be.decode_signals(x)
                t[name].append(time.perf_counter() - t0)
        rows.append({"B": B, "torch_ms": statistics.median(t["torch"]) * 1e3,
                     "cpp_ms": statistics.median(t["cpp"]) * 1e3})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=positive_int, default=60)
    ap.add_argument("--texts", type=positive_int, default=200)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    device = f"CPU {cpu_name()} x{threads} threads"
    prep = host_prep(args.reps)
    step = step_host(args.reps)
    steps = [step, step_host(args.reps, batch=256, prefix=640, waiting=256)]
    pool = text_pool(args.texts, args.workers)
    ops = packed_ops(max(5, args.reps // 3))
    sig = signals(max(10, args.reps // 2))
    gp = graph_prep(args.reps)
    tr = tracked_step(max(5, args.reps // 2))
    beside = launch_beside_threads(max(10, args.reps // 2))
    alone = {r["switch_interval_ms"]: r for r in beside if r["contender"] == "none"}
    base = {r["batch"]: r for r in tr if r["capacities"] == "exact"}
    cmd = "python benchmarks/bench_host.py " + shlex.join(sys.argv[1:])
    lines = [
        f"# Host-side work around the engine's steps ({device})", "",
        f"- date: {dt.date.today()}; torch {torch.__version__}; command: `{cmd.strip()}`",
        f"- other load: {args.note or 'none stated'}", "",
        "## Host preparation of a graphed decode step (forward stubbed out)", "",
        "| batch | blocks a row | median ms |", "|---|---|---|",
        f"| {prep['batch']} | {prep['blocks_per_row']} | {prep['median_ms']:.3f} |", "",
        "## The engine's whole host time per decode step (graph forward and signal kernels stubbed out)", "",
        "`step_launch` + `step_finish`: what a device-side token feed could hide at most. The first row at the "
        "batch of the table above (its share the graph's inputs); the second as a 1,000-question DRAGIN run decodes "
        "on a GPU: a full batch of 256 after a 640-token shared prefix, 256 more sequences waiting for room.", "",
        "| batch | shared prefix | waiting | launch ms | finish ms | total ms | of which the graph's inputs |",
        "|---|---|---|---|---|---|---|",
        *(f"| {st['batch']} | {st['prefix']} | {st['waiting']} | {st['launch_ms']:.3f} | {st['finish_ms']:.3f} | "
          f"{st['launch_ms'] + st['finish_ms']:.3f} | "
          + (f"{prep['median_ms'] / (st['launch_ms'] + st['finish_ms']):.0%} |" if st is step else "|")
          for st in steps), "",
        "## spaCy sentence splits per second (real passages, 200-800 characters)", "",
        "| in this process | " + " | ".join(f"{n} worker{'s' if n > 1 else ''}" for n in args.workers)
        + " |", "|---" * (1 + len(args.workers)) + "|",
        f"| {pool['in_process_per_s']:.0f} | "
        + " | ".join(f"{pool[f'workers_{n}_per_s']:.0f} (x{pool[f'workers_{n}_per_s'] / pool['in_process_per_s']:.2f})"
                     for n in args.workers) + " |", "",
        "## Torch operations of one packed prefill forward (12 sequences, lengths 16-600, 1,536-token prefix)", "",
        "The last column times a forward of 32 layers whose compute is negligible (12 sequences of 8-40 new tokens "
        "after a 128-token prefix, hidden size 64; the Triton kernels stubbed out as one empty tensor each): the "
        "host's cost of those dispatches on this CPU, median. The attention-pass rows count DRAGIN's cache-free pass "
        "(`last_layer_qk`: 4 sequences of 20-120 tokens padded to the longest, stopping at the last layer's q and k) "
        "and time it at those lengths; packed rows: only each sequence's real rows go through the layers (the "
        "engine's call, with the host lengths), which put the last layer's q back in place.", "",
        "| attention | per layer | fixed | at 32 layers | host ms at 32 layers |", "|---|---|---|---|---|",
        *(f"| {name} | {v['per_layer']:.0f} | {v['fixed']:.0f} | {v['at_32_layers']:.0f} | {v['ms_32_layers']:.1f} |"
          for name, v in ops.items()), "",
        "## Decode-step signals over [B, 49152] logits (greedy), median ms", "",
        "| B | torch | C++ (`cpp`) | torch / C++ |", "|---|---|---|---|",
        *(f"| {r['B']} | {r['torch_ms']:.2f} | {r['cpp_ms']:.2f} | {r['torch_ms'] / r['cpp_ms']:.2f} |" for r in sig),
        "",
        "## Host preparation of a prefill and an attention pass replayed from CUDA graphs (forward stubbed out)", "",
        "`PrefillGraphs.run` and `PassGraphs.run` (fastrag/cuda_graphs/) after a 1,536-token prefix, block tables "
        "4,096 tokens wide: the buffers' host images and their two copies, and for a pass the q and k put back in "
        "[B, T] order. On a GPU the replay adds one launch. Against the eager forwards' host ms at 32 layers above.",
        "", "| call | median host ms |", "|---|---|",
        *(f"| {r['call']} | {r['median_ms']:.3f} |" for r in gp), "",
        "## A graphed decode step whose every sequence tracks its attention (dragin-streaming, in context), by "
        "capacity rule", "",
        "Every sequence's span a different length (8 prompt tokens and 100 to 99 + batch new ones); its maxima held "
        "in a tensor of the span's exact length (the rule before `track_capacity`: a capacity a sequence) or of the "
        "next power of two (the engine's). ops: torch operations one `step_launch` dispatches, each a launch or a "
        "dispatch on a GPU. Graph forward, signal kernels and the tracking kernel stubbed out (one operation each); "
        "ms are this CPU's, medians.", "",
        "| batch | capacities | distinct capacities | ops a launch | launch ms | finish ms | ops / exact's | "
        "launch ms / exact's |", "|---|---|---|---|---|---|---|---|",
        *(f"| {r['batch']} | {r['capacities']} | {r['distinct']} | {r['ops']} | {r['launch_ms']:.3f} | "
          f"{r['finish_ms']:.3f} | {r['ops'] / base[r['batch']]['ops']:.3f} | "
          f"{r['launch_ms'] / base[r['batch']]['launch_ms']:.3f} |" for r in tr), "",
        "## The launch beside another thread that takes the GIL, by switch interval", "",
        "`step_launch` of the second step above (batch 256 after a 640-token prefix, 256 waiting; forward and signal "
        "kernels stubbed out) while another thread runs: nothing, a loop of BM25 searches (the engine's retriever "
        "over the bundled corpus, the 20 bundled questions a batch, back to back), or a loop of pure Python. Every "
        "torch call lets the GIL go while it runs; a thread running Python then holds it until it blocks or the "
        "interpreter's switch interval (`sys.setswitchinterval`, Python's default 5 ms) makes it hand over. "
        "cpu share: the median share of the launch's wall its thread spent on its CPU (the step trace's "
        "`launch_cpu_s` over `launch_s`); the rest it waited. Medians of "
        f"{beside[0]['steps']} steps a setting, two passes over the settings pooled; x alone: against the launch "
        "alone at the same interval, same run.", "",
        "| other thread | switch interval ms | median launch ms | p90 launch ms | cpu share | x alone |",
        "|---|---|---|---|---|---|",
        *(f"| {r['contender']} | {r['switch_interval_ms']:g} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | "
          f"{r['cpu_share']:.2f} | {r['median_ms'] / alone[r['switch_interval_ms']]['median_ms']:.2f} |"
          for r in beside), "",
    ]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"host_{'cpu' if not torch.cuda.is_available() else 'gpu'}.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
