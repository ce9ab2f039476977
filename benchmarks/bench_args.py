"""Argument types shared by the benchmark scripts (each script's folder is on sys.path when it runs)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type of a count (rows, batches, contexts, repetitions, questions): 0 or less is refused by name,
    not left to fail deep in the timing loop."""
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n
