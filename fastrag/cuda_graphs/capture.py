"""The CUDA graph capture both kinds of graphs share (decode steps in `fastrag.cuda_graphs.decode`, token
buckets in `fastrag.cuda_graphs.tokens`): the warm-up and capture of one forward, and the failure handling that
leaves a call eager and turns graphs off after repeated failures."""

from __future__ import annotations

import warnings

import torch


def capture_cuda_graph(device: torch.device, mempool, forward):
    """(graph, its output): forward() run twice on a side stream (the warm-up that compiles the Triton kernels and
    settles the allocator), then captured into `mempool`. thread_local: CUDA calls of other threads (a dense
    retriever's encoder) do not invalidate the capture."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out


def try_capture(owner, capture, what: str, eager: str, eager_for_good: str):
    """capture()'s graph, or None when it raised: the failure counted on owner (a DecodeGraphs or token graphs; at
    max_failures `disabled` turns its graphs off for good) and warned, naming what was captured (`what`) and what
    runs eagerly instead."""
    try:
        return capture()
    except Exception as e:  # noqa: BLE001  (any capture failure: that call runs eagerly)
        owner.failures += 1
        why = f"{type(e).__name__}: {e}"
        if owner.failures >= owner.max_failures:
            owner.disabled = why
        warnings.warn(f"CUDA graph capture {what}failed ({why}); " + (eager_for_good if owner.disabled else eager),
                      RuntimeWarning, stacklevel=4)
        return None

