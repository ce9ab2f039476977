"""Where and with what a run was measured: the `environment` block of metrics.json and parity.json.

A throughput figure means little without its machine and versions, and a results folder outlives the terminal
that made it, so every run writes them beside its numbers: the UTC time the run finished, the device (GPU name, or
the CPU model with the cores and torch threads it used), the versions of Python, torch, transformers, triton and
fastrag, the command line, and the git commit of the fastrag source when it runs from a checkout (with `dirty` when
tracked files differ from it), read when the run starts. It needs torch and the standard library only.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from fastrag.settings import set_in_environment, snapshot

_PACKAGES = ("torch", "transformers", "triton", "fastrag")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from fastrag.text.pool import usable_cpus

    total, usable = os.cpu_count(), usable_cpus()  # (an affinity mask, e.g. a batch job's allocation, narrows it)
    cores = f"{total} cores" if usable == total else f"{usable} of {total} cores"
    return f"{cpu_name()}, {cores}, {torch.get_num_threads()} torch threads"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions(*names: str) -> str:
    """'torch X, triton Y, ...' of installed packages (a missing one reads 'not installed'): a results table's
    provenance line."""
    return ", ".join(f"{n} {_version(n) or 'not installed'}" for n in names)


def git_commit(package: Path | None = None) -> dict | None:
    """{"commit", "dirty"} of the git checkout whose top folder holds the `package` folder (default: fastrag's
    own), None when there is none (an installed package)."""
    root = (package or Path(__file__).resolve().parent).parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


@functools.cache
def source_commit() -> dict | None:
    """`git_commit()` of fastrag's own source, read once per process: the code a run loaded, not what the checkout
    holds when the run ends (a long run outlives edits and commits). `fastrag.eval` reads it when a run starts."""
    return git_commit()


def environment(device: torch.device | str | None = None) -> dict:
    """The `environment` block written beside a run's measured figures (see the module doc)."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "python": platform.python_version(),
        **{name: _version(name) for name in _PACKAGES},
        "command": shlex.join(sys.argv),
        "git": source_commit(),
        # the FASTRAG_* variables set, as written, and every setting as the run read it, defaults included
        # (fastrag.settings)
        "settings": set_in_environment(),
        "resolved": snapshot(),
    }
