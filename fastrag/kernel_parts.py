"""A profile of engine steps split into parts: which kernels took a step's device time.

torch.profiler records the device kernels a step launches (graph replays included: CUPTI records the kernels a
graph launches). `part_of` puts each in one part of the step by its name: GEMMs, own-context attention (the paged
decode kernel), prefill attention (the paged prefill kernel), shared-prefix attention, fused layer ops,
signals and sampling (the attention passes' statistics too), SDPA attention, copies and fills, other torch
kernels. A CPU profile has no device kernels, so there the operators' own CPU times stand in for them,
put in parts by operator name the same way.

`StepWindow` profiles a window of an engine's steps inside a real run: `$FASTRAG_KERNEL_PROFILE=FIRST:COUNT` makes
fastrag.eval start torch.profiler before the engine's step FIRST (counted from 0 as the step trace counts them) and
stop it before step FIRST + COUNT, and write the window's parts to the run folder's kernel_profile.json and
metrics.json `kernel_profile`. Everything the device ran in the window is in it: prefills, decode steps and the
attention passes launched between steps. The profiler slows the host, so a profiled run's throughput is not a
measurement of the engine (a variant run, not the headline one). benchmarks/step_profile.py adds the GEMM table of
bench_decode --profile.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

KERNEL_PROFILE_ENV = "FASTRAG_KERNEL_PROFILE"

# (part, pattern over a device kernel's or a CPU operator's name); the first that matches names the part
PARTS: list[tuple[str, str]] = [
    ("own-context attention", r"_paged_decode_(partial|merge)_kernel|fastrag::paged_decode"),
    ("prefill attention (paged)", r"_paged_prefill_kernel"),
    # (the flash kernel whole; of the GEMM path its softmax and merge, its two GEMMs going with the GEMMs)
    ("shared-prefix attention", r"_prefix_(softmax|merge|flash_partial|flash_merge)_kernel"),
    ("fused layer ops", r"_add_rms_norm_kernel|_rope_write_kv_kernel|_silu_mul_kernel"),
    ("signals and sampling", r"_token_signals_|decode_(partial|combine|row|span|top_p)_kernel"
                             r"|_attn_decode_(row|span)_kernel|causal_(colmax|lse|rows|row_lse)_kernel"
                             r"|ArgMax|aten::argmax|fastrag::(decode|token|signals)"),
    ("SDPA attention", r"flash|fmha|efficient_attention|scaled_dot_product"),
    ("GEMM", r"nvjet|gemm|gemv|splitKreduce|xmma|cutlass|cublas|wgmma|^aten::(mm|addmm|bmm|baddbmm)$"
             r"|linear_pointwise"),
    ("copies and fills", r"^Memcpy|^Memset|aten::(copy_|fill_|zero_)$|CatArrayBatchedCopy|(?i:fillfunctor)"),
    ("other torch kernels", r""),
]
_PART_RES = [(name, re.compile(pat)) for name, pat in PARTS]

# the operators whose launches are matrix multiplies, with the shapes the profiler records for them
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")


def part_of(name: str) -> str:
    """The part of an engine step a device kernel (or, on a CPU, an operator) of this name belongs to."""
    for part, rx in _PART_RES:
        if rx.search(name):
            return part
    raise AssertionError("the last part matches every name")


@dataclass
class Launch:
    """One device kernel (GPU) or one operator's own time (CPU) of a profile, or one matrix multiply operator
    with its input shapes and the device time of its kernels."""
    name: str
    us: float
    shapes: list = field(default_factory=list)


def gemm_dims(name: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matrix multiply operator's input shapes, or None where they are not recorded:
    mm [M, K] x [K, N]; addmm (bias, [M, K], [K, N]); bmm [b, M, K] x [b, K, N]; baddbmm (c, [b, M, K], [b, K, N]);
    oneDNN's linear (input [.., K], weight [N, K])."""
    s = [list(x) for x in shapes if isinstance(x, (list, tuple))]
    try:
        if name == "aten::mm" and len(s[0]) == 2 and len(s[1]) == 2:
            return 1, s[0][0], s[0][1], s[1][1]
        if name == "aten::addmm" and len(s[1]) == 2 and len(s[2]) == 2:
            return 1, s[1][0], s[1][1], s[2][1]
        if name == "aten::bmm" and len(s[0]) == 3 and len(s[1]) == 3:
            return s[0][0], s[0][1], s[0][2], s[1][2]
        if name == "aten::baddbmm" and len(s[1]) == 3 and len(s[2]) == 3:
            return s[1][0], s[1][1], s[1][2], s[2][2]
        if name == "mkldnn::_linear_pointwise" and s[0] and len(s[1]) == 2:
            m = 1
            for d in s[0][:-1]:
                m *= d
            return 1, m, s[0][-1], s[1][0]
    except IndexError:
        return None
    return None


def launches(prof, gpu: bool) -> tuple[list[Launch], list[Launch]]:
    """(the profile's device kernels, or on a CPU its operators' own times; its matrix multiply operators with
    their shapes and device (GPU) or own (CPU) microseconds)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    if gpu:
        # (a record_function range shows on the device too, as a span over its kernels: not a kernel of its own)
        kernels = [Launch(e.name, e.time_range.elapsed_us()) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    else:
        kernels = [Launch(e.name, e.self_cpu_time_total) for e in events
                   if e.device_type == DeviceType.CPU and not getattr(e, "is_user_annotation", False)
                   and not getattr(e, "is_python_function", False) and e.name.split("::")[0] in ("aten", "mkldnn",
                                                                                                 "fastrag", "triton")]
    gemms = []
    for e in events:
        if e.device_type != DeviceType.CPU or e.name not in GEMM_OPS:
            continue
        us = sum(k.duration for k in e.kernels) if gpu else e.self_cpu_time_total
        gemms.append(Launch(e.name, us, list(e.input_shapes or [])))
    return kernels, gemms


def parts_table(kernels: list[Launch], steps: int) -> list[dict]:
    """Per part (in PARTS order, parts with no launch left out): distinct kernel names, launches and milliseconds
    a step, share of the step's kernel time, and the part's three longest kernels by time."""
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for k in kernels:
        by[part_of(k.name)][k.name].append(k.us)
    total = sum(k.us for k in kernels)
    out = []
    for part, _ in PARTS:
        if part not in by:
            continue
        names = by[part]
        us = sum(sum(v) for v in names.values())
        top = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:3]
        n_launches = sum(len(v) for v in names.values())
        out.append({"part": part, "kernels": len(names), "launches_per_step": n_launches / steps,
                    "ms_per_step": us / steps / 1e3, "share": us / total if total else 0.0,
                    "top": [(n, sum(v) / steps / 1e3) for n, v in top]})
    return out


def short_name(name: str, n: int = 60) -> str:
    """A kernel's name for a markdown table cell: no '|', at most n characters."""
    name = name.replace("|", "/")
    return name if len(name) <= n else name[: n - 3] + "..."


def kernel_profile_window() -> tuple[int, int] | None:
    """$FASTRAG_KERNEL_PROFILE as (first step, steps), or None when unset or blank; anything but FIRST:COUNT with
    FIRST >= 0 and COUNT >= 1 is an error naming the variable."""
    from fastrag.settings import setting

    return setting(KERNEL_PROFILE_ENV)


# engine counters whose change over the window says what the profiled steps did
_WINDOW_STATS = ("decode_steps", "decode_tokens", "prefill_calls", "prefill_tokens", "device_prefill_s",
                 "device_decode_s", "device_passes_s")


class StepWindow:
    """torch.profiler over engine steps [first, first + count): `before_step()` is called at the start of every
    step launch (Engine.step_launch), `finish()` when the run ends (a run of fewer steps stops it there)."""

    def __init__(self, first: int, count: int, device: torch.device):
        self.first, self.count, self.device = first, count, torch.device(device)
        self.seen = 0  # step launches so far
        self._prof = None
        self._stats0: dict | None = None
        self._t0 = 0.0
        self.summary: dict | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, stats: dict) -> None:
        if self.seen == self.first and self.summary is None:
            from torch.profiler import ProfilerActivity, profile

            self._sync()  # (the steps before the window finish outside it)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=acts)
            self._prof.start()
            self._stats0 = {k: stats.get(k, 0) for k in _WINDOW_STATS}
            self._t0 = time.perf_counter()
        elif self.seen == self.first + self.count and self._prof is not None:
            self._stop(stats, self.count)
        self.seen += 1

    def finish(self, stats: dict) -> dict | None:
        """Stop a window the run ended inside; the summary (None: the run had fewer than `first` steps)."""
        if self._prof is not None:
            self._stop(stats, self.seen - self.first)
        return self.summary

    def _stop(self, stats: dict, steps: int) -> None:
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.stop()
        gpu = self.device.type == "cuda"
        kernels, _ = launches(prof, gpu)
        steps = max(steps, 1)
        parts = parts_table(kernels, steps)
        self.summary = {
            "first_step": self.first, "steps": steps, "wall_s": wall,
            "unit": "device kernel" if gpu else "CPU operator (its own time)",
            "kernel_s": sum(k.us for k in kernels) / 1e6, "launches": len(kernels),
            "engine": {k: stats.get(k, 0) - self._stats0[k] for k in _WINDOW_STATS},
            "parts": parts,
        }
