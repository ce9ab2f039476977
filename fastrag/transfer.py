"""Host-to-device copies that never wait for the device.

A copy from pageable host memory to a GPU is synchronous: torch waits for the stream, so every copy made while
kernels are queued stalls the host until they finish (and the device then idles while the host catches up). Going
through pinned memory with `non_blocking=True` only enqueues the copy; torch's pinned-memory allocator keeps the
staging buffer alive until the copy has run. tests/test_host_sync.py checks the decode step's launch for such waits.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, enqueued without waiting when that is a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(values, dtype, device=device)` without the synchronous copy it makes on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) from a host tensor, enqueued without waiting when dst is on a GPU (a static buffer, e.g. a
    CUDA graph's input)."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
