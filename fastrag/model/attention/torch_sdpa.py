"""torch's own attention kernels: the masked SDPA call of prefills and attention passes (restricted to the backends
of $FASTRAG_SDPA, `sdpa_scope`), and `lse_attention`, the fused kernels that also return the log-sum-exp the
cascade prefill merges by."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from fastrag.model.attention.select import sdpa_backends

_SCOPE = threading.local()


def in_sdpa_scope() -> bool:
    """Whether this thread is inside a `sdpa_scope` (a forward enters one once, its layers none)."""
    return getattr(_SCOPE, "on", False)


def masked_attention(q, k, v, mask, scale: float | None = None, expand: bool = False):
    """softmax(q k^T * scale, masked) v for q [B, H, T, D], k/v [B, Hkv, S, D] (H a multiple of Hkv), mask [B, 1, T, S]
    (True: attend). expand: repeat k and v to H heads instead of asking SDPA for grouped heads. The call may use only
    the backends of `sdpa_backends()`."""
    if getattr(_SCOPE, "on", False):
        return _masked_attention(q, k, v, mask, scale, expand)
    with sdpa_scope():
        return _masked_attention(q, k, v, mask, scale, expand)


@contextlib.contextmanager
def sdpa_scope():
    """SDPA restricted to `sdpa_backends()` for the block, entered once for a whole forward (`sdpa_kernel` costs ~10
    us to enter and leave: once per layer and bucket that is ~1 ms a prefill forward); nested scopes are free.
    ("torch": torch's own choice, nothing to restrict; the scope is still marked, so a forward enters it once.)"""
    if getattr(_SCOPE, "on", False):
        yield
        return
    backends = sdpa_backends()
    _SCOPE.on = True
    try:
        if backends is None:
            yield
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backends):
                yield
    finally:
        _SCOPE.on = False


def _masked_attention(q, k, v, mask, scale: float | None, expand: bool):
    H, Hkv = q.shape[1], k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if expand:
        g = H // Hkv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                              attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def lse_attention(q, k, v, bias, scale: float):
    """softmax(q k^T * scale + bias) v and its row log-sum-exp, for q [B, H, T, D], k/v [B, H, S, D] (as many heads as
    q), bias None or an additive float mask of q's dtype, [B, H, T, S] (broadcast views welcome; on CUDA its rows
    16-element aligned, see `cascade_bias`). Returns (o [B, H, T, D] in q's dtype, lse [B, H, T] float32, natural
    log of the scaled scores' sum of exponentials). torch's fused kernels return the log-sum-exp only through their
    aten entry points: flash attention on CUDA for half types without a mask, memory-efficient attention on CUDA
    otherwise, and the CPU's flash kernel (mask included)."""
    T = q.shape[2]
    if q.device.type == "cuda":
        if bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
                and q.shape[-1] <= 256:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return out[0], out[1][..., :T].float()
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
        return out[0], out[1][..., :T].float()
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                         scale=scale)
    return o, lse.float()
