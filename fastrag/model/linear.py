"""The model's linear layers: `nn.Linear`, with a faster fp32 GEMM on the CPU.

A decode step multiplies a handful of rows (one per sequence) by every weight matrix, so it should run at the speed
the machine reads memory. torch's default CPU GEMM does not get close at those row counts: it reads the weights at
a fraction of the machine's bandwidth. oneDNN, which torch bundles, is markedly faster once the weight is reordered
into its blocked layout, for the large projections and for a whole decode step (benchmarks/results/cpu_gemm.md;
`benchmarks/bench_cpu_gemm.py` measures every projection shape and the engine step).

`Linear` keeps the dense weight as its parameter, so loading, `state_dict`, in-place edits and `.to("cuda")` behave
exactly as for `nn.Linear`. On the CPU it also keeps that reordered copy (the weights' memory twice over) and
rebuilds it whenever the weight changes: a new storage, or an in-place edit (the tensor's version counter).
`FASTRAG_CPU_GEMM=torch` turns the copy off (half the memory, torch's GEMM); results differ from torch's GEMM only
by float rounding (summation order).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

CPU_GEMM_ENV = "FASTRAG_CPU_GEMM"  # onednn (default where torch has it) | torch


def cpu_gemm_mode() -> str:
    from fastrag.settings import setting

    return setting(CPU_GEMM_ENV)


def onednn_available() -> bool:
    """torch was built with oneDNN and exposes the prepacked-linear ops that torch.compile's CPU freezing uses."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class Linear(nn.Linear):
    """`nn.Linear` whose fp32 CPU forward (outside autograd) runs through oneDNN with a prepacked weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.onednn = cpu_gemm_mode() == "onednn" and onednn_available()
        self._packed: tuple[tuple, torch.Tensor] | None = None  # (key of the weight it was made from, packed)

    def _key(self, w: torch.Tensor) -> tuple:
        return w.data_ptr(), w._version, tuple(w.shape), w.stride()

    def packed_weight(self) -> torch.Tensor:
        """The oneDNN copy of the current weight (made on first use and after every change of the weight)."""
        w = self.weight
        key = self._key(w)
        if self._packed is None or self._packed[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in and out of inference mode
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
            self._packed = (key, packed)
        return self._packed[1]

    def uses_onednn(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (self.onednn and x.device.type == "cpu" and w.device.type == "cpu" and w.dtype == torch.float32
                and x.dtype == torch.float32 and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_onednn(x):
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight(), b, "none", [], "")

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): the copy belongs to the old weight
        self._packed = None
        return super()._apply(fn, recurse)

    def __getstate__(self):  # the packed copy is rebuilt on first use (e.g. after pickling to a ray worker)
        state = super().__getstate__()
        state["_packed"] = None
        return state


def set_cpu_gemm(model: nn.Module, mode: str) -> None:
    """Switch every `Linear` in `model` to oneDNN ("onednn") or torch's GEMM ("torch"); "torch" frees the copies."""
    if mode not in ("onednn", "torch"):
        raise ValueError(f"cpu gemm mode {mode!r}: expected onednn or torch")
    if mode == "onednn" and not onednn_available():
        raise RuntimeError("this torch build has no oneDNN prepacked linear (torch.ops.mkldnn._linear_pointwise)")
    for m in model.modules():
        if isinstance(m, Linear):
            m.onednn = mode == "onednn"
            if not m.onednn:
                m._packed = None
