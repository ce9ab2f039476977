"""tests/conftest.py shares the cores among pytest-xdist's workers (the README's test command runs one per core), and
without a GPU sets TRITON_INTERPRET=1 before any test module imports triton."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = '''
import json, os, torch
def test_probe():
    w = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(os.environ["PROBE_OUT"], w + ".json"), "w") as f:
        json.dump({"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
'''


def _pytest_beside_the_conftest(tmp_path: Path, files: dict[str, str], args: list[str], drop: str,
                                **env: str) -> Path:
    """pytest run in a subprocess on `files` (name: source) next to a copy of tests/conftest.py, with the outer
    run's `drop` variable and xdist's own taken out of its environment; the folder the probes write to."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    out = Path(tempfile.mkdtemp(dir=tmp_path))  # (a folder of its own for each probe)
    e = {k: v for k, v in os.environ.items() if k not in (drop, "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                                                          "PYTEST_ADDOPTS")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *files],
                       cwd=tmp_path, env={**e, "PROBE_OUT": str(out), **env}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _probe(tmp_path: Path, args: list[str], **env: str) -> dict:
    out = _pytest_beside_the_conftest(tmp_path, {"test_probe.py": PROBE}, args, "OMP_NUM_THREADS", **env)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_each_xdist_worker_gets_its_share_of_the_cores(tmp_path):
    got = _probe(tmp_path, ["-n", "2"])
    share = max(1, (os.cpu_count() or 1) // 2)
    assert set(got) <= {"gw0", "gw1"} and got, got
    for seen in got.values():
        assert seen == {"torch": share, "omp": str(share)}, seen


def _torch_default(**env: str) -> int:
    e = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env={**e, **env},
                       capture_output=True, text=True, timeout=120, check=True)
    return int(r.stdout)


def test_a_plain_run_and_a_users_omp_setting_are_left_alone(tmp_path):
    assert _probe(tmp_path, []) == {"main": {"torch": _torch_default(), "omp": None}}
    given = _probe(tmp_path, ["-n", "2"], OMP_NUM_THREADS="3")
    assert given and all(seen == {"torch": _torch_default(OMP_NUM_THREADS="3"), "omp": "3"}
                         for seen in given.values()), given


IMPORTS_TRITON = "import triton  # (as test_triton_sm90.py does, to compile for sm_90)\ndef test_a():\n    pass\n"
RUNS_KERNELS = """
import json, os, torch
from fastrag.kernels import INTERPRETED
def test_b():
    with open(os.path.join(os.environ["PROBE_OUT"], "b.json"), "w") as f:
        json.dump({"interpreted": INTERPRETED, "cuda": torch.cuda.is_available()}, f)
"""


def _triton_probe(tmp_path: Path, **env: str) -> dict:
    files = {"test_a_imports_triton.py": IMPORTS_TRITON, "test_b_runs_kernels.py": RUNS_KERNELS}  # (in this order)
    out = _pytest_beside_the_conftest(tmp_path, files, [], "TRITON_INTERPRET", **env)
    return json.loads((out / "b.json").read_text())


def test_triton_is_interpreted_without_a_gpu_whichever_module_imports_it_first(tmp_path):
    got = _triton_probe(tmp_path)
    assert got["interpreted"] == (not got["cuda"]), got
    assert _triton_probe(tmp_path, TRITON_INTERPRET="0")["interpreted"] is False  # the user's own value is kept
