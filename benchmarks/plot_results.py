"""Plots of the committed benchmark results (benchmarks/results/), written to docs/img/.

    pip install -e ".[plots]"           # matplotlib, an optional extra (never a runtime dependency)
    python benchmarks/plot_results.py   # -> docs/img/speedup.png, docs/img/decode_roofline.png

Every figure is read from the result files; nothing here is a hard-coded measurement. A file that is missing or
lacks the expected table is skipped with a note, so the script keeps working as results are replaced.

- speedup.png: left, the engine's speed-up over the per-question recipes (e2e_*.md/.json, beamsearchqa_speed.json,
  published_dragin.md); right, decode throughput against batch size, relative to batch 1 (decode_*.md).
- decode_roofline.png: decode step time against its roofline by batch size, per device and context (decode_*.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"

# (file, label) of the decode tables: the Llama-2-7B shape on each GPU, SmolLM2 on the CPU
DECODE_TABLES = [("decode_gpu_h200_2026-11-26.md", "H200, Llama-2-7B"), ("decode_gpu.md", "H100, Llama-2-7B"),
                 ("decode_gpu_h200_2026-11-26_llama2-13b.md", "H200, Llama-2-13B"),
                 ("decode_cpu.md", "2-core CPU, SmolLM2-135M")]


def md_tables(path: Path) -> list[list[dict[str, str]]]:
    """Every markdown table of a file as a list of rows (dicts keyed by the header's cells)."""
    tables, header, rows = [], None, []
    for line in path.read_text().splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not all(set(c) <= set("-: ") for c in cells):
                rows.append(dict(zip(header, cells)))
        elif header is not None:
            tables.append(rows)
            header, rows = None, []
    return tables


def number(text: str | None) -> float | None:
    """The first number in a cell ("1.22", "**10/10**" -> 10, "None" -> None)."""
    m = re.search(r"-?\d[\d,]*\.?\d*(?:e[+-]?\d+)?", text or "")
    return float(m.group(0).replace(",", "")) if m else None


def note(msg: str) -> None:
    print(f"plot_results: {msg}", file=sys.stderr)


def speedups() -> list[tuple[str, float]]:
    """(label, engine / per-question recipe) of the end-to-end results, read from their files."""
    out = []
    f = RESULTS / "e2e_cpu.json"
    if f.exists():
        row = next(r for r in json.loads(f.read_text())["rows"] if r["dataset"] == "all")
        out.append(("DRAGIN, CPU\n(oracle)", row["speedup"]))
    f = RESULTS / "beamsearchqa_speed.json"
    if f.exists():
        row = json.loads(f.read_text())["speed"][0]
        out.append(("BeamSearchQA, CPU\n(oracle)", row["speedup"]))
    f = RESULTS / "published_dragin.md"
    if f.exists():
        row = md_tables(f)[0][0]
        out.append(("DRAGIN, CPU\n(published code)", number(row.get("speed-up"))))
    for f in sorted(RESULTS.glob("e2e_gpu_*.md")):
        tables = md_tables(f)
        main = next((t for t in tables if t and "speedup" in t[0]), None)
        tuned = next((t for t in tables if t and "engine_vs_tuned" in t[0]), None)
        if main is None:
            note(f"{f.name}: no speed-up table")
            continue
        row = next(r for r in main if r["dataset"] == "all")
        device = "H200" if "h200" in f.name else "H100" if "h100" in f.name else "GPU"
        n = int(number(row["n_engine"]))
        out.append((f"DRAGIN, {device}, {n} q\n(published recipe, its run's oracle)", number(row["speedup"])))
        if tuned:
            out.append((f"DRAGIN, {device}, {n} q\n(tuned recipe)", number(tuned[0]["engine_vs_tuned"])))
    return [(label, x) for label, x in out if x is not None]


def decode_rows(name: str) -> list[dict[str, float]]:
    """(ctx, B, plain ms, roofline ms) rows of a bench_decode table; ctx is None in tables of one context."""
    f = RESULTS / name
    if not f.exists():
        note(f"{name}: missing, skipped")
        return []
    table = next((t for t in md_tables(f) if t and "roofline ms" in t[0] and "B" in t[0]), [])
    ctx_all = number(re.search(r"context (\d+) tokens", f.read_text()).group(1)) if "ctx" not in (table[0] if table
                                                                                                   else {}) else None
    rows = []
    for r in table:
        plain, roof = number(r["plain ms"]), number(r["roofline ms"])
        if plain is None or roof is None:
            continue
        rows.append({"ctx": number(r["ctx"]) if "ctx" in r else ctx_all, "B": number(r["B"]), "plain": plain,
                     "roofline": roof})
    return rows


def plot(out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    bars = speedups()
    ax1.barh([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    for i, (_, x) in enumerate(bars):
        ax1.text(x, i, f" {x:.1f}x", va="center")
    ax1.set_xscale("log")
    ax1.set_xlabel("engine speed-up over the per-question run (log)")
    ax1.set_title("End to end, same questions and decisions")
    ax1.invert_yaxis()
    ax1.set_xlim(1, max(x for _, x in bars) * 3)
    for name, label in DECODE_TABLES:
        rows = decode_rows(name)
        for ctx in sorted({r["ctx"] for r in rows}, key=lambda c: c or 0):
            pts = sorted((r["B"], r["B"] / r["plain"]) for r in rows if r["ctx"] == ctx)
            if len(pts) < 2 or pts[0][0] != 1:
                continue
            ax2.plot([p[0] for p in pts], [p[1] / pts[0][1] for p in pts], marker="o",
                     label=f"{label}, ctx {int(ctx)}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("decode batch size")
    ax2.set_ylabel("decode tokens/s relative to batch 1")
    ax2.set_title("Decode throughput against batch size")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    p = out / "speedup.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for name, label in DECODE_TABLES:
        rows = decode_rows(name)
        for ctx in sorted({r["ctx"] for r in rows}, key=lambda c: c or 0):
            pts = sorted((r["B"], r["plain"] / r["roofline"]) for r in rows if r["ctx"] == ctx)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label}, ctx {int(ctx)}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.3, color="tab:red", lw=0.8, ls="--", label="target at batch 64 (1.3x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step time / roofline")
    ax.set_title("Decode step against its roofline (weights + KV read / copy bandwidth)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "decode_roofline.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the PNG files (default docs/img)")
    args = ap.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("plot_results: matplotlib is not installed: pip install -e \".[plots]\"")
    for p in plot(args.out):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)


if __name__ == "__main__":
    main()
