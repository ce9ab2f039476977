"""$FASTRAG_SWITCH_INTERVAL: the interpreter's switch interval while a QuestionLoop runs, and its bad values."""

from __future__ import annotations

import sys
import threading

import pytest

from fastrag.loop import QuestionLoop
from fastrag.settings import SWITCH_INTERVAL_ENV, switch_interval, switch_interval_setting
from test_scheduler import Ex, FakeEngine, FakeRetriever, policy


@pytest.fixture
def restore_interval():
    old = sys.getswitchinterval()
    yield old
    sys.setswitchinterval(old)


def test_unset_leaves_the_interval_alone(monkeypatch, restore_interval):
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    sys.setswitchinterval(0.0123)
    with switch_interval() as v:
        assert v == pytest.approx(0.0123) and sys.getswitchinterval() == pytest.approx(0.0123)
    assert sys.getswitchinterval() == pytest.approx(0.0123)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "  ")
    assert switch_interval_setting() is None


def test_set_within_and_restored_after_even_on_error(monkeypatch, restore_interval):
    sys.setswitchinterval(0.004)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "0.0002")
    with switch_interval() as v:
        assert v == 0.0002 and sys.getswitchinterval() == pytest.approx(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.004)
    with pytest.raises(KeyError):
        with switch_interval():
            raise KeyError("x")
    assert sys.getswitchinterval() == pytest.approx(0.004)


@pytest.mark.parametrize("raw", ["abc", "0", "-0.001", "nan", "inf", "2", "1e-9", "5ms"])
def test_bad_values_name_the_variable(monkeypatch, restore_interval, raw):
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match=r"\$FASTRAG_SWITCH_INTERVAL=.*expected seconds"):
        with switch_interval():
            pass
    assert sys.getswitchinterval() == before


def test_a_scheduler_run_holds_the_interval_on_every_thread_it_uses(monkeypatch, restore_interval):
    """The search thread and the stepping thread both see the interval while the run goes; the one before is back
    after it, and after a run that fails."""
    sys.setswitchinterval(0.005)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "0.0003")
    seen = []

    class Ret(FakeRetriever):
        def search(self, queries, k):
            seen.append((threading.current_thread() is threading.main_thread(), sys.getswitchinterval()))
            return super().search(queries, k)

    class Eng(FakeEngine):
        def step(self):
            seen.append((True, sys.getswitchinterval()))
            return super().step()

    out = []
    QuestionLoop(Eng(), Ret(), policy, max_inflight=4).run([Ex(str(i), f"q{i}") for i in range(6)], out.append)
    assert len(out) == 6 and all(r.error is None for r in out)
    assert any(not main for main, _ in seen), "no search ran on a worker thread"
    assert [iv for _, iv in seen] == pytest.approx([0.0003] * len(seen))
    assert sys.getswitchinterval() == pytest.approx(0.005)

    class Boom(Eng):
        def step(self):
            raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        QuestionLoop(Boom(), Ret(), policy, max_inflight=4).run([Ex("a", "q")], out.append)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_bad_value_fails_an_eval_run_before_the_model_loads(monkeypatch, tmp_path, restore_interval):
    from fastrag.eval import BUNDLED, RunOptions, run

    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "fast")
    opts = RunOptions(method="dragin", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                      corpus=str(BUNDLED / "wiki_passages.jsonl"), model=str(tmp_path / "no-such-model"),
                      output=str(tmp_path / "out"), limit=1)
    with pytest.raises(ValueError, match=r"\$FASTRAG_SWITCH_INTERVAL='fast'"):
        run(opts)
    assert not (tmp_path / "out" / "results.jsonl").exists()
