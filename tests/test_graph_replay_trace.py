"""Every replay of a CUDA graph is the work its capture recorded (fastrag/cuda_graphs/: decode, prefill and
attention-pass graphs).

A real graph replays the kernels of its capture with the arguments they had then: the same shapes, the same
scalars, the same addresses. Only the contents of the static buffers change between replays. The CPU emulation
re-runs the forward on every replay instead, so a forward that reads anything of the call beyond those buffers
(a host value read back from a tensor, a shape or scalar taken from the call, a tensor built from the call's host
lists) gives the right tokens there and wrong ones, silently, from a real graph. The tests here record, on the CPU
(and on a GPU with emulated graphs), every operation and Triton launch of the forward as the capture runs it
(after two warm-up runs, as `_capture_cuda_graph` does) and as each later replay runs it: operation, shapes,
strides, scalars, and each tensor as one of the graphs' own buffers or the model's and pool's tensors (by
address) or as a tensor the forward itself made (by allocation order). The replays must repeat their capture's
record exactly, read nothing back to the host, and use no tensor from elsewhere. Deliberately broken forwards
show the record catches each kind of mistake.

On a GPU the real graphs of tests/test_prefill_graphs.py and tests/test_cuda_graphs.py check the same thing
directly (a replay that is not its capture's work gives other tokens there), so benchmarks/gpu/device.sh's tests
stage, short of device time, leaves this module out; it runs on a GPU all the same, with the graphs emulated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

# (TRITON_INTERPRET=1 without a GPU, set before Triton loads, and the same device and skip rule)
from test_paged_attention_triton import DEV, pytestmark  # noqa: F401
from test_host_sync import HOST_READS  # noqa: E402

import fastrag.cuda_graphs as cg  # noqa: E402
import fastrag.cuda_graphs.decode as cg_decode  # noqa: E402
from fastrag.kernels import INTERPRETED  # noqa: E402


def _storage(t: torch.Tensor):
    """A tensor's storage address; for a tensor without one (oneDNN's packed weights on the CPU), its identity."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return ("opaque", id(t))


def _static_tensors(*roots) -> tuple[dict, list]:
    """(storage address -> a name, the tensors), for every tensor reachable from roots through the project's objects
    (their attributes, dataclass fields, lists, tuples, dicts and torch modules): the graphs' buffers, the AttnBatch
    of a decode graph, the model's weights and the KV pool. The record holds the tensors, so that none is freed while
    it runs (a forward that replaces one, e.g. the last layer's queries of a decode step, would let a new tensor take
    its address)."""
    found: dict = {}
    held: list = []
    seen: set[int] = set()
    todo = [(r, type(r).__name__) for r in roots]
    while todo:
        obj, name = todo.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel():
                found.setdefault(_storage(obj), name)
                held.append(obj)
            continue
        if isinstance(obj, torch.nn.Module):
            todo += [(t, f"{name}.{k}") for k, t in obj.named_parameters()]
            todo += [(t, f"{name}.{k}") for k, t in obj.named_buffers()]
        if isinstance(obj, (list, tuple)):
            todo += [(x, f"{name}[{i}]") for i, x in enumerate(obj)]
        elif isinstance(obj, dict):
            todo += [(x, f"{name}[{k!r}]") for k, x in obj.items()]
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            todo += [(getattr(obj, f.name, None), f"{name}.{f.name}") for f in dataclasses.fields(obj)]
        elif (type(obj).__module__.split(".")[0] in ("fastrag", "kernels") or isinstance(obj, torch.nn.Module)) \
                and hasattr(obj, "__dict__"):
            todo += [(x, f"{name}.{k}") for k, x in vars(obj).items()]
    return found, held


def _where() -> str:
    """The innermost frame of the project's code (fastrag/, kernels/) on the caller's stack."""
    for f in reversed(traceback.extract_stack()):
        if "/fastrag/" in f.filename or "/kernels/" in f.filename:
            return f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
    return "?"


class _Record(TorchDispatchMode):
    """The record of one forward (module doc): `events`, and `errors` for host reads and tensors from elsewhere."""

    def __init__(self, static: tuple[dict, list]):
        super().__init__()
        self.static, self._held = static
        self.made: dict[int, int] = {}  # storage address -> allocation order in this forward
        self.n_made = 0
        self.events: list = []
        self.errors: list[str] = []
        self.paused = 0

    def sig(self, x, where: str):
        if isinstance(x, torch.Tensor):
            opaque = isinstance(_storage(x), tuple)
            meta = (tuple(x.shape), None if opaque else tuple(x.stride()), None if opaque else x.storage_offset(),
                    str(x.dtype), x.device.type)
            if x.numel() == 0:
                return ("empty", *meta)
            p = _storage(x)
            if p in self.static:
                return ("static", self.static[p], p, *meta)
            if p in self.made:
                return ("made", self.made[p], *meta)
            self.errors.append(f"{where} at {_where()}: a tensor {meta[:2]} that is neither one of the graphs' "
                               "buffers, the model's or the pool's, nor made by this forward")
            return ("foreign", *meta)
        if isinstance(x, (list, tuple)):
            return tuple(self.sig(y, where) for y in x)
        if isinstance(x, dict):
            return tuple((k, self.sig(v, where)) for k, v in sorted(x.items()))
        if isinstance(x, float):
            return ("float", x.hex())
        if isinstance(x, (int, bool, str)) or x is None:
            return x
        return repr(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = str(func)
        if func in HOST_READS:
            self.errors.append(f"{name} at {_where()}: reads a tensor's value back to the host (a synchronisation; "
                               "a graph would replay the value of its capture)")
        ins = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.numel()}
        self.events.append((name, self.sig(args, name), self.sig(kwargs, name)))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in ins \
                    and _storage(t) not in self.static:
                self.made[_storage(t)] = self.n_made  # (a new allocation, perhaps at a freed one's address)
                self.n_made += 1
        return out

    def launch(self, fn, grid, args, kwargs):
        """A Triton kernel's launch (recorded by the patched launcher, which pauses the operation record inside)."""
        name = f"triton:{getattr(fn, '__name__', fn)}"
        grid = grid if isinstance(grid, tuple) else "callable"
        self.events.append((name, grid, self.sig(tuple(args), name), self.sig(dict(kwargs), name)))


_ACTIVE: list[_Record] = []


@contextlib.contextmanager
def _triton_launches_recorded():
    """Record Triton launches into the active _Record: the interpreter's grid executor on the CPU, JITFunction.run on
    a GPU."""
    import triton

    if INTERPRETED:
        from triton.runtime.interpreter import GridExecutor as owner

        orig = owner.__call__

        def patched(self, *args, **kwargs):
            return _launch(lambda: orig(self, *args, **kwargs), self.fn, self.grid, args, kwargs)
    else:
        owner = triton.runtime.jit.JITFunction
        orig = owner.run

        def patched(self, *args, grid, warmup, **kwargs):
            return _launch(lambda: orig(self, *args, grid=grid, warmup=warmup, **kwargs), self.fn, grid, args,
                           kwargs)
    name = "__call__" if INTERPRETED else "run"
    setattr(owner, name, patched)
    try:
        yield
    finally:
        setattr(owner, name, orig)


@contextlib.contextmanager
def _unrecorded():
    """The active _Record (or None) with its operation record paused inside (a Triton launch's interpreter, a
    CPU-only check)."""
    rec = _ACTIVE[-1] if _ACTIVE else None
    if rec is not None:
        rec.paused += 1
    try:
        yield rec
    finally:
        if rec is not None:
            rec.paused -= 1


def _launch(run, fn, grid, args, kwargs):
    with _unrecorded() as rec:
        if rec is not None and rec.paused == 1:  # (a launch inside a paused part is not this forward's own)
            rec.launch(fn, grid, args, kwargs)
        return run()


def _recorded(forward, static: tuple[dict, list]) -> _Record:
    rec = _Record(static)
    _ACTIVE.append(rec)
    try:
        with rec, torch.inference_mode():
            forward()
    finally:
        _ACTIVE.pop()
    return rec


class _Watch:
    """Records a graphs object's captures and emulated replays: `captures[key]` the capture's record, `replays` a
    list of (key, record); a key is the graph's token bucket (prefill, pass) or its _Graph's identity (decode). Its
    `_capture` runs the forward as `_capture_cuda_graph` does (two warm-ups, then the recorded run) on the buffers
    as the capture leaves them, and `_forward` records each later call."""

    def __init__(self, monkeypatch, graphs):
        self.graphs = graphs
        self.captures: dict = {}
        self.replays: list = []
        self._capturing = False
        capture, forward = graphs._capture, graphs._forward

        def _capture(*a, **kw):
            g = capture(*a, **kw)
            arg = g if isinstance(g, cg_decode._Graph) else g.M  # (what `_forward` takes)
            self._capturing = True
            try:
                for _ in range(2):
                    forward(arg)
                # (after the warm-ups, as on a GPU: what they made and kept, e.g. oneDNN's packed weights, is static)
                self.captures[self._key(arg)] = _recorded(lambda: forward(arg), _static_tensors(graphs, g))
            finally:
                self._capturing = False
            return g

        def _forward(arg):
            if self._capturing:
                return forward(arg)
            out = []
            g = arg if isinstance(arg, cg_decode._Graph) else graphs.graphs[arg]
            self.replays.append((self._key(arg), _recorded(lambda: out.append(forward(arg)),
                                                           _static_tensors(graphs, g))))
            return out[0]

        monkeypatch.setattr(graphs, "_capture", _capture)
        monkeypatch.setattr(graphs, "_forward", _forward)

    @staticmethod
    def _key(arg):
        return ("graph", id(arg)) if isinstance(arg, cg_decode._Graph) else arg

    def check(self, min_replays: int = 1) -> None:
        assert len(self.replays) >= min_replays, f"{len(self.replays)} replays recorded"
        for key, cap in self.captures.items():
            assert not cap.errors, f"capture of {key}: {cap.errors[:3]}"
            assert cap.events, f"capture of {key} recorded nothing"
        for i, (key, rec) in enumerate(self.replays):
            assert not rec.errors, f"replay {i} of {key}: {rec.errors[:3]}"
            cap = self.captures[key].events
            diff = next((j for j, (a, b) in enumerate(zip(cap, rec.events)) if a != b), None)
            assert diff is None and len(cap) == len(rec.events), (
                f"replay {i} of {key} is not its capture's work: "
                + (f"event {diff}: captured {cap[diff]!r}, replayed {rec.events[diff]!r}" if diff is not None
                   else f"{len(cap)} events captured, {len(rec.events)} replayed"))


def _checks_unrecorded(monkeypatch):
    """The paged kernels' CPU-only bounds checks (`_check_reads` of the prefill and the decode kernel: host reads by
    design; a GPU launch skips them) outside the record."""
    import fastrag.kernels.paged_attention as pa
    import fastrag.kernels.paged_prefill as pp

    for mod in (pa, pp):
        def unrecorded(*a, _check=mod._check_reads, **kw):
            with _unrecorded():
                return _check(*a, **kw)

        monkeypatch.setattr(mod, "_check_reads", unrecorded)


def _token_engine(monkeypatch):
    from test_prefill_graphs import _engine

    _checks_unrecorded(monkeypatch)
    eng = _engine(monkeypatch, True)
    # graphs of fewer sequences and tokens than the engine's (fewer padding tiles for the interpreter), emulated on a
    # GPU too, so that each replay runs the forward again
    eng.prefill_graphs = cg.PrefillGraphs(eng.model, eng.pool, ctx_blocks=eng.prefill_graphs.width, max_tokens=128,
                                          max_seqs=6, emulate=True)
    eng.pass_graphs = cg.PassGraphs(eng.model, max_tokens=64, max_seqs=4, emulate=True)
    return eng


@pytest.mark.filterwarnings("error:CUDA graph capture")  # (a failed capture fails the test)
def test_prefill_and_pass_replays_repeat_their_captures(monkeypatch):
    """Prefills over two prefixes and none, mixed in one call, then a call continuing each of fewer sequences' own
    context, and attention passes of which the second reuses the bucket the first wrote (27 and 20 tokens, both in
    the 32-token bucket): every replay is its capture's work."""
    from test_prefill_graphs import _generate

    with _triton_launches_recorded():
        eng = _token_engine(monkeypatch)
        pre, pas = _Watch(monkeypatch, eng.prefill_graphs), _Watch(monkeypatch, eng.pass_graphs)
        rng = random.Random(random.randrange(2**31))
        pa, pb = list(range(20, 36)), list(range(40, 72))  # (one block and two)
        prompts = [head + [rng.randrange(1, 80) for _ in range(rng.randint(1, 6))] for head in (pa, pb, pa, [])]
        _generate(eng, prompts, [pa, pb], [2, 2, 2, 2], rounds=2)
        for n, length in ((3, 9), (2, 10)):
            eng.attention_passes([[rng.randrange(1, 90) for _ in range(length)] for _ in range(n)], "colmax")
    pre.check(min_replays=2)
    pas.check(min_replays=2)
    assert [k for k, _ in pas.replays] == [32, 32]
    # (the record saw the kernels: the paged prefill attention and the fused small operations, every layer)
    names = {e[0] for e in pre.captures[next(iter(pre.captures))].events}
    assert any("paged_prefill" in n for n in names) and sum(n.startswith("triton:") for n in names) >= 3, names


@pytest.mark.filterwarnings("error:CUDA graph capture")
@pytest.mark.parametrize("flash", [False, True], ids=["prefix-gemms", "prefix-flash"])
def test_decode_replays_repeat_their_captures(monkeypatch, flash):
    """Decode steps as a GPU runs them (the Triton paged decode attention, the fused small operations; the shared
    prefixes as GEMMs per prefix or, $FASTRAG_PREFIX_FLASH, in one flash launch) over sequences of two prefixes and
    of none in one batch, then fewer as sequences end: every replay is its capture's work."""
    from test_paged_attention_triton import paged_decode_attention_lse
    from test_prefill_graphs import _model, _Tok

    from fastrag.engine import Engine

    _checks_unrecorded(monkeypatch)
    m = _model(monkeypatch)
    m.triton_decode, m._triton_on_cpu = paged_decode_attention_lse, DEV == "cpu"
    m.prefix_flash = flash
    flash_calls = []
    real_flash = m.fused_decode.prefix_flash_decode
    monkeypatch.setattr(m, "fused_decode", SimpleNamespace(**{
        k: getattr(m.fused_decode, k) for k in ("add_rms_norm", "rope_write_kv", "silu_mul", "prefix_softmax",
                                                "prefix_merge")},
        prefix_flash_decode=lambda *a, **kw: flash_calls.append(a[3]) or real_flash(*a, **kw)))
    with _triton_launches_recorded():
        eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, mix_prefill=True, cuda_graphs=True,
                     prefill_graphs=False, pass_graphs=False)
        if not eng.graphs.emulate:
            eng.graphs.emulate, eng.graphs.mempool = True, None
        w = _Watch(monkeypatch, eng.graphs)
        rng = random.Random(random.randrange(2**31))
        pa, pb = list(range(20, 52)), list(range(40, 88))
        eng.set_prefix(" ".join(map(str, pa)))
        eng.set_prefix(" ".join(map(str, pb)))
        prompts = [head + [rng.randrange(1, 80) for _ in range(rng.randint(1, 20))]
                   for head in (pa, pb, pa, [], pb)]
        seqs = [eng.new_sequence() for _ in prompts]
        # the first sequence outlives the rest (11 decode steps), so the batch always shrinks to it alone: five random
        # budgets all <= 5 (1 in 400) left fewer than 5 replays
        for k, (s, p) in enumerate(zip(seqs, prompts)):
            eng.start(s, p, 12 if k == 0 else rng.randint(3, 11))
        while eng.has_work:
            eng.step()
    assert eng.graphs.stats["eager_steps"] == 0
    w.check(min_replays=5)
    assert len(w.captures) >= 2  # (several batch buckets or prefix sets)
    assert bool(flash_calls) == flash and (not flash or max(map(len, flash_calls)) == 2)


@pytest.mark.parametrize("mistake", ["host_read", "call_shape", "host_tensor"])
def test_the_record_catches_a_forward_that_depends_on_the_call(monkeypatch, mistake):
    """Three prefill forwards that are right when run eagerly and wrong from a real graph: one that reads a value
    back to the host (`int()` of a token), one that slices by the call's sequence count (a shape of the capture's
    call), one that builds a tensor from the call's host lengths. The emulation runs each again on every replay, so
    its tokens look right; the record names its mistake."""
    from test_prefill_graphs import _generate

    from fastrag.model.llama import LlamaModel

    call = {}
    static = LlamaModel.prefill_static

    def broken(self, ids, positions, write_slots, paged, rows, k_pool, v_pool, out):
        if mistake == "host_read":
            ids = ids if int(ids[0]) >= 0 else ids
        elif mistake == "call_shape":
            rows = rows[: call["B"]]
        else:
            lens = torch.tensor(call["lens"], device=ids.device)
            rows = rows + 0 * lens.sum()
        return static(self, ids, positions, write_slots, paged, rows, k_pool, v_pool, out)

    with _triton_launches_recorded():
        eng = _token_engine(monkeypatch)
        g = eng.prefill_graphs
        run = g.run
        monkeypatch.setattr(g, "run", lambda tokens, *a: call.update(B=len(tokens), lens=[len(t) for t in tokens])
                            or run(tokens, *a))
        monkeypatch.setattr(LlamaModel, "prefill_static", broken)
        w = _Watch(monkeypatch, g)
        # three sequences of 3-5 tokens, then one of 5 continuing its own context: both in the 16-token bucket
        _generate(eng, [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]], [], [1, 1, 1], rounds=2)
    assert g.stats["replays"] == 2 and sorted(g.graphs) == [16]
    with pytest.raises(AssertionError) as e:
        w.check()
    want = {"host_read": "reads a tensor's value back to the host", "call_shape": "is not its capture's work",
            "host_tensor": "neither one of the graphs' buffers"}[mistake]
    assert want in str(e.value), str(e.value)[:600]
