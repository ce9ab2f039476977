"""The `environment` block of metrics.json and parity.json (fastrag.provenance): when, where and with what."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

import fastrag
from fastrag import provenance
from fastrag.text.pool import usable_cpus


def test_environment_names_the_time_the_device_and_the_versions():
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    env = provenance.environment()
    after = dt.datetime.now(dt.timezone.utc)
    when = dt.datetime.fromisoformat(env["date"])
    assert when.tzinfo is not None and before <= when <= after, (before, env["date"], after)
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert env["transformers"] == metadata.version("transformers")
    assert env["fastrag"] == metadata.version("fastrag")
    # the CPU's model, its cores (the affinity mask's share of them when it narrows them: the test below) and the
    # torch threads the run used
    cores, total = usable_cpus(), os.cpu_count()
    assert env["device"] == f"{provenance.cpu_name()}, {cores if cores == total else f'{cores} of {total}'} cores, " \
                            f"{torch.get_num_threads()} torch threads"
    assert env["command"] and json.loads(json.dumps(env)) == env  # plain JSON


def test_the_device_names_the_cpus_an_affinity_mask_leaves_to_the_run(monkeypatch):
    """A run pinned to some of the machine's cores (a batch scheduler's allocation, taskset) says how many it had."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7, 9}, raising=False)
    assert provenance.device_name("cpu") == f"{provenance.cpu_name()}, 4 of 64 cores, " \
                                            f"{torch.get_num_threads()} torch threads"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert provenance.device_name("cpu").startswith(f"{provenance.cpu_name()}, 64 cores, ")


def test_environment_records_the_engine_switches_set(monkeypatch):
    """The FASTRAG_* variables in force (how two runs of one command differ), not the cache folder."""
    for k in [k for k in os.environ if k.startswith("FASTRAG_")]:
        monkeypatch.delenv(k)
    assert provenance.environment()["settings"] == {}
    monkeypatch.setenv("FASTRAG_PREFILL_HOLD", "3")
    monkeypatch.setenv("FASTRAG_SDPA", "torch")
    monkeypatch.setenv("FASTRAG_CACHE", "/tmp/x")
    assert provenance.environment()["settings"] == {"FASTRAG_PREFILL_HOLD": "3", "FASTRAG_SDPA": "torch"}


def test_cpu_name_is_the_model_line_of_proc_cpuinfo():
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
             if ln.split(":", 1)[0].strip() == "model name"] if info.exists() else []
    if names:
        assert provenance.cpu_name() == names[0]
    else:  # no /proc/cpuinfo model line (another OS or architecture): platform's description, never empty
        assert provenance.cpu_name() == (platform.processor() or platform.machine() or "unknown CPU")


def test_git_commit_is_the_checkout_head_and_none_elsewhere(tmp_path):
    root = Path(fastrag.__file__).resolve().parent.parent
    got = provenance.git_commit()
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        assert got is not None and got["commit"] == head and isinstance(got["dirty"], bool)
    else:  # an installed package outside a checkout
        assert got is None
    # a folder that is no checkout: none, and no error
    (tmp_path / "pkg").mkdir()
    assert provenance.git_commit(tmp_path / "pkg") is None
    # a checkout with a commit, then a tracked file changed: dirty
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert provenance.git_commit(repo / "pkg") == {"commit": head, "dirty": False}
    (repo / "pkg" / "m.py").write_text("x = 2\n")
    assert provenance.git_commit(repo / "pkg") == {"commit": head, "dirty": True}


def test_the_command_line_is_recorded_as_run(tmp_path):
    code = "import json; from fastrag.provenance import environment; print(json.dumps(environment()))"
    script = tmp_path / "s.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script), "--limit", "8", "a b"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["command"] == f"{script} --limit 8 'a b'"


def test_the_commit_is_the_one_read_when_the_run_started(monkeypatch):
    """A long run outlives commits: the environment names the commit of the code it loaded, read at its start."""
    heads = iter([{"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": False}])
    monkeypatch.setattr(provenance, "git_commit", lambda package=None: next(heads))
    provenance.source_commit.cache_clear()
    try:
        assert provenance.source_commit()["commit"] == "a" * 40  # (what fastrag.eval reads as a run starts)
        assert provenance.environment()["git"]["commit"] == "a" * 40
        assert provenance.environment()["git"]["commit"] == "a" * 40
    finally:
        provenance.source_commit.cache_clear()
