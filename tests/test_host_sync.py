"""The decode step's launch never waits for the device (DESIGN.md "Performance model": one host copy per step, in
`step_finish`), nor does a prefill step's, but for the copy of its first tokens that it ends in. A host read of a device value in `Engine.step_launch` (an `int()`, `.item()`, `bool()` of a tensor,
a `nonzero`) would stall the host until the GPU drains its queue, and the device would then idle while the host
prepares the next launch: the overlap of the methods' logic with the step would be gone without any test noticing
a wrong token.

On a GPU, `torch.cuda.set_sync_debug_mode("error")` turns every synchronising CUDA call into an error. On the CPU
nothing synchronises, so a dispatch mode records the operations that read tensor values into Python or have
data-dependent shapes (what synchronises on a GPU): it sees an `int()`, `.item()`, `bool()` or `nonzero` of any
tensor, host tensors included (so the launch builds its host-side index lists without them), but not `.tolist()`
or `.cpu()`, which the GPU's check does see; it also flags `torch.tensor(..., device=...)`, a synchronous copy on
a GPU. The signal kernels are left out of the CPU's watch: its torch decode
signals look at their rows on the host by design, and take a path without that on a GPU."""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastrag.engine import Engine, ModelRunner, SamplingParams
from fastrag.model.llama import LlamaModel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
aten = torch.ops.aten

# operations whose result the host must read from the tensor (each a device synchronisation on a GPU)
HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.is_nonzero.default, aten.equal.default,
              aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
              aten.unique_dim.default}


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


CFG = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
           num_key_value_heads=2, eos_token_id=None)


def _where() -> list[str]:
    """The fastrag frames of the caller's stack, innermost last."""
    return [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-9:-2]
            if "fastrag" in f.filename]


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func in HOST_READS:
            self.seen.append(f"{func} at {_where()}")
        return func(*args, **(kwargs or {}))


class _Unwatched:
    """The engine's signal backend with every call made outside the watch."""

    def __init__(self, inner, mode: _HostReads):
        self._inner, self._mode = inner, mode

    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if not callable(fn):
            return fn

        def call(*a, **kw):
            self._mode.paused += 1
            try:
                return fn(*a, **kw)
            finally:
                self._mode.paused -= 1
        return call


@contextlib.contextmanager
def _unwatched(targets, pause, resume):
    """Run the given (object, method name) outside the watch: a graph captured inside it (a batch or context size
    first seen there) is a one-off cost that synchronises by design (torch.cuda.graph does), and so is the host
    copy of a prefill's first tokens."""
    saved = []
    for obj, name in targets:
        fn = getattr(obj, name)

        def unwatched(*a, _fn=fn, **kw):
            pause()
            try:
                return _fn(*a, **kw)
            finally:
                resume()

        setattr(obj, name, unwatched)
        saved.append((obj, name))
    try:
        yield
    finally:
        for obj, name in saved:
            delattr(obj, name)  # the instance attribute goes: the class's method is back


@contextlib.contextmanager
def _no_host_reads(eng: Engine, first_tokens: bool = False):
    """Fail if what runs inside reads a device value on the host. first_tokens: a prefill's host copy of its
    first tokens (`ModelRunner.append_batch`, the synchronisation it ends in by design) runs outside the watch."""
    targets = [(g, "_capture") for g in (eng.graphs, eng.prefill_graphs, eng.pass_graphs) if g is not None] \
        + ([(eng.runner, "append_batch")] if first_tokens else [])
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with _unwatched(targets, lambda: torch.cuda.set_sync_debug_mode("default"),
                            lambda: torch.cuda.set_sync_debug_mode("error")):
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    mode = _HostReads()
    inner, eng.signals = eng.signals, _Unwatched(eng.signals, mode)

    def pause():
        mode.paused += 1

    def resume():
        mode.paused -= 1

    # a tensor made from host values straight on a device (torch.tensor(..., device=...)) is a synchronous copy on
    # a GPU; fastrag.transfer.tensor_on enqueues it instead
    made = torch.tensor

    def tensor(*a, **kw):
        if kw.get("device") is not None and not mode.paused:
            mode.seen.append(f"torch.tensor(..., device={kw['device']}) at {_where()}")
        return made(*a, **kw)

    torch.tensor = tensor
    try:
        with mode, _unwatched(targets, pause, resume):
            yield
    finally:
        eng.signals = inner
        torch.tensor = made
    assert not mode.seen, "host reads of tensor values in the launch:\n" + "\n".join(mode.seen)


def _model() -> LlamaModel:
    from transformers import LlamaConfig

    return LlamaModel.from_hf_config(LlamaConfig(**CFG), seed=3, device=DEV)


def _engine(graphs: bool, prefixes: int, sampling: SamplingParams | None = None) -> tuple[Engine, list]:
    m = _model()
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=16, cuda_graphs=graphs, sampling=sampling)
    g = torch.Generator().manual_seed(7)
    seqs = []
    for k in range(prefixes):
        head = list(range(20 + 40 * k, 52 + 40 * k))  # two whole blocks of 16
        eng.set_prefix(" ".join(map(str, head)))
        for i in range(5):
            s = eng.new_sequence()
            body = torch.randint(1, 96, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            # some sequences track the attention their generated tokens receive (DRAGIN's RIND), fed per step
            eng.start(s, head + body, 40, track_from=len(head) + len(body) - 2 if i % 2 else None)
            seqs.append(s)
    return eng, seqs


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("prefixes", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_step_launch_reads_nothing_from_the_device(graphs, prefixes, temperature):
    sp = SamplingParams(temperature=temperature, top_p=0.9, seed=1) if temperature else None
    eng, seqs = _engine(graphs, prefixes, sp)
    while eng.waiting:  # the prefills (one prefix a step)
        eng.step()
    for _ in range(3):  # the tracked tokens fed, every graph captured and every kernel compiled
        eng.step()
    launched = 0
    for _ in range(6):
        assert not eng.waiting and eng.running
        with _no_host_reads(eng):
            st = eng.step_launch()
        eng.step_finish(st)
        launched += 1
    assert launched == 6 and all(len(s.out.ids) >= 9 for s in seqs)
    if graphs and DEV == "cuda":
        assert eng.graphs.stats["replays"] >= 6 and eng.graphs.disabled is None


@pytest.mark.parametrize("prefixes", [1, 2])
def test_prefill_launch_reads_only_its_first_tokens(prefixes):
    """A step that prefills prompts of very different lengths (the packed forward, per-bucket attention; with two
    prefixes in one forward) reads nothing from the device but the first tokens' copy it ends in."""
    eng = Engine(_model(), Tok(), kv_cache_gb=0.02, max_batch=16, mix_prefill=True)
    g = torch.Generator().manual_seed(11)
    seqs = []
    for k in range(prefixes):
        head = list(range(20 + 40 * k, 52 + 40 * k))
        eng.set_prefix(" ".join(map(str, head)))
        for n in (1, 70, 6, 33, 2):
            s = eng.new_sequence()
            eng.start(s, head + torch.randint(1, 96, (n,), generator=g).tolist(), 4)
            seqs.append(s)
    eng.attention_passes([[1, 2, 3]], "colmax")  # (nothing compiled inside the watch)
    calls = eng.stats["prefill_calls"]
    with _no_host_reads(eng, first_tokens=True):
        st = eng.step_launch()
    eng.step_finish(st)
    assert eng.stats["prefill_calls"] == calls + 1 and not eng.waiting  # one packed forward for all of them
    assert all(len(s.out.ids) >= 1 for s in seqs)


@pytest.mark.parametrize("graphs", [True, False])
def test_async_prefill_launch_reads_nothing_from_the_device(graphs):
    """With async_prefill, a step that prefills new prompts beside a running decode batch waits for nothing at all:
    the first tokens' copy goes to the host with the decode step's, read in step_finish."""
    # (prefill_hold=0: on CUDA the default hold would keep the new prompts waiting past the watched launch)
    eng = Engine(_model(), Tok(), kv_cache_gb=0.02, max_batch=16, mix_prefill=True, cuda_graphs=graphs,
                 async_prefill=True, prefill_hold=0)
    g = torch.Generator().manual_seed(13)
    head = list(range(20, 52))
    eng.set_prefix(" ".join(map(str, head)))
    old = []
    for n in (4, 9):
        s = eng.new_sequence()
        eng.start(s, head + torch.randint(1, 96, (n,), generator=g).tolist(), 30)
        old.append(s)
    for _ in range(4):  # their prefill, then decode steps (every graph and kernel of this batch made)
        eng.step()
    eng.attention_passes([[1, 2, 3]], "colmax")  # (nothing compiled inside the watch)
    new = []
    for n in (1, 70, 6):
        s = eng.new_sequence()
        eng.start(s, head + torch.randint(1, 96, (n,), generator=g).tolist(), 4)
        new.append(s)
    calls = eng.stats["prefill_calls"]
    with _no_host_reads(eng):  # (no first-tokens exemption)
        st = eng.step_launch()
    assert eng.stats["prefill_calls"] == calls + 1 and st.batch == old
    assert sorted(map(id, st.joining)) == sorted(map(id, new))  # (the prefill takes them shortest first)
    eng.step_finish(st)
    # (the old ones: a first token with their prefill step, then one a decode step)
    assert all(len(s.out.ids) == 1 for s in new) and all(len(s.out.ids) == 5 for s in old)


@pytest.mark.parametrize("kind", ["colmax", "rows"])
def test_attention_pass_launch_reads_nothing_from_the_device(kind):
    eng, _ = _engine(False, 1)
    lists = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33)]
    eng.attention_passes(lists, kind)  # kernels compiled
    with _no_host_reads(eng):
        pending = eng.attention_passes_launch(lists, kind)
    out = eng.attention_passes_finish(pending)
    assert [len(x) for x in out] == [5, 17, 33]


def test_the_watch_catches_a_host_read(monkeypatch):
    """The check itself: a launch that reads a device value (an int() of a sum, as a prefill once did) fails."""
    eng, _ = _engine(False, 1)
    eng.step()
    decode = ModelRunner.decode

    def reading(self, seqs):
        logits = decode(self, seqs)
        int(logits.argmax())
        return logits

    monkeypatch.setattr(ModelRunner, "decode", reading)
    with pytest.raises((AssertionError, RuntimeError)):
        with _no_host_reads(eng):
            st = eng.step_launch()
        eng.step_finish(st)
