"""fastrag.settings: every FASTRAG_* variable's rule, and fastrag.probe: the diagnostics behind one object."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fastrag import settings
from fastrag.probe import Probe
from fastrag.settings import VARIABLES, parse, setting, snapshot

# a value each kind must refuse (text and folder take anything)
BAD = {"switch": "maybe", "setting": "2", "auto": "sometimes", "choice": "nonsense", "count": "-3",
       "seconds": "fast", "window": "12", "sdpa": "flash,quick"}


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_unset_and_blank_give_the_default(name):
    var = VARIABLES[name]
    assert setting(name, {}) == var.default
    assert setting(name, {name: "   "}) == var.default


@pytest.mark.parametrize("name", sorted(n for n, v in VARIABLES.items() if v.kind in BAD))
def test_a_bad_value_is_an_error_naming_the_variable(name):
    with pytest.raises(ValueError, match=f"\\${name}="):
        setting(name, {name: BAD[VARIABLES[name].kind]})


def test_switches_take_the_usual_words_in_any_case():
    for word in ("1", "true", "On", "YES"):
        assert setting("FASTRAG_STEP_TRACE", {"FASTRAG_STEP_TRACE": word}) is True
    for word in ("0", "false", "Off", "no"):
        assert setting("FASTRAG_TEXT_GROUPS", {"FASTRAG_TEXT_GROUPS": word}) is False
    assert setting("FASTRAG_PAGED_PREFILL", {"FASTRAG_PAGED_PREFILL": "AUTO"}) == "auto"
    assert setting("FASTRAG_PAGED_PREFILL", {"FASTRAG_PAGED_PREFILL": "0"}) is False


def test_counts_windows_seconds_and_lists_on_random_values():
    rng = random.Random()
    for _ in range(50):
        n = rng.randrange(16, 100_000)
        assert setting("FASTRAG_PREFILL_GRAPH_TOKENS", {"FASTRAG_PREFILL_GRAPH_TOKENS": f" {n} "}) == n
        a, b = rng.randrange(0, 10_000), rng.randrange(1, 1_000)
        assert setting("FASTRAG_KERNEL_PROFILE", {"FASTRAG_KERNEL_PROFILE": f"{a} : {b}"}) == (a, b)
        s = rng.uniform(1e-6, 1.0)
        assert setting("FASTRAG_SWITCH_INTERVAL", {"FASTRAG_SWITCH_INTERVAL": repr(s)}) == s
    with pytest.raises(ValueError, match="expected an integer"):
        setting("FASTRAG_PREFILL_GRAPH_TOKENS", {"FASTRAG_PREFILL_GRAPH_TOKENS": "15"})
    with pytest.raises(ValueError, match="0 or 1"):
        setting("FASTRAG_ASYNC_PREFILL", {"FASTRAG_ASYNC_PREFILL": "2"})
    with pytest.raises(ValueError, match="COUNT >= 1"):
        setting("FASTRAG_KERNEL_PROFILE", {"FASTRAG_KERNEL_PROFILE": "3:0"})
    with pytest.raises(ValueError, match=r"\[1e-06, 1\]"):
        setting("FASTRAG_SWITCH_INTERVAL", {"FASTRAG_SWITCH_INTERVAL": "2"})
    assert setting("FASTRAG_SDPA", {"FASTRAG_SDPA": " math , flash"}) == ("math", "flash")
    assert setting("FASTRAG_SDPA", {"FASTRAG_SDPA": "torch"}) == "torch"


def test_an_unknown_name_is_refused():
    name = "FASTRAG" + "_NO_SUCH_SETTING"  # (spelt apart: the docs check reads every quoted name in tests/)
    with pytest.raises(KeyError, match=name):
        setting(name, {})


def test_snapshot_records_every_setting_and_a_bad_one_as_its_error():
    snap = snapshot({"FASTRAG_SDPA": "math", "FASTRAG_STEP_TRACE": "sideways"})
    assert set(snap) == set(VARIABLES) - {"FASTRAG_CACHE"}
    assert snap["FASTRAG_SDPA"] == ["math"]
    assert snap["FASTRAG_STEP_TRACE"].startswith("error: $FASTRAG_STEP_TRACE=")
    json.dumps(snap)  # (JSON-ready: metrics.json records it)
    assert settings.set_in_environment({"FASTRAG_SDPA": "math", "FASTRAG_CACHE": "/x", "PATH": "/bin"}) == \
        {"FASTRAG_SDPA": "math"}


def test_the_readers_of_the_package_follow_the_rules(monkeypatch):
    from fastrag.engine.sizing import default_async_prefill, prefill_graph_tokens
    from fastrag.model.attention.select import decode_attention_mode, sdpa_backends
    from fastrag.text.pool import text_groups_requested

    monkeypatch.setenv("FASTRAG_DECODE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match=r"\$FASTRAG_DECODE_ATTENTION='bogus': expected native, triton or torch"):
        decode_attention_mode()
    monkeypatch.setenv("FASTRAG_SDPA", "math,warp")
    with pytest.raises(ValueError, match=r"\$FASTRAG_SDPA="):
        sdpa_backends()
    monkeypatch.setenv("FASTRAG_PREFILL_GRAPH_TOKENS", "8")
    with pytest.raises(ValueError, match=r"\$FASTRAG_PREFILL_GRAPH_TOKENS="):
        prefill_graph_tokens()
    monkeypatch.setenv("FASTRAG_ASYNC_PREFILL", "1")
    assert default_async_prefill("cpu") is True
    monkeypatch.setenv("FASTRAG_TEXT_GROUPS", "off")
    assert text_groups_requested() is False


class _Engine:
    """What Probe touches of an engine: its recorder attributes, stats, device and step_launch."""

    def __init__(self):
        self.trace = self.launch_profile = self.kernel_window = None
        self.stats = {"decode_steps": 0}
        self.device = "cpu"

    def step_launch(self):
        raise AssertionError("not called by Probe")


def test_probe_off_attaches_nothing(monkeypatch):
    for name in ("FASTRAG_STEP_TRACE", "FASTRAG_KERNEL_PROFILE", "FASTRAG_LAUNCH_PROFILE", "FASTRAG_SYNC_WATCH"):
        monkeypatch.delenv(name, raising=False)
    probe = Probe.from_settings()
    assert not probe.on
    eng = _Engine()
    probe.attach(eng)
    assert (eng.trace, eng.launch_profile, eng.kernel_window) == (None, None, None)
    assert probe.collect(eng, []) == {}


def test_probe_on_records_and_writes_each_folder(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "1")
    monkeypatch.setenv("FASTRAG_LAUNCH_PROFILE", "yes")
    monkeypatch.setenv("FASTRAG_SYNC_WATCH", "1")
    probe = Probe.from_settings()
    assert probe.on and probe.sync_watch and probe.kernel_window is None
    eng = _Engine()
    probe.attach(eng)
    assert eng.trace == [] and eng.launch_profile is not None and eng.kernel_window is None
    rows = [{"step": i, "prefill_seqs": 0, "prefill_tokens": 0, "decode_seqs": 3, "launch_s": 0.001 * (i + 1),
             "finish_s": 0.002} for i in range(4)]
    eng.trace.extend(rows)
    eng.launch_profile.start()
    sum(range(1000))
    eng.launch_profile.stop(False, 3)
    folders = [tmp_path / "a", tmp_path / "b"]
    for f in folders:
        f.mkdir()
    blocks = probe.collect(eng, folders)
    assert set(blocks) == {"step_trace", "launch_profile"}
    assert eng.trace is None and eng.launch_profile is None
    for f in folders:
        lines = (f / "step_trace.jsonl").read_text().splitlines()
        assert [json.loads(x) for x in lines] == rows
        assert (f / "launch_profile").is_dir()


def test_loop_config_checks_its_fields_and_a_loop_takes_it():
    import torch

    from fastrag.loop import LoopConfig, QuestionLoop, SyncEngineBase

    for bad, field in (({"max_inflight": 0}, "max_inflight"), ({"max_inflight": True}, "max_inflight"),
                       ({"overlap": "yes"}, "overlap"), ({"text_groups": 1}, "text_groups"),
                       ({"wait_for_search": None}, "wait_for_search")):
        with pytest.raises(ValueError, match=field):
            LoopConfig(**bad)
    with pytest.raises(TypeError, match="max_inflite"):
        LoopConfig().replace(max_inflite=3)

    class StepOnly(SyncEngineBase):
        device = torch.device("cpu")

        def step(self):
            return []

    class NoSearch:
        def search(self, queries, k):
            raise AssertionError("not searched")

    cfg = LoopConfig(max_inflight=5, wait_for_search=False, text_lockstep=False)
    loop = QuestionLoop(StepOnly(), NoSearch(), None, cfg)
    assert loop.config is cfg and loop.max_inflight == 5 and loop.wait_for_search is False
    # a keyword setting wins over the config's
    loop = QuestionLoop(StepOnly(), NoSearch(), None, cfg, max_inflight=9)
    assert loop.max_inflight == 9 and loop.wait_for_search is False and loop.config.max_inflight == 9


def test_engine_config_gives_the_loop_config_a_run_uses():
    from fastrag.specs import EngineConfig
    from fastrag.text.pool import auto_text_workers

    cfg = EngineConfig(batch_size=7, search_concurrency=3, overlap=False)
    lc = cfg.loop_config("cpu")
    assert (lc.max_inflight, lc.text_workers, lc.search_concurrency, lc.overlap) == (14, 0, 3, False)
    assert cfg.loop_config("cuda").text_workers == auto_text_workers("cuda")
    assert EngineConfig(text_workers=2).loop_config("cuda", sync_watch=True).text_workers == 2
    assert cfg.loop_config(None, sync_watch=True).sync_watch is True
