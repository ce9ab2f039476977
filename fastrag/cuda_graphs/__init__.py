"""CUDA graphs for the engine's small, launch-bound calls: decode steps (`DecodeGraphs`, fastrag.cuda_graphs.decode),
packed prefills and DRAGIN's attention passes (`PrefillGraphs`, `PassGraphs`, fastrag.cuda_graphs.tokens), over the
capture helpers of fastrag.cuda_graphs.capture. Each module's docstring says what its graphs read and how padding
stays out of every sequence's cache; `emulate=True` runs the same protocol on the CPU for the tests."""

from fastrag.cuda_graphs.capture import capture_cuda_graph, try_capture
from fastrag.cuda_graphs.decode import MAX_PREFIXES, DecodeGraphs, batch_buckets
from fastrag.cuda_graphs.tokens import PassGraphs, PrefillGraphs, token_buckets

__all__ = ["MAX_PREFIXES", "DecodeGraphs", "PassGraphs", "PrefillGraphs", "batch_buckets", "capture_cuda_graph",
           "token_buckets", "try_capture"]
