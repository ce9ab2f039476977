"""Shared by the kernel and signal tests: (backend, device) parameters, and single-threaded torch."""

from __future__ import annotations

import pytest
import torch

from fastrag.signals import BackendUnavailableError, get_backend


def backend_case(name: str, device: str):
    """A (backend, device of the inputs) parameter, skipped with the reason when the backend is missing or runs on
    other devices (Triton on a GPU machine takes CUDA tensors only)."""
    try:
        be = get_backend(name)
    except BackendUnavailableError as e:
        return pytest.param(name, device, marks=pytest.mark.skip(reason=str(e)), id=f"{name}-{device}")
    if device not in be.devices:
        return pytest.param(name, device, marks=pytest.mark.skip(reason=f"{name} runs on {sorted(be.devices)}"),
                            id=f"{name}-{device}")
    return pytest.param(name, device, id=f"{name}-{device}")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared 2-core machine spend more time in OpenMP barriers than computing: run single-threaded
    (autouse in every module that imports it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
