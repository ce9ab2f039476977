"""Launch-side validation shared by every signal backend: the one place that checks shapes, dtypes, devices.

Every failure raises ValueError naming the argument. Value checks that need to read tensor contents
(`chosen` in range, `0 <= lengths <= T`) run only for CPU tensors: on an accelerator they would force a
device sync on every decode step, so GPU kernels must stay safe for any value instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_TEMPERATURE = 1e-30  # the smallest sampling temperature: logits up to 3e8 divided by it stay finite in float32


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


def _real(x: object) -> bool:
    """A real number (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_out_tuple(out: object, name: str, fields: Sequence[str]) -> None:
    """An `out=` argument is a tuple of exactly len(fields) buffers, in that order."""
    if not isinstance(out, (tuple, list)) or len(out) != len(fields):
        got = f"{len(out)} items" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ValueError(f"{name} must be a tuple ({', '.join(fields)}), got {got}")


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
    """logits: [B, V] float; chosen: [B] int64 in [0, V) or None; temperature a finite number >= MIN_TEMPERATURE."""
    _check_tensor(logits, "logits", 2, FLOAT_DTYPES, devices)
    B, V = logits.shape
    if V == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got V=0")
    if not (_real(temperature) and math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE:g} (logits / T overflows float32 "
                         f"below it), got {temperature!r}")
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
    if not _real(scale):
        raise ValueError(f"scale must be a number, got {type(scale).__name__}")
    if lengths.device.type == "cpu" and B > 0:
        bad = ((lengths < 0) | (lengths > T)).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(f"lengths[{b}] = {int(lengths[b])} is outside [0, T={T}]")


def check_decode_signals(logits: torch.Tensor, temperature: float, rng_keys: torch.Tensor | None,
                         chosen: torch.Tensor | None, nonstop: torch.Tensor | None,
                         devices: Collection[str], top_p: float = 1.0, top_k: int = 0) -> None:
    """logits [B, V] float; temperature >= 0 (0: greedy); rng_keys [B] int64 needed when sampling
    (temperature > 0 and no `chosen`); chosen [B] int64 or None; nonstop [V] bool or None; 0 < top_p <= 1;
    top_k int >= 0 (0: off)."""
    _check_tensor(logits, "logits", 2, FLOAT_DTYPES, devices)
    B, V = logits.shape
    if V == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got V=0")
    if V >= 2**31 - 1:
        raise ValueError(f"logits vocabulary V={V} does not fit the kernels' int32 token index")
    if not (_real(temperature) and math.isfinite(temperature)
            and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (logits / T "
                         f"overflows float32 below it), got {temperature!r}")
    if not (_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] (1: no nucleus filtering), got {top_p!r}")
    if not _integer(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k filtering), got {top_k!r}")
    if chosen is not None:
        check_token_signals(logits, chosen, 1.0, devices)
    elif temperature > 0:
        if rng_keys is None:
            raise ValueError("rng_keys [B] int64 is required when sampling (temperature > 0 and no chosen)")
    if rng_keys is not None:
        _check_tensor(rng_keys, "rng_keys", 1, (torch.int64,), devices)
        _check_same_device(rng_keys, "rng_keys", logits, "logits")
        if rng_keys.shape[0] != B:
            raise ValueError(f"rng_keys must have shape ({B},) to match logits {tuple(logits.shape)}, "
                             f"got {tuple(rng_keys.shape)}")
    if nonstop is not None:
        _check_tensor(nonstop, "nonstop", 1, (torch.bool,), devices)
        _check_same_device(nonstop, "nonstop", logits, "logits")
        if nonstop.shape[0] != V:
            raise ValueError(f"nonstop table must have shape ({V},) to match logits {tuple(logits.shape)}, "
                             f"got {tuple(nonstop.shape)}")
        if not nonstop.is_contiguous():
            raise ValueError("nonstop table must be contiguous")


def check_attn_decode(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                      span_start: torch.Tensor, lse: torch.Tensor, block_size: int, scale: float,
                      amax: torch.Tensor, row_out: torch.Tensor | None, devices: Collection[str]) -> None:
    """q [B, H, D]; k_cache [Hkv, num_slots, D] (same dtype); block_tables [B, NB] int32/int64; ctx_lens,
    span_start [B] int64; lse [B, H] f32; amax [B, H, S] f32 contiguous (updated in place), S <= NB * block_size;
    row_out [B, NB * block_size] f32 contiguous or None. Values (CPU only): 0 <= span_start,
    ctx_lens <= NB * block_size, block ids inside the pool."""
    _check_tensor(q, "q", 3, FLOAT_DTYPES, devices)
    _check_tensor(k_cache, "k_cache", 3, FLOAT_DTYPES, devices)
    _check_tensor(block_tables, "block_tables", 2, (torch.int32, torch.int64), devices)
    _check_tensor(ctx_lens, "ctx_lens", 1, (torch.int64,), devices)
    _check_tensor(span_start, "span_start", 1, (torch.int64,), devices)
    _check_tensor(lse, "lse", 2, (torch.float32,), devices)
    _check_tensor(amax, "amax", 3, (torch.float32,), devices)
    for x, name in ((k_cache, "k_cache"), (block_tables, "block_tables"), (ctx_lens, "ctx_lens"),
                    (span_start, "span_start"), (lse, "lse"), (amax, "amax")):
        _check_same_device(x, name, q, "q")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must match q dtype {q.dtype}")
    if k_cache.shape[2] > 1 and k_cache.stride(2) != 1:
        raise ValueError(f"k_cache head dim must be contiguous (stride 1), got strides {tuple(k_cache.stride())}")
    B, H, D = q.shape
    Hkv, num_slots, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache head dim {Dk} must match q head dim {D}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads H={H} must be a multiple of k_cache heads Hkv={Hkv} (grouped-query attention)")
    if not (_integer(block_size) and block_size > 0):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if num_slots % block_size:
        raise ValueError(f"k_cache slots ({num_slots}) must be a multiple of block_size ({block_size})")
    if block_tables.shape[0] != B:
        raise ValueError(f"block_tables must have {B} rows to match q {tuple(q.shape)}, got {tuple(block_tables.shape)}")
    for x, name in ((ctx_lens, "ctx_lens"), (span_start, "span_start")):
        if x.shape[0] != B:
            raise ValueError(f"{name} must have shape ({B},) to match q {tuple(q.shape)}, got {tuple(x.shape)}")
    if tuple(lse.shape) != (B, H):
        raise ValueError(f"lse must have shape ({B}, {H}), got {tuple(lse.shape)}")
    L = block_tables.shape[1] * block_size
    if amax.shape[0] != B or amax.shape[1] != H:
        raise ValueError(f"amax must have shape ({B}, {H}, span), got {tuple(amax.shape)}")
    if amax.shape[2] > L:
        raise ValueError(f"amax span {amax.shape[2]} is longer than the cache the block tables address "
                         f"({block_tables.shape[1]} blocks x {block_size} = {L} keys)")
    if not amax.is_contiguous():
        raise ValueError("amax must be contiguous (it is updated in place)")
    if row_out is not None:
        check_out(row_out, "row_out", (B, L), torch.float32, q.device)
    if not _real(scale):
        raise ValueError(f"scale must be a number, got {type(scale).__name__}")
    if q.device.type == "cpu" and B > 0:
        for x, name in ((ctx_lens, "ctx_lens"), (span_start, "span_start")):
            bad = ((x < 0) | (x > L)).nonzero()
            if bad.numel():
                b = int(bad[0, 0])
                raise ValueError(f"{name}[{b}] = {int(x[b])} is outside [0, {L}] (the cache the block table "
                                 f"addresses: {block_tables.shape[1]} blocks x {block_size})")
        nb = num_slots // block_size
        used = torch.arange(block_tables.shape[1])[None, :] * block_size < ctx_lens[:, None]
        bad = (used & ((block_tables < 0) | (block_tables >= nb))).nonzero()
        if bad.numel():
            b, j = int(bad[0, 0]), int(bad[0, 1])
            raise ValueError(f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is outside the pool [0, {nb})")


def check_rows(rows: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None, devices: Collection[str]) -> None:
    """rows [B, R] int64 (query rows whose head-mean attention is wanted; out-of-range rows give zeros)."""
    _check_tensor(rows, "rows", 2, (torch.int64,), devices)
    _check_same_device(rows, "rows", q, "q")
    B, _, T, _ = q.shape
    if rows.shape[0] != B:
        raise ValueError(f"rows must have {B} rows to match q {tuple(q.shape)}, got {tuple(rows.shape)}")
    if out is not None:
        check_out(out, "out", (B, rows.shape[1], T), torch.float32, q.device)
