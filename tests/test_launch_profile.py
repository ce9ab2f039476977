"""fastrag.launch_profile: cProfile over the engine's step launches, kept apart by kind of step, and the part that
grows with the decode batch; its wiring through Engine.step_launch, fastrag.eval ($FASTRAG_LAUNCH_PROFILE=1) and
bench_e2e's results section."""

from __future__ import annotations

import importlib.util
import json
import pstats
from pathlib import Path

import pytest

from fastrag.launch_profile import IDLE_KIND, PREFILL_KIND, LaunchProfile, function_label, step_kind
from fastrag.perf import DECODE_BATCH_RANGES

from engine_fakes import tiny_dragin_run

ROOT = Path(__file__).resolve().parents[1]


def _fixed_part():
    return 1


def _per_sequence_part():
    x = 0
    for i in range(400):  # (own Python time, a few microseconds: the part that grows with the batch)
        x += i
    return x


def _fake_launch(batch: int):
    _fixed_part()
    for _ in range(batch):
        _per_sequence_part()


def _by_name(rows: list[dict], name: str) -> dict:
    hits = [r for r in rows if r["function"].endswith(f"({name})")]
    assert len(hits) == 1, [r["function"] for r in rows]
    return hits[0]


def test_step_kinds_cover_every_batch():
    assert step_kind(True, 0) == step_kind(True, 300) == PREFILL_KIND
    assert step_kind(False, 0) == IDLE_KIND
    assert step_kind(False, 1) == step_kind(False, 15) == "decode 1-15"
    assert step_kind(False, 16) == "decode 16-63"
    assert step_kind(False, 191) == "decode 128-191"
    assert step_kind(False, 192) == step_kind(False, 4096) == "decode 192+"
    # the buckets follow each other without a gap
    for (_, hi), (lo, _) in zip(DECODE_BATCH_RANGES, DECODE_BATCH_RANGES[1:]):
        assert lo == hi + 1


def test_calls_and_time_are_kept_by_kind_and_the_growing_part_is_found(tmp_path):
    lp = LaunchProfile()
    for batch, prefilled, steps in ((8, False, 6), (240, False, 4), (3, True, 2), (0, False, 1)):
        for _ in range(steps):
            lp.start()
            _fake_launch(batch)
            lp.stop(prefilled, batch)
    s = lp.summary(top=50)
    kinds = s["kinds"]
    assert set(kinds) == {"decode 1-15", "decode 192+", PREFILL_KIND, IDLE_KIND}
    assert [kinds[k]["steps"] for k in ("decode 1-15", "decode 192+", PREFILL_KIND, IDLE_KIND)] == [6, 4, 2, 1]
    assert kinds["decode 192+"]["mean_decode_batch"] == 240 and kinds[PREFILL_KIND]["mean_decode_batch"] == 3
    for kind, batch in (("decode 1-15", 8), ("decode 192+", 240), (PREFILL_KIND, 3)):
        fns = kinds[kind]["functions"]
        assert _by_name(fns, "_per_sequence_part")["calls_per_step"] == batch
        assert _by_name(fns, "_fixed_part")["calls_per_step"] == 1
        assert sum(r["own_share"] for r in fns) == pytest.approx(1.0)  # (top=50 keeps every function here)
        assert all(r["cum_us_per_step"] >= r["own_us_per_step"] >= 0 for r in fns)
    big = kinds["decode 192+"]
    assert big["functions"][0]["function"].endswith("(_per_sequence_part)")  # most own time
    assert big["wall_us_per_step"] > kinds["decode 1-15"]["wall_us_per_step"]
    per = s["per_sequence"]
    assert (per["from"], per["to"]) == ("decode 1-15", "decode 192+")
    grow = _by_name(per["functions"], "_per_sequence_part")
    assert grow["calls_per_seq"] == pytest.approx(1.0) and grow is per["functions"][0] and grow["us_per_seq"] > 0
    assert _by_name(per["functions"], "_fixed_part")["calls_per_seq"] == pytest.approx(0.0)
    assert per["wall_us_per_seq"] > 0
    # each kind's full statistics, readable by pstats
    paths = lp.dump(tmp_path / "lp")
    assert sorted(p.name for p in paths) == sorted(["decode_1_15.pstats", "decode_192.pstats",
                                                    "with_a_prefill.pstats", "no_decode_no_prefill.pstats"])
    st = pstats.Stats(str(tmp_path / "lp" / "decode_192.pstats"))
    calls = {f[2]: v[1] for f, v in st.stats.items()}
    assert calls["_per_sequence_part"] == 240 * 4


def test_one_decode_bucket_has_no_per_sequence_part_and_misuse_is_an_error():
    lp = LaunchProfile()
    lp.start()
    _fake_launch(4)
    lp.stop(False, 4)
    assert "per_sequence" not in lp.summary()
    with pytest.raises(RuntimeError, match="without start"):
        lp.stop(False, 4)
    lp.start()
    lp.start()  # (a launch that raised before its stop: the next start drops its partial profile)
    lp.stop(False, 4)
    assert lp.summary()["kinds"]["decode 1-15"]["steps"] == 2


def test_function_labels():
    assert function_label(("~", 0, "<method 'copy_' of 'torch._C.TensorBase' objects>")) == \
        "<method 'copy_' of 'torch._C.TensorBase' objects>"
    assert function_label((str(ROOT / "fastrag" / "engine.py"), 812, "step_launch")) == \
        "fastrag/engine.py:812(step_launch)"
    assert function_label(("/x/lib/python3.11/site-packages/torch/cuda/__init__.py", 5, "f")) == \
        "torch/cuda/__init__.py:5(f)"


def test_a_run_profiles_its_launches_when_asked(tmp_path, monkeypatch):
    """fastrag.eval with $FASTRAG_LAUNCH_PROFILE=1: every step launch profiled (as many as the step trace has rows,
    the prefill steps those that prefilled), the engine's own functions in it, the statistics files in the run
    folder, and bench_e2e's section made of it; a bad value of the switch is an error naming it."""
    from fastrag.eval import run

    opts = tiny_dragin_run(tmp_path)
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "1")
    monkeypatch.setenv("FASTRAG_LAUNCH_PROFILE", "1")
    m = run(opts("profiled"))
    rows = [json.loads(x) for x in (tmp_path / "profiled" / "step_trace.jsonl").read_text().splitlines()]
    kinds = m["launch_profile"]["kinds"]
    rows = [r for r in rows if not r.get("passes_only")]  # (scheduler steps that launched passes only)
    assert sum(k["steps"] for k in kinds.values()) == len(rows) > 0
    assert kinds[PREFILL_KIND]["steps"] == sum(r["prefill_seqs"] > 0 for r in rows)
    plain = [r for r in rows if not r["prefill_seqs"]]
    assert sum(k["steps"] * k["mean_decode_batch"] for kd, k in kinds.items() if kd != PREFILL_KIND) == \
        pytest.approx(sum(r["decode_batch"] for r in plain))
    decode = [kd for kd in kinds if kd.startswith("decode ")]
    assert decode
    folder = tmp_path / "profiled" / "launch_profile"
    files = sorted(p.name for p in folder.iterdir())
    assert PREFILL_KIND.replace(" ", "_") + ".pstats" in files and len(files) == len(kinds)
    for kd in decode:  # every plain decode step calls the model runner's decode once
        st = pstats.Stats(str(folder / (kd.replace(" ", "_").replace("-", "_").rstrip("+") + ".pstats")))
        calls = {(Path(f[0]).name, f[2]): v[1] for f, v in st.stats.items()}
        assert calls[("runner.py", "decode")] == kinds[kd]["steps"]
        assert kinds[kd]["functions"][0]["own_us_per_step"] > 0

    spec = importlib.util.spec_from_file_location("_bench_e2e_lp", ROOT / "benchmarks" / "bench_e2e.py")
    be = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(be)
    text = be.launch_profile_section([m])
    assert "## Where the steps' launch spends its host time" in text and f"({decode[-1]}, " in text
    assert be.launch_profile_section([{}]) == ""

    monkeypatch.setenv("FASTRAG_LAUNCH_PROFILE", "sometimes")
    with pytest.raises(ValueError, match="FASTRAG_LAUNCH_PROFILE"):
        run(opts("bad"))
    monkeypatch.setenv("FASTRAG_LAUNCH_PROFILE", "0")
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "0")
    m = run(opts("plain"))
    assert "launch_profile" not in m and not (tmp_path / "plain" / "launch_profile").exists()
