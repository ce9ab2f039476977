"""How far a prefill attention row is from a distribution when the kernel that divides by the row's log-sum-exp
forms its scores with a fused multiply-add and the kernel that computed the log-sum-exp did not (float32, numpy).

The prefill statistics (kernels/attn_stats.py, csrc/attn_stats.cu) find each row's largest score m and log l in one
kernel and form p = exp((s - m) - log l) in another. Compiled for a GPU, `dot * scale - m` became one fused
multiply-add: the exact product less m, while m is the rounded product. The kernels now round the product explicitly
in both places; this emulates both ways on random rows (the dot products themselves rounded once, as both kernels
form them alike) and reports the worst |row sum - 1| or p - 1 over the rows. A head dim whose scale D ** -0.5 is a
power of two (64) makes the product exact, and both ways agree.

    python benchmarks/emulate_score_rounding.py [--rows 200] [--out benchmarks/results/score_rounding_emulation.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys

import numpy as np

F32 = np.float32


def _off_a_distribution(p: np.ndarray) -> float:
    """|sum(p) - 1| or max(p) - 1, whichever is larger."""
    return max(abs(float(p.astype(np.float64).sum()) - 1.0), float(p.max()) - 1.0)


def worst_deviation(D: int, mag: float, rows: int, keys: int, seed: int) -> tuple[float, float, float]:
    """(score std, worst deviation with the fused product, worst with the rounded product) over `rows` rows."""
    rng = np.random.default_rng(seed)
    scale = F32(D ** -0.5)
    worst_fused = worst_rounded = 0.0
    stds = []
    for _ in range(rows):
        q = (rng.standard_normal(D) * mag).astype(F32)
        k = (rng.standard_normal((keys, D)) * mag).astype(F32)
        dot = (k.astype(np.float64) @ q.astype(np.float64)).astype(F32)
        s = (dot * scale).astype(F32)                      # the rounded product (what m and l were made of)
        exact = dot.astype(np.float64) * np.float64(scale)  # what an fma sees: the product before rounding
        stds.append(float(s.std()))
        m = s.max()
        log_l = F32(np.log(np.exp(s - m, dtype=F32).sum(dtype=F32)))
        fused = np.exp((exact - np.float64(m)).astype(F32) - log_l, dtype=F32)  # fma(dot, scale, -m), rounded once
        rounded = np.exp((s - m) - log_l, dtype=F32)
        worst_fused = max(worst_fused, _off_a_distribution(fused))
        worst_rounded = max(worst_rounded, _off_a_distribution(rounded))
    return float(np.median(stds)), worst_fused, worst_rounded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--keys", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write this markdown file")
    a = ap.parse_args(argv)
    lines = ["# Prefill attention rows with a fused vs a rounded score product (float32 emulation)", "",
             f"- date: {dt.date.today()}; numpy {np.__version__}; CPU only (an emulation, no kernel runs)",
             f"- command: `python benchmarks/emulate_score_rounding.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
             f"- {a.rows} rows of {a.keys} keys a cell; q and k entries N(0, |q|^2); worst |row sum - 1| or p - 1",
             "", "| head dim | scale | \\|q\\|, \\|k\\| | median score std | fused product | rounded product |",
             "|---|---|---|---|---|---|"]
    for D in (64, 128):
        for mag in (1.0, 8.0, 1e3):
            std, fused, rounded = worst_deviation(D, mag, a.rows, a.keys, a.seed)
            lines.append(f"| {D} | {float(F32(D ** -0.5)):.9g} | {mag:g} | {std:.3g} | {fused:.2e} | {rounded:.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
