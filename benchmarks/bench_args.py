"""Argument types shared by the benchmark scripts (each script's folder is on sys.path when it runs)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type of a count (rows, batches, contexts, repetitions, questions): 0 or less is refused by name,
    not left to fail deep in the timing loop."""
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def data_paths(script: str, data_dir: str, files: dict, datasets: list[str], check: bool = True) -> tuple[dict, Path]:
    """({dataset: data file}, corpus) under data_dir (files: dataset -> path relative to it; the corpus is
    corpus/wiki_passages.jsonl, ../shared/data's layout); with `check`, a missing file among the `datasets` and the
    corpus ends the script with one line naming it."""
    root = Path(data_dir)
    data = {ds: root / f for ds, f in files.items()}
    corpus = root / "corpus" / "wiki_passages.jsonl"
    for p in ([data[ds] for ds in datasets] + [corpus]) if check else []:
        if not p.is_file():
            sys.exit(f"{script}: error: --data-dir {root}: {p} not found")
    return data, corpus


def env_prefix() -> str:
    """The FASTRAG_* switches set in the environment as `NAME=VALUE ` words to put before a table's command (a
    variant of device.sh's runs differs from the default run by these alone); FASTRAG_CACHE, a folder, is left out.
    "" when none is set."""
    words = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
             if k.startswith("FASTRAG_") and k != "FASTRAG_CACHE"]
    return " ".join(words) + " " if words else ""
