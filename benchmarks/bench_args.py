"""Argument types shared by the benchmark scripts (each script's folder is on sys.path when it runs)."""

from __future__ import annotations

import argparse
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
