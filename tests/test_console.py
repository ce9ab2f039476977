"""What `fastrag run` says on the console when things go wrong: Ctrl-C or SIGTERM at any point (a line saying what
was kept and how to go on, no traceback), a path it cannot use (the option named, and what to do), the questions
that failed (each one's id and error), and its own warnings (one line each, not Python's warning format). A tiny
random model keeps the runs to seconds."""

from __future__ import annotations

import errno
import json
import pathlib
import signal
import subprocess
import sys
import time
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
