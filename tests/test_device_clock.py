"""The engine's device clock (`Engine.clock`, stats device_prefill_s / device_decode_s / device_passes_s): how long the
device was busy in the steps' prefills, decode steps and attention passes, beside the run's wall time.

On a GPU a phase is a pair of CUDA events read once the device has passed its end, never by waiting for it; on a CPU it
is the launch's host seconds. The pairing and deferral logic is checked here on the CPU with events that complete
when the test says; the real events run in the GPU test stage (benchmarks/gpu/device.sh)."""

from __future__ import annotations

import pytest
import torch

from fastrag.engine import DeviceClock, Engine
from fastrag.perf import device_busy, floor, phases

from engine_fakes import IntTok as _Tok
from engine_fakes import tiny_dragin_run, tiny_llama

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("device_prefill_s", "device_decode_s", "device_passes_s")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, device=DEV)


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
    # (on a CPU these are host seconds of the launches: the least of 3 runs each, the small and the big runs taking
    # turns, so that another process's load on a 2-core machine, which comes and goes, does not decide it; one run of
    # 2 sequences once measured more than one of 8 in CI)
    runs = {1: [], 8: []}
    for _ in range(3):
        for n in runs:
            runs[n].append(_run(model, n=n, passes=False).stats)
    small, big = (min(runs[n], key=lambda st: st["device_decode_s"]) for n in (1, 8))
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

    def record(self, stream=None):
        assert stream == "stream of cpu", stream  # (the clock records on its own device's stream)
        self.t = _Event.now

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Event") -> float:
        assert self.done and end.done, "elapsed_time of an event the device has not reached"
        return (end.t - self.t) * 1e3


@pytest.fixture
def gpu_clock(monkeypatch):
    """A DeviceClock on its GPU branch with the stand-in events, and its totals."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    _Event.now, _Event.instances = 0.0, []
    totals = dict.fromkeys(KEYS, 0.0)
    clock = DeviceClock(torch.device("cpu"), totals)
    clock.cuda = True
    return clock, totals


def test_a_gpu_phase_counts_only_once_its_end_has_completed(gpu_clock):
    clock, totals = gpu_clock
    a = clock.mark()
    _Event.now = 0.25
    end = torch.cuda.Event(enable_timing=True)
    end.record("stream of cpu")
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


def test_a_gpu_phase_left_pending_while_a_later_one_completes(gpu_clock):
    clock, totals = gpu_clock
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


# ---------------------------------------------------------------------------------------------- per-step trace


def test_the_engine_s_trace_rows_add_up_to_its_counters(model):
    eng = Engine(model, _Tok(), kv_cache_gb=0.01, max_batch=8)
    eng.trace = []
    g = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(7):
        s = eng.new_sequence()
        eng.start(s, torch.randint(1, 97, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist(), 6 + i)
        seqs.append(s)
    n = 0
    while eng.has_work:
        if n == 3:  # a late arrival: a prefill in the middle of the decode steps
            s = eng.new_sequence()
            eng.start(s, [4, 5, 6, 7, 8, 9], 5)
        eng.step()
        n += 1
    rows, st = eng.trace, eng.stats
    assert len(rows) == n and [r["step"] for r in rows] == list(range(n))
    assert sum(r["decode_batch"] for r in rows) == st["decode_tokens"]
    assert sum(r["prefill_tokens"] for r in rows) == st["prefill_tokens"]  # (no prefix, no passes here)
    assert sum(1 for r in rows if r["prefill_seqs"]) == 2  # the first group and the late one
    for k in KEYS[:2]:
        assert sum(r.get(k, 0.0) for r in rows) == pytest.approx(st[k], rel=1e-9, abs=1e-12)
    assert all(r["launch_s"] > 0 and "finish_s" in r for r in rows)
    assert all(("device_decode_s" in r) == (r["decode_batch"] > 0) for r in rows)
    # each decode step's KV entries read (its floor's, fastrag.perf.decode_step_floor) add up to the engine's
    for k in ("decode_ctx_tokens", "decode_prefix_tokens"):
        assert sum(r.get(k, 0) for r in rows) == st[k]
        assert all((k in r) == (r["decode_batch"] > 0) for r in rows)
    assert all(r["decode_ctx_tokens"] >= 6 * r["decode_batch"] for r in rows if r["decode_batch"])
    assert all(r["decode_prefixes"] == 0 for r in rows if r["decode_batch"])  # (no shared prefix here)


def test_trace_rows_count_a_shared_prefix_once_per_decode_step(model):
    """Sequences of one shared prefix: each decode step's row counts the prefix's entries once (read once for the
    batch) and each sequence's own context: its prompt after the prefix and the tokens generated before the step."""
    eng = Engine(model, _Tok(), kv_cache_gb=0.01, max_batch=8)
    eng.set_prefix(" ".join(str(t) for t in range(20, 52)))  # 32 tokens
    eng.trace = []
    prompts = [list(range(20, 52)) + [5] * n for n in (3, 9, 14)]
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        eng.start(s, p, 5)
    while eng.has_work:
        eng.step()
    dec = [r for r in eng.trace if r["decode_batch"]]
    assert dec and all(r["decode_prefix_tokens"] == 32 and r["decode_prefixes"] == 1 for r in dec)
    # decode step j (0-based) of a batch that started together: sequence i has n_i + j entries of its own cached
    # (its prompt after the prefix, the tokens fed by the steps before) and attends to the one it feeds now too
    for j, r in enumerate(dec):
        assert r["decode_batch"] == 3 and r["decode_ctx_tokens"] == sum(n + j + 1 for n in (3, 9, 14))


def test_trace_summary_on_steps_of_known_times():
    from fastrag.perf import trace_summary

    rows = [  # step wall, device seconds: idle = wall - device, never below 0
        {"step": 0, "prefill_seqs": 2, "decode_batch": 2, "device_prefill_s": 0.03, "device_decode_s": 0.01,
         "window_s": 0.002, "step_s": 0.05},  # idle 0.01
        {"step": 1, "prefill_seqs": 0, "decode_batch": 2, "device_decode_s": 0.01, "device_passes_s": 0.004,
         "window_s": 0.03, "step_s": 0.034},  # idle 0.02 (> half: a host-bound step)
        {"step": 2, "prefill_seqs": 0, "decode_batch": 2, "device_decode_s": 0.012, "window_s": 0.001,
         "step_s": 0.011},  # idle 0 (the device ran past the host's clock: not negative)
        {"step": 3, "prefill_seqs": 0, "decode_batch": 1},  # launched without the scheduler's timing
    ]
    s = trace_summary(rows)
    assert s["steps"] == 4 and s["steps_timed"] == 3
    assert s["step_s"] == pytest.approx(0.095) and s["device_s"] == pytest.approx(0.066)
    assert s["idle_s"] == pytest.approx(0.03)
    assert s["idle_in_prefill_steps_s"] == pytest.approx(0.01) and s["idle_in_steps_with_passes_s"] == pytest.approx(0.02)
    assert s["steps_idle_over_half"] == 1
    assert s["median_step_ms"] == pytest.approx(34.0) and s["median_device_decode_ms"] == pytest.approx(10.0)
    assert s["median_window_ms"] == pytest.approx(2.0)
    k = s["by_kind"]
    assert set(k) == {"prefill", "passes", "decode"} and [k[x]["steps"] for x in ("prefill", "passes", "decode")] == [1, 1, 1]
    assert k["prefill"]["idle_s"] == pytest.approx(0.01) and k["passes"]["device_s"] == pytest.approx(0.014)
    assert k["decode"]["median_step_ms"] == pytest.approx(11.0) and s["graph_captures"] == 0
    assert s["steps_under_16_sequences"] == 3 and s["step_s_under_16_sequences"] == pytest.approx(0.095)
    cap = trace_summary(rows[:2] + [dict(rows[2], graph_captures=2, decode_batch=20)])
    assert cap["graph_captures"] == 2 and cap["by_kind"]["graph_capture"]["steps"] == 1
    assert "decode" not in cap["by_kind"] and cap["steps_under_16_sequences"] == 2
    assert trace_summary([{"step": 0}]) == {"steps": 1, "steps_timed": 0}
    assert "prefill_graphed" not in s  # (rows that do not say: no prefill graphs)
    graphed = [dict(rows[0], prefill_graphed=True, prefill_tokens=40),
               dict(rows[0], prefill_graphed=True, prefill_tokens=60, device_prefill_s=0.01),
               dict(rows[0], prefill_graphed=False, prefill_tokens=900, device_prefill_s=0.05)]
    g = trace_summary(graphed + rows[1:])
    assert g["prefill_graphed"]["steps"] == 2 and g["prefill_graphed"]["median_tokens"] == 50
    assert g["prefill_graphed"]["device_s"] == pytest.approx(0.04)
    assert g["prefill_graphed"]["median_device_ms"] == pytest.approx(20.0)
    assert g["prefill_eager"] == {"steps": 1, "device_s": pytest.approx(0.05), "median_tokens": 900,
                                  "median_device_ms": pytest.approx(50.0)}


def test_decode_steps_against_their_floor_by_batch_size():
    """Each decode step's floor is its weights plus the KV entries it read at the copy bandwidth, or its FLOPs at the
    matmul rate, whichever is longer; steps group by batch size, with an "all" row when there are several groups;
    steps without the counts (older traces) or without device seconds are left out."""
    from fastrag.perf import DeviceFigures, decode_step_floor, decode_steps_vs_floor

    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    r = {"decode_batch": 4, "decode_ctx_tokens": 80, "decode_prefix_tokens": 20, "device_decode_s": 0.5}
    assert decode_step_floor(r, costs, dev) == pytest.approx(0.2)  # bytes (1000 + 100 x 10) / 1e4 over 1200 / 2e4
    big = {"decode_batch": 200, "decode_ctx_tokens": 100, "decode_prefix_tokens": 0, "device_decode_s": 4.0}
    assert decode_step_floor(big, costs, dev) == pytest.approx(2.02)  # FLOPs (40000 + 400) / 2e4 over 2000 / 1e4
    rows = [r, dict(r, device_decode_s=0.3), big, {"decode_batch": 4, "device_decode_s": 0.1},
            {"decode_batch": 0}, dict(r, device_decode_s=None)]
    small, large, everything = decode_steps_vs_floor(rows, costs, dev)
    assert (small["batch"], small["steps"], large["batch"], large["steps"]) == ("1-15", 2, "192+", 1)
    assert small["median_device_ms"] == pytest.approx(400.0) and small["median_floor_ms"] == pytest.approx(200.0)
    assert small["median_ctx_per_seq"] == 20 and small["median_prefix_entries"] == 20
    assert small["device_over_floor"] == pytest.approx(0.8 / 0.4)
    assert everything["batch"] == "all" and everything["steps"] == 3
    assert everything["device_s"] == pytest.approx(4.8) and everything["floor_s"] == pytest.approx(2.42)
    assert [x["batch"] for x in decode_steps_vs_floor([r], costs, dev)] == ["1-15"]  # (one group: no "all")
    assert decode_steps_vs_floor([{"decode_batch": 4, "device_decode_s": 0.1}], costs, dev) == []
    # by the number of shared prefixes in the step (rows without the count left out)
    mixed = [dict(r, decode_prefixes=1), dict(r, decode_prefixes=3, device_decode_s=0.9),
             dict(big, decode_prefixes=5), r]
    one, three, both = decode_steps_vs_floor(mixed, costs, dev, by="prefixes")
    assert (one["prefixes"], one["steps"], three["prefixes"], three["steps"]) == ("1", 1, "3+", 2)
    assert three["median_prefixes"] == 4 and three["median_batch"] == 102
    assert three["device_s"] == pytest.approx(4.9) and both["prefixes"] == "all" and both["steps"] == 3


def test_prefill_steps_and_attention_passes_against_their_floor_by_tokens():
    """A forward's floor is its weights read once per forward plus its tokens' KV at the copy bandwidth, or its FLOPs
    (2 per weight per token, the LM head left out, plus 4 x heads x dim per attention entry) at the matmul rate,
    whichever is longer; prefill steps and passes group by the tokens in the step, with their own fields, an "all"
    row when there are several groups, and rows without the counts or the device seconds left out."""
    from fastrag.perf import DeviceFigures, forward_floor, forwards_vs_floor

    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    assert forward_floor(2, 10, 50, costs, dev) == pytest.approx(0.21)  # bytes 2000 + 100 over FLOPs 1400 + 200
    assert forward_floor(1, 300, 1000, costs, dev) == pytest.approx(2.3)  # FLOPs 42000 + 4000 over bytes 4000
    small = {"prefill_tokens": 10, "prefill_calls": 2, "prefill_ctx_tokens": 50, "prefill_seqs": 3,
             "device_prefill_s": 0.42, "prefill_graphed": True}
    large = {"prefill_tokens": 300, "prefill_calls": 1, "prefill_ctx_tokens": 1000, "prefill_seqs": 1,
             "device_prefill_s": 4.6, "prefill_graphed": False}
    rows = [small, dict(small, device_prefill_s=0.63, prefill_graphed=False), large,
            {"prefill_tokens": 10, "device_prefill_s": 0.1}, dict(small, device_prefill_s=None), {"prefill_tokens": 0}]
    lo, hi, everything = forwards_vs_floor(rows, costs, dev)
    assert (lo["tokens"], lo["steps"], lo["graphed_steps"], hi["tokens"], hi["steps"]) == ("1-63", 2, 1, "256-599", 1)
    assert lo["median_forwards"] == 2 and lo["median_seqs"] == 3 and lo["median_tokens"] == 10
    assert lo["median_floor_ms"] == pytest.approx(210.0) and lo["median_device_ms"] == pytest.approx(525.0)
    assert lo["median_device_over_floor"] == pytest.approx(2.5) and lo["device_over_floor"] == pytest.approx(2.5)
    assert hi["median_device_over_floor"] == pytest.approx(2.0)
    assert everything["tokens"] == "all" and everything["steps"] == 3
    assert everything["device_s"] == pytest.approx(5.65) and everything["floor_s"] == pytest.approx(2.72)
    assert [x["tokens"] for x in forwards_vs_floor([small], costs, dev)] == ["1-63"]  # (one group: no "all")
    # passes: their own fields, read from the same rows; a step's prefill fields are not the passes'
    p = {"pass_tokens": 1100, "pass_calls": 2, "pass_ctx_tokens": 4000, "pass_lists": 9, "device_passes_s": 10.0,
         "pass_graphed": 1}
    (one,) = forwards_vs_floor([dict(small, **p), small], costs, dev, kind="passes")
    assert (one["tokens"], one["steps"], one["median_seqs"], one["graphed_steps"]) == ("1024+", 1, 9, 1)
    assert one["median_floor_ms"] == pytest.approx(1e3 * (140 * 1100 + 16000) / 2e4)
    assert forwards_vs_floor(rows, costs, dev, kind="passes") == []


def test_a_run_writes_its_step_trace_when_asked(tmp_path, monkeypatch):
    """fastrag.eval with $FASTRAG_STEP_TRACE=1 and overlap: step_trace.jsonl (one row per engine step, the
    scheduler's timings in it) and its summary in metrics.json; without the switch neither."""
    import json

    from fastrag.eval import run

    opts = tiny_dragin_run(tmp_path)
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "1")
    m = run(opts("traced"))
    rows = [json.loads(x) for x in (tmp_path / "traced" / "step_trace.jsonl").read_text().splitlines()]
    assert m["step_trace"]["steps"] == len(rows) == m["step_trace"]["steps_timed"] > 0
    assert sum(r["decode_batch"] for r in rows) == m["engine"]["decode_tokens"]
    assert sum(r["decode_batch"] > 0 for r in rows) == m["engine"]["decode_steps"]
    assert all("step_s" in r and "window_s" in r for r in rows)
    # (the launch's thread CPU seconds: at most its wall, give or take the two clocks' granularity)
    assert all(0 <= r["launch_cpu_s"] <= r["launch_s"] + 2e-3 for r in rows if not r.get("passes_only"))
    assert m["step_trace"]["device_s"] <= m["step_trace"]["step_s"] * 1.05 + 0.01
    # on a CPU a phase's device seconds are its launch's host seconds: within its own step's wall. The passes of a
    # step that launched no engine step are that step's (a passes_only row), not the last launched step's, whose
    # wall was already closed (they once were: a row of 14 ms with 19 ms of device time)
    from fastrag.perf import DEVICE_KEYS

    assert all(sum(r.get(k, 0.0) for k in DEVICE_KEYS) <= r["step_s"] + 1e-3 for r in rows)
    assert all(r.get("device_passes_s", 0.0) <= r.get("passes_s", 0.0) + 1e-3 for r in rows)  # (inside the step's
    # host seconds for its passes; the stale row's exceeded them in every run before the passes_only rows)
    only = [r for r in rows if r.get("passes_only")]
    assert all(r["decode_batch"] == r["prefill_seqs"] == 0 and r["pass_calls"] >= 1 for r in only)
    # the launches keep their numbers (0, 1, 2, ...: $FASTRAG_KERNEL_PROFILE's window counts them), a passes_only
    # row the number of the launch before it
    assert [r["step"] for r in rows if not r.get("passes_only")] == list(range(len(rows) - len(only)))
    assert all(r["step"] == rows[i - 1]["step"] for i, r in enumerate(rows) if r.get("passes_only"))
    # the forwards of the prefill steps and of the attention passes, which the engine counts as prefill work: with
    # the shared prefix's own prefill (before the first step) they are the counters' prefill tokens and calls
    st = m["engine"]
    pre = [r for r in rows if r["prefill_tokens"]]
    passes = [r for r in rows if r.get("pass_tokens")]
    assert pre and passes and all(r["prefill_calls"] >= 1 and r["prefill_ctx_tokens"] > 0 for r in pre)
    assert all(r["pass_calls"] >= 1 and r["pass_lists"] >= r["pass_calls"] for r in passes)
    assert all(r["pass_ctx_tokens"] >= r["pass_tokens"] and r["device_passes_s"] > 0 for r in passes)
    n = st["prefill_tokens"] - sum(r["prefill_tokens"] + r.get("pass_tokens", 0) for r in rows)  # the prefix's
    assert st["prefill_calls"] - sum(r["prefill_calls"] for r in pre) == 1 and n > 0  # (one dataset: one prefix)
    assert st["prefix_hit_tokens"] % n == 0  # (every sequence starts on it)
    assert st["prefill_ctx_tokens"] - sum(r["prefill_ctx_tokens"] for r in pre) \
        - sum(r["pass_ctx_tokens"] for r in passes) == n * (n + 1) // 2
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "0")
    m = run(opts("plain"))
    assert "step_trace" not in m and not (tmp_path / "plain" / "step_trace.jsonl").exists()
