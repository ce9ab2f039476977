"""Launch-side validation shared by every signal backend: the one place that checks shapes, dtypes, devices.

Every failure raises ValueError naming the argument. Value checks that need to read tensor contents
(`chosen` in range, `0 <= lengths <= T`) run only for CPU tensors: on an accelerator they would force a
device sync on every decode step, so GPU kernels must stay safe for any value instead.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tensor(x: object, name: str, ndim: int, dtypes: Sequence[torch.dtype], devices: Collection[str]) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.device.type not in devices:
        raise ValueError(f"{name} is on {x.device}, this backend runs on {sorted(devices)}")


def _check_same_device(x: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def check_out(out: object, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """An `out=` buffer is written in place: exact shape, dtype, device, and contiguous."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, expected {device}")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_token_signals(logits: torch.Tensor, chosen: torch.Tensor | None, temperature: float,
                        devices: Collection[str]) -> None:
    """logits: [B, V] float; chosen: [B] int64 in [0, V) or None; temperature > 0."""
    _check_tensor(logits, "logits", 2, FLOAT_DTYPES, devices)
    B, V = logits.shape
    if V == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got V=0")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if chosen is None:
        return
    _check_tensor(chosen, "chosen", 1, (torch.int64,), devices)
    _check_same_device(chosen, "chosen", logits, "logits")
    if chosen.shape[0] != B:
        raise ValueError(f"chosen must have shape ({B},) to match logits {tuple(logits.shape)}, got {tuple(chosen.shape)}")
    if chosen.device.type == "cpu" and B > 0:
        bad = ((chosen < 0) | (chosen >= V)).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(f"chosen[{b}] = {int(chosen[b])} is outside the vocabulary [0, {V})")


def check_attention(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                    devices: Collection[str]) -> None:
    """q: [B, H, T, D], k: [B, Hkv, T, D] (same float dtype, H % Hkv == 0), lengths: [B] int64 in [0, T]."""
    _check_tensor(q, "q", 4, FLOAT_DTYPES, devices)
    _check_tensor(k, "k", 4, FLOAT_DTYPES, devices)
    _check_tensor(lengths, "lengths", 1, (torch.int64,), devices)
    _check_same_device(k, "k", q, "q")
    _check_same_device(lengths, "lengths", q, "q")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must match q dtype {q.dtype}")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k must have shape ({B}, Hkv, {T}, {D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads H={H} must be a multiple of k heads Hkv={Hkv} (grouped-query attention)")
    if lengths.shape[0] != B:
        raise ValueError(f"lengths must have shape ({B},) to match q {tuple(q.shape)}, got {tuple(lengths.shape)}")
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {type(scale).__name__}")
    if lengths.device.type == "cpu" and B > 0:
        bad = ((lengths < 0) | (lengths > T)).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(f"lengths[{b}] = {int(lengths[b])} is outside [0, T={T}]")
