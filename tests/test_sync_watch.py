"""The overlap window's synchronisation watch (fastrag.sync_watch, $FASTRAG_SYNC_WATCH): torch's sync debug mode in
"warn" while the scheduler's window is open, and only then; the synchronising calls counted by the project's call
site; every other warning let through. On the CPU the debug mode's setter is a recorder and a synchronising call is
the warning torch raises for one; the real mode runs in the GPU stage (benchmarks/gpu/device.sh)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import fastrag
from fastrag.engine import Engine
from fastrag.loop import Generate, QuestionLoop
from fastrag.sync_watch import SYNC_MESSAGE, SYNC_WATCH_ENV, SyncWatch, sync_watch_requested
from fastrag.trace import QuestionResult

from engine_fakes import Ex, tiny_llama
from engine_fakes import IntTok as Tok


class Modes:
    """A stand-in for torch.cuda.set_sync_debug_mode: the modes set, in order."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, mode):
        self.calls.append(mode)

    @property
    def current(self) -> str:
        return self.calls[-1] if self.calls else "default"


def _sync():
    warnings.warn(SYNC_MESSAGE, UserWarning)  # what torch raises in "warn" mode at a synchronising call


# a function whose frames say they are in the package (as a synchronising call in fastrag's code would be)
_SRC = "def methods_logic(sync):\n    for _ in range(2):\n        sync()\n"
_NS: dict = {}
exec(compile(_SRC, str(Path(fastrag.__file__).parent / "methods" / "dragin.py"), "exec"), _NS)


def test_counts_syncs_by_site_and_lets_other_warnings_through():
    modes = Modes()
    w = SyncWatch(set_mode=modes)
    w.start()
    assert modes.current == "warn" and w.active
    _NS["methods_logic"](_sync)  # two synchronising calls at one package site
    _sync()  # one outside the package: counted where it was made
    with pytest.warns(RuntimeWarning, match="not a sync"):
        warnings.warn("not a sync", RuntimeWarning)
        w.stop()  # (other warnings are shown when the window closes)
    assert modes.current == "default" and not w.active
    s = w.summary()
    assert s["windows"] == 1 and s["windows_with_syncs"] == 1 and s["syncs"] == 3
    assert s["sites"]["fastrag/methods/dragin.py:3 (methods_logic)"] == 2
    (other,) = [k for k in s["sites"] if "dragin" not in k]
    assert other.startswith(__file__) and "(_sync)" in other
    w.start()  # a window with nothing to report
    w.stop()
    w.stop()  # (closing twice is harmless)
    s = w.summary()
    assert s["windows"] == 2 and s["windows_with_syncs"] == 1 and s["syncs"] == 3
    assert modes.calls == ["warn", "default", "warn", "default"]


def test_a_warning_repeated_in_every_window_is_shown_once():
    """Other warnings raised in the windows are shown when each closes, deduplicated by place as Python does (a
    warning from the methods' logic in every step must not flood the log)."""
    w = SyncWatch(set_mode=Modes())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(5):
            w.start()
            warnings.warn("the same note", RuntimeWarning)
            w.stop()
    assert [str(x.message) for x in seen] == ["the same note"]


def test_outside_a_window_nothing_is_counted_and_the_warning_is_shown():
    w = SyncWatch(set_mode=Modes())
    with pytest.warns(UserWarning, match="synchronizing"):
        _sync()
    assert w.summary()["syncs"] == 0


def test_the_switch(monkeypatch):
    for raw, want in [("", False), ("0", False), ("off", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv(SYNC_WATCH_ENV, raw)
        assert sync_watch_requested() is want
    monkeypatch.setenv(SYNC_WATCH_ENV, "2")
    with pytest.raises(ValueError, match=SYNC_WATCH_ENV):
        sync_watch_requested()


# ---------------------------------------------------------------------------------------------- in the scheduler


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4)


def test_the_scheduler_watches_its_overlap_window_only(model, monkeypatch):
    """The policies' logic runs inside the window: a synchronising call there is counted, once per call; the launch
    and the wait that closes the window run with the mode back at default."""
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    modes = Modes()
    launch, finish = eng.step_launch, eng.step_finish
    at_engine = []

    def step_launch():
        at_engine.append(modes.current)
        return launch()

    def step_finish(st):
        at_engine.append(modes.current)
        return finish(st)

    eng.step_launch, eng.step_finish = step_launch, step_finish
    delivered = []

    def policy(ex):
        res = QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers)
        text = ex.question
        if ex.qid == "long":  # keeps the engine busy, so that every other result comes while a step is in flight
            yield Generate(text, 40, branch=0)
            res.prediction = text
            return res
        for _ in range(2):
            g = yield Generate(text, 3, branch=0)
            delivered.append(modes.current)
            _NS["methods_logic"](_sync)  # the policy's logic makes two synchronising calls per result
            text = text + " " + " ".join(map(str, g.ids))
        res.prediction = text
        return res

    sched = QuestionLoop(eng, None, policy, max_inflight=4, overlap=True, sync_watch=False)
    sched.sync_watch = SyncWatch(set_mode=modes)  # (forced on: on a CPU the scheduler leaves it off)
    out = []
    sched.run([Ex("long", "9 8 7 6 5")] + [Ex(f"q{i}", " ".join(str(5 + i + j) for j in range(6))) for i in range(3)],
              out.append)
    assert len(out) == 4 and all(r.error is None for r in out)
    assert len(delivered) == 6 and set(delivered) == {"warn"}  # every result reached its question in the window
    assert at_engine and set(at_engine) == {"default"}  # never the launch nor the closing wait
    s = sched.sync_watch.summary()
    assert s["syncs"] == 12 and s["sites"] == {"fastrag/methods/dragin.py:3 (methods_logic)": 12}
    assert 1 <= s["windows_with_syncs"] <= 6 <= s["windows"]
    assert modes.current == "default"


def test_a_step_that_raises_in_the_window_closes_it(model):
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    modes = Modes()

    def policy(ex):
        yield Generate(ex.question, 2, branch=0)
        raise KeyboardInterrupt  # (not a per-question failure: it leaves the run)

    sched = QuestionLoop(eng, None, policy, max_inflight=4, overlap=True)
    sched.sync_watch = SyncWatch(set_mode=modes)
    with pytest.raises(KeyboardInterrupt):
        sched.run([Ex("q", "5 6 7 8")], lambda r: None)
    assert modes.current == "default" and not sched.sync_watch.active


def test_on_a_cpu_or_without_overlap_the_watch_is_off_and_says_why(model, monkeypatch):
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    monkeypatch.setenv(SYNC_WATCH_ENV, "1")
    s = QuestionLoop(eng, None, lambda ex: iter(()), overlap=True)
    assert s.sync_watch is None and s.sync_watch_off == ("not a CUDA device" if eng.device.type != "cuda" else None)
    s = QuestionLoop(eng, None, lambda ex: iter(()), overlap=False)
    assert s.sync_watch is None and "overlap is off" in s.sync_watch_off
    monkeypatch.setenv(SYNC_WATCH_ENV, "0")
    s = QuestionLoop(eng, None, lambda ex: iter(()), overlap=True)
    assert s.sync_watch is None and s.sync_watch_off is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync debug mode needs a CUDA device (GPU stage)")
def test_torch_s_own_debug_mode_is_counted_on_a_gpu():
    """The real mode: a host read of a device value in the window is counted at this file's line, an enqueued
    operation is not, and the mode is back at default after."""
    w = SyncWatch()
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    w.start()
    y = x * 2  # enqueued: nothing to count
    w.stop()
    assert w.summary()["syncs"] == 0
    w.start()
    v = y.sum().item()  # a synchronising read
    w.stop()
    s = w.summary()
    assert v == 8.0 and s["syncs"] >= 1 and s["windows"] == 2 and s["windows_with_syncs"] == 1
    assert all(k.startswith(__file__) for k in s["sites"]), s
    assert torch.cuda.get_sync_debug_mode() == 0
