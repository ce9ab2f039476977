"""The engine's device clock (`Engine.clock`, stats device_prefill_s / device_decode_s / device_passes_s): how long the
device was busy in the steps' prefills, decode steps and attention passes, beside the run's wall time.

On a GPU a phase is a pair of CUDA events read once the device has passed its end, never by waiting for it; on a CPU it
is the launch's host seconds. The pairing and deferral logic is checked here on the CPU with events that complete
when the test says; the real events run in the GPU test stage (benchmarks/gpu/device.sh)."""

from __future__ import annotations

import pytest
import torch

from fastrag.engine import DeviceClock, Engine
from fastrag.model.llama import LlamaModel
from fastrag.perf import device_busy, floor, phases

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("device_prefill_s", "device_decode_s", "device_passes_s")


class _Tok:
    eos_token_id = None


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    return LlamaModel.from_hf_config(cfg, seed=3, device=DEV)


def _run(model, n: int = 6, passes: bool = True):
    eng = Engine(model, _Tok(), kv_cache_gb=0.01, max_batch=8)
    g = torch.Generator().manual_seed(11)
    for i in range(n):
        s = eng.new_sequence()
        eng.start(s, torch.randint(1, 97, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist(),
                  12 + i)
    if passes:
        eng.attention_passes([[3, 4, 5, 6], [7, 8, 9]], "colmax")
    while eng.has_work:
        eng.step()
    return eng


def test_every_phase_is_timed_and_within_its_host_seconds(model):
    eng = _run(model)
    st = eng.stats
    assert all(st[k] > 0 for k in KEYS), st
    assert eng.clock.pending == 0  # every step was waited for: nothing left uncounted
    if DEV == "cpu":  # the work runs as launched: the device seconds are a part of the launches' host seconds
        assert st["device_prefill_s"] <= st["prefill_s"] + 1e-6
        assert st["device_decode_s"] <= st["decode_s"] + 1e-6
    else:  # the device may run a little after the launch, never longer than the launch plus its wait by much
        assert st["device_decode_s"] <= st["decode_s"] * 1.5 + 0.05


def test_more_work_more_device_seconds(model):
    small = _run(model, n=2, passes=False).stats
    big = _run(model, n=8, passes=False).stats
    assert big["decode_steps"] > small["decode_steps"]
    assert big["device_decode_s"] > small["device_decode_s"]
    assert small["device_passes_s"] == 0.0  # no pass, no time


class _Event:
    """A stand-in for torch.cuda.Event: recorded at the test's clock, complete when the test says."""

    now = 0.0
    instances: list["_Event"] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing, "the clock's events must time"
        self.t, self.done = None, False
        _Event.instances.append(self)

    def record(self):
        self.t = _Event.now

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Event") -> float:
        assert self.done and end.done, "elapsed_time of an event the device has not reached"
        return (end.t - self.t) * 1e3


def test_a_gpu_phase_counts_only_once_its_end_has_completed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.now, _Event.instances = 0.0, []
    totals = dict.fromkeys(KEYS, 0.0)
    clock = DeviceClock(torch.device("cpu"), totals)
    clock.cuda = True  # (the GPU branch, with the stand-in events)
    a = clock.mark()
    _Event.now = 0.25
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    clock.stop("device_decode_s", a, end)
    assert totals["device_decode_s"] == 0.0 and clock.pending == 1  # not reached yet: not read, not waited for
    b = clock.mark()
    _Event.now = 0.75
    clock.stop("device_prefill_s", b)  # no end event given: a mark now ends it
    for ev in _Event.instances:
        ev.done = True
    clock.settle()
    assert totals["device_decode_s"] == pytest.approx(0.25) and totals["device_prefill_s"] == pytest.approx(0.5)
    assert clock.pending == 0
    clock.settle()  # counted once
    assert totals["device_decode_s"] == pytest.approx(0.25)


def test_a_gpu_phase_left_pending_while_a_later_one_completes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.now, _Event.instances = 0.0, []
    totals = dict.fromkeys(KEYS, 0.0)
    clock = DeviceClock(torch.device("cpu"), totals)
    clock.cuda = True
    a = clock.mark()
    _Event.now = 1.0
    clock.stop("device_passes_s", a)
    first_end = _Event.instances[-1]
    c = clock.mark()
    _Event.now = 3.0
    clock.stop("device_decode_s", c)
    for ev in _Event.instances:
        ev.done = ev is not first_end and ev is not a
    clock.settle()
    assert totals == {"device_prefill_s": 0.0, "device_decode_s": pytest.approx(2.0), "device_passes_s": 0.0}
    assert clock.pending == 1
    a.done = first_end.done = True
    clock.settle()
    assert totals["device_passes_s"] == pytest.approx(1.0) and clock.pending == 0


def test_device_busy_in_the_floor_report(model):
    eng = _run(model)
    st = dict(eng.stats)
    from fastrag.perf import model_costs

    wall = sum(st[k] for k in KEYS) * 2 + st["prefix_prefill_s"] * 2  # half the wall busy
    m = {"engine": st, "wall_s": wall, "model_costs": model_costs(model), "step_seconds": {}}
    f = floor(st, m["model_costs"], {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11})
    r = phases(m, f)
    assert r["device_busy_s"] == pytest.approx(device_busy(st))
    assert r["device_busy_fraction"] == pytest.approx(0.5)
    old = {k: v for k, v in st.items() if k not in KEYS}  # a run from before the clock
    r = phases(m | {"engine": old}, f)
    assert r["device_busy_s"] is None and r["device_busy_fraction"] is None
