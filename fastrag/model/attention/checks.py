"""The self-checks that decide whether a kernel path runs on a device: each path's check runs once per physical
device and dtype, and a failing one falls back to torch with a warning that says why."""

from __future__ import annotations

import warnings

import torch


def self_check_key(device, dtype: torch.dtype) -> str:
    """The key of a self-check's verdict: one per physical device and dtype. A CUDA device named without its index
    ("cuda") is the current one ("cuda:0"), so a check asked for with torch.device("cuda") and the tensors' own
    "cuda:0" runs once, not twice (a second run would land inside the first prefill and be counted as one of its
    kernel calls)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return f"{device} {str(dtype).removeprefix('torch.')}"


def self_checked(checks: dict[str, str], check, device: torch.device, dtype: torch.dtype, fallback: str) -> bool:
    """Whether a path passed its self-check `check(device, dtype)` ("on", else "off: why"), run once per device
    and dtype and kept in `checks`; a failure warns once, naming the `fallback` taken instead."""
    key = self_check_key(device, dtype)
    if key not in checks:
        checks[key] = check(torch.device(device), dtype)
        if checks[key] != "on":
            warnings.warn(f"fastrag: {fallback} on {key} ({checks[key]})", RuntimeWarning, stacklevel=3)
    return checks[key] == "on"


def describe_failure(e: Exception) -> str:
    """A self-check's verdict for a kernel that raised (one that cannot compile or launch on this device)."""
    return f"off: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def verdict(err: float, dtype: torch.dtype, what: str) -> str:
    """"on" when a kernel's largest difference from its reference, `err`, is within the dtype's tolerance, else
    "off: " and by how much `what` differed (NaN counts as a difference)."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not err <= tol:  # (NaN included)
        return f"off: {what} by {err:.3g} (tolerance {tol:g})"
    return "on"
