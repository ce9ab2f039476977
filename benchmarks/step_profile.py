"""Where a decode step's device time goes: torch.profiler's record of a few steps, split into the step's parts
and, for the matrix multiplies, into the weights they read, each against its own floor.

The parts are fastrag.kernel_parts' (`part_of`: each device kernel by its name; on a CPU the operators' own
times stand in for kernels). The matrix multiplies are also listed by the operator that launched them (aten::mm,
aten::addmm, aten::bmm, oneDNN's linear on the CPU), with its input shapes: those tell which weight each read, how
many bytes and FLOPs that is, and so its floor, max(bytes / copy bandwidth, FLOPs / matmul rate). A graph replay
launches no operator, so that table needs an eager profile.

Used by bench_decode.py --profile; `profile_steps` runs any step function under the profiler.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrag.kernel_parts import PARTS, Launch, gemm_dims, launches, short_name  # noqa: E402


def weight_names(model) -> dict[tuple[int, int], str]:
    """(K, N) of each linear layer's multiply (input features, output features) -> the layer's name, without
    the layer index (the same weight in every layer is one row of the GEMM table)."""
    out: dict[tuple[int, int], str] = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, torch.nn.Linear) and w is not None and w.dim() == 2:
            short = re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name)
            out.setdefault((w.shape[1], w.shape[0]), short)
    return out


def gemm_table(gemms: list[Launch], steps: int, names: dict[tuple[int, int], str], elt: int, bw: float,
               rate: float) -> list[dict]:
    """The matrix multiplies grouped by (operator shape): calls and milliseconds a step, and their floor a step,
    each call's max(bytes / bw, FLOPs / rate) with bytes = both inputs and the output in the model's dtype; the
    achieved GB/s and TFLOP/s. `names` names a (K, N) after the weight of that shape. Longest first."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    unshaped = []
    for g in gemms:
        d = gemm_dims(g.name, g.shapes)
        if d is None:
            unshaped.append(g.us)
            continue
        groups[d].append(g.us)
    out = []
    for (b, m, k, n), us in groups.items():
        nbytes = b * (m * k + k * n + m * n) * elt
        flops = 2 * b * m * k * n
        t = sum(us) / len(us) / 1e6  # seconds a call
        floor = max(nbytes / bw, flops / rate)
        label = names.get((k, n)) if b == 1 else None
        out.append({"gemm": label or (f"batched {b} x" if b > 1 else "other"), "b": b, "m": m, "k": k, "n": n,
                    "calls_per_step": len(us) / steps, "ms_per_step": sum(us) / steps / 1e3,
                    "floor_ms_per_step": floor * len(us) / steps * 1e3, "x_floor": t / floor if floor else None,
                    "gb_per_s": nbytes / t / 1e9 if t else None, "tflop_per_s": flops / t / 1e12 if t else None,
                    "bound": "bandwidth" if nbytes / bw >= flops / rate else "compute"})
    if unshaped:
        out.append({"gemm": "shapes not recorded", "b": None, "m": None, "k": None, "n": None,
                    "calls_per_step": len(unshaped) / steps, "ms_per_step": sum(unshaped) / steps / 1e3,
                    "floor_ms_per_step": None, "x_floor": None, "gb_per_s": None, "tflop_per_s": None, "bound": "-"})
    return sorted(out, key=lambda r: -r["ms_per_step"])


def profile_steps(step, steps: int, gpu: bool) -> tuple[list[Launch], list[Launch]]:
    """Run step() `steps` times under torch.profiler (with shapes) and return `launches` of the record."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize()
    return launches(prof, gpu)


def markdown(title: str, step_ms: dict[str, float], parts: dict[str, list[dict]], gemms: list[dict] | None,
             gpu: bool) -> list[str]:
    """The section bench_decode writes for one profiled cell: `parts` maps a way of running the step ("graphs",
    "eager") to its parts_table, `step_ms` the same ways to the step's timed milliseconds."""
    unit = "device" if gpu else "operator (CPU: host)"
    lines = [f"### {title}", ""]
    ways = list(parts)
    head = "| part | " + " | ".join(f"{w}: launches a step | {w}: ms a step | {w}: share" for w in ways) + \
        " | longest kernels (" + ways[-1] + ", ms a step) |"
    lines += [head, "|---|" + "---|---|---|" * len(ways) + "---|"]
    order = [p for p, _ in PARTS if any(r["part"] == p for w in ways for r in parts[w])]
    for p in order:
        cells = []
        for w in ways:
            r = next((r for r in parts[w] if r["part"] == p), None)
            cells.append("- | - | -" if r is None else
                         f"{r['launches_per_step']:.1f} | {r['ms_per_step']:.3f} | {r['share']:.1%}")
        last = next((r for r in parts[ways[-1]] if r["part"] == p), None) or next(
            r for w in ways for r in parts[w] if r["part"] == p)
        top = "; ".join(f"`{short_name(n)}` {ms:.3f}" for n, ms in last["top"])
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {top} |")
    cells = []
    for w in ways:
        tot = sum(r["ms_per_step"] for r in parts[w])
        cells.append(f"{sum(r['launches_per_step'] for r in parts[w]):.1f} | {tot:.3f} | "
                     f"{tot / step_ms[w]:.0%} of the timed {step_ms[w]:.3f} ms" if step_ms.get(w) else
                     f"{sum(r['launches_per_step'] for r in parts[w]):.1f} | {tot:.3f} | -")
    lines.append(f"| **all {unit} time** | " + " | ".join(cells) + " | |")
    lines.append("")
    if gemms:
        lines += ["Matrix multiplies of the eager step, by operator shape (M rows x K x N; 'batched b x': b "
                  "multiplies at once, as the shared prefixes' scores and values):", "",
                  "| GEMM | b x M x K x N | calls a step | ms a step | floor ms a step | x floor | GB/s | TFLOP/s | "
                  "bound |", "|---|---|---|---|---|---|---|---|---|"]
        for r in gemms:
            dims = "-" if r["m"] is None else f"{r['b']} x {r['m']} x {r['k']} x {r['n']}"
            f = (lambda v, fmt: "-" if v is None else format(v, fmt))
            # (significant digits, not decimals: a tiny shape's floor on a CPU is well under a microsecond)
            lines.append(f"| {r['gemm']} | {dims} | {r['calls_per_step']:.1f} | {r['ms_per_step']:.3g} | "
                         f"{f(r['floor_ms_per_step'], '.3g')} | {f(r['x_floor'], '.2f')} | {f(r['gb_per_s'], '.3g')} | "
                         f"{f(r['tflop_per_s'], '.3g')} | {r['bound']} |")
        lines.append("")
    return lines
