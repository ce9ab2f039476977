"""What `fastrag run` says on the console when things go wrong: Ctrl-C or SIGTERM while it starts (a line saying
what was kept and how to go on, no traceback; mid-run: tests/test_inputs.py), a path it cannot use (the option
named, and what to do), the questions that failed (each one's id and error), and its own warnings (one line each,
not Python's warning format). A tiny random model keeps the runs to seconds."""

from __future__ import annotations

import errno
import json
import pathlib
import signal
import subprocess
import sys
import warnings

import pytest

from fastrag.eval import BUNDLED

CORPUS = BUNDLED / "wiki_passages.jsonl"


def nq_file(path, questions, ids=None):
    path.write_text("".join(json.dumps({"question": q, "answer": [f"answer {i}"],
                                        **({"id": ids[i]} if ids else {})}) + "\n" for i, q in enumerate(questions)))
    return path


def run_args(tiny, data, cfg, out, *more):
    return ["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS), "--model",
            str(tiny), "--config", str(cfg), "--kv-cache-gb", "0.05", "--no-progress", "--output", str(out), *more]


# A stand-in for Ctrl-C or SIGTERM while `fastrag run` starts up: the signal comes while fastrag.eval (torch with
# it) is being imported, the slowest part of the start
STARTUP = """
import os, signal, sys
sys.modules.pop("fastrag.eval", None)

class Stop:
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name == "fastrag.eval" and not Stop.fired:
            Stop.fired = True
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            import time; time.sleep(1)  # (the handler runs here)
        return None

sys.meta_path.insert(0, Stop())
from fastrag.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("sig,rc,says", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")])
def test_a_signal_while_starting_up_says_so_without_a_traceback(tmp_path, sig, rc, says):
    """Ctrl-C while torch was being imported printed a bare KeyboardInterrupt traceback; SIGTERM exited 143 without a
    word. Both now say that nothing was written and how to go on."""
    data = nq_file(tmp_path / "nq.jsonl", ["who wrote it?"])
    args = ["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
            "--no-progress", "--output", str(tmp_path / "o")]
    p = subprocess.run([sys.executable, "-c", STARTUP, sig, *args], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.returncode == rc, (p.returncode, p.stderr[-2000:])
    assert f"fastrag: {says} before any answer was written" in p.stderr and "rerun the same command" in p.stderr, \
        p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "o").exists(), p.stderr[-2000:]


def test_an_output_folder_that_cannot_be_made_names_the_option(tmp_path, capsys):
    """`--output /proc/x` said only "[Errno 2] No such file or directory"."""
    from fastrag.cli import main

    data = nq_file(tmp_path / "nq.jsonl", ["who wrote it?"])
    rc = main(["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
               "--no-progress", "--output", "/proc/x/y"])
    err = capsys.readouterr().err
    assert rc == 2 and "fastrag: error: --output /proc/x/y: cannot make or write the folder (No such file or " \
        "directory); give --output a folder this user can create and write" in err, err


def test_a_data_file_in_a_folder_that_cannot_be_entered_names_the_option(tmp_path, capsys, monkeypatch):
    """A data file under a folder the user may not enter said only "[Errno 13] Permission denied: PATH". (The tests
    run as root, whom no permission stops: the folder's refusal is stood in for where pathlib asks the system.)"""
    from fastrag.cli import main

    locked = tmp_path / "locked"
    locked.mkdir()
    data = nq_file(locked / "nq.jsonl", ["who wrote it?"])
    stat = pathlib.Path.stat

    def refused(self, *a, **k):
        if str(self).startswith(str(locked) + "/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return stat(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "stat", refused)
    rc = main(["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
               "--no-progress", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and f"fastrag: error: --data {data}: cannot be reached (Permission denied): this user may not " \
        "enter a folder on its path" in err, err


def test_failed_questions_are_named_with_their_errors(tiny_model, tmp_path, capsys):
    """The console said "7 failed" and no more: each failed question's id and error are printed (the first five,
    then how many more; all are in results.jsonl)."""
    from fastrag.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 2, "fewshot": 0}))
    data = nq_file(tmp_path / "nq.jsonl", [""] * 7 + ["who wrote it?"], ids=[f"e{i}" for i in range(7)] + ["ok"])
    rc = main(run_args(tiny_model, data, cfg, tmp_path / "o"))
    out = capsys.readouterr().out
    assert rc == 0 and "8 questions, 7 failed" in out, out[-2000:]
    assert f"failed questions (7; each one's error is in {tmp_path / 'o'}/results.jsonl" in out, out[-2000:]
    assert all(f"\n  e{i}: ValueError: empty question\n" in out for i in range(5)), out[-2000:]
    assert "\n  ... and 2 more\n" in out and "e5:" not in out and "ok:" not in out, out[-2000:]


def test_warnings_print_as_one_line(tiny_model, tmp_path, capsys):
    """fastrag's warnings (a config key that is not applied, repeated question ids) printed in Python's format,
    "FILE:LINE: UserWarning: ..." with a source line under it; they are one line each."""
    from fastrag.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 2, "fewshot": 0, "sample": 5}))
    data = nq_file(tmp_path / "nq.jsonl", ["who wrote it?", "who wrote it again?"], ids=["ok", "ok"])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc = main(run_args(tiny_model, data, cfg, tmp_path / "o"))
    err = capsys.readouterr().err
    assert rc == 0
    assert f"fastrag: warning: {cfg}: not applied from the file: sample=5 (the first N questions: --limit N)\n" \
        in err, err[-2000:]
    assert f"fastrag: warning: {data}: 1 question(s) repeat an id of an earlier one (first: 'ok', run as " \
        "'ok#2')" in err, err[-2000:]
    assert "UserWarning" not in err and "warnings.warn(" not in err, err[-2000:]
