"""fastrag's published fidelity against decisions recorded from the published DRAGIN code.

`python benchmarks/bench_published.py [--out benchmarks/results/published_dragin.md]` runs `fastrag compare-published`
on every recorded set of benchmarks/data/published-dragin/ (the shared HotpotQA ten with their trace replayed, and
the sets recorded on questions and configs outside them), then writes one table: per set, whole questions and
decisions that agree, the replay's agreement, and the speed of both sides on the same questions (the published
code's seconds a question as recorded, fastrag's as its run's wall over its questions, model loading excluded) with
the generate calls a question of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "published-dragin"
BUNDLED = ROOT / "fastrag" / "data" / "bundled"
# (name, method, dataset, questions file, config, decisions, trace or None)
SETS = [
    ("HotpotQA, the shared 10", "dragin-published", "hotpotqa", BUNDLED / "hotpotqa_dev20.jsonl",
     DATA / "config_hotpotqa.json", DATA / "hotpotqa_shared_first10.decisions.jsonl",
     DATA / "hotpotqa_shared_first10.trace.jsonl"),
    ("HotpotQA config, the project's own questions", "dragin-published", "hotpotqa", DATA / "own2.jsonl",
     DATA / "config_hotpotqa.json", DATA / "hotpotqa_own2.decisions.jsonl", DATA / "hotpotqa_own2.trace.jsonl"),
    ("2WikiMultihopQA config, dev", "dragin-published", "2wikimultihopqa", DATA / "2wiki_dev2.jsonl",
     DATA / "config_2wikimultihopqa.json", DATA / "2wikimultihopqa_dev2.decisions.jsonl",
     DATA / "2wikimultihopqa_dev2.trace.jsonl"),
    ("StrategyQA config, train", "dragin-published", "strategyqa", DATA / "strategyqa_train2.json",
     DATA / "config_strategyqa.json", DATA / "strategyqa_train2.decisions.jsonl",
     DATA / "strategyqa_train2.trace.jsonl"),
    ("Token-RAG (the paper's FLARE), HotpotQA config, the shared first 3", "token-rag", "hotpotqa",
     BUNDLED / "hotpotqa_dev20.jsonl", DATA / "config_token_rag_hotpotqa.json",
     DATA / "token_rag_hotpotqa3.decisions.jsonl", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "published_dragin.md")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_published")
    args = ap.parse_args()
    from fastrag.provenance import environment

    rows, details = [], []
    for name, method, dataset, data, config, decisions, trace in SETS:
        if not decisions.exists():
            print(f"skipping {name}: {decisions} not recorded", file=sys.stderr)
            continue
        out = args.work / decisions.stem
        cmd = [sys.executable, "-m", "fastrag", "compare-published", "--method", method, "--dataset", dataset,
               "--data", str(data),
               "--config", str(config), "--decisions", str(decisions), "--output", str(out), "--no-progress"]
        if trace is not None:
            cmd += ["--trace", str(trace)]
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
        rep = json.loads((out / "compare.json").read_text())
        m = json.loads((out / "metrics.json").read_text())
        ours = m["wall_s"] / m["n"] if m.get("n") else None
        pub = rep["published_seconds_per_question"]
        replay = rep.get("replay")
        rows.append(
            f"| {name} | {rep['questions_agree']} / {rep['n']} | {rep['decision_agreement']:.3f} | "
            + (f"{replay['decision_agreement']:.3f} ({replay['rounds']} rounds)" if replay else "not recorded")
            + f" | {pub:.1f} | {ours:.1f} | {pub / ours:.1f}x | {rep['published_generates_per_question']:.1f} | "
            f"{rep['fastrag_generates_per_question']:.1f} |")
        details.append((out / "compare.md").read_text())
    env = environment(None)
    head = [
        "# DRAGIN `fidelity: \"published\"` against the published code's recorded decisions", "",
        f"Measured {env.get('date')} on {env.get('device')}, fastrag at {_commit(env.get('git'))}.",
        f"Command: `python benchmarks/bench_published.py`; SmolLM2-135M fp32, greedy, BM25 over the bundled corpus, "
        "batch 32. The published code's seconds are those its decisions files recorded (a 2-core CPU of this "
        "workplace, one question at a time, fp32 eager; the last three sets' on a machine shared with other work, "
        "so their speed-ups are rough); fastrag's are its run's wall over its questions (all of "
        "them in one batch; model loading excluded). fastrag's generate calls count the evaluator's extra answer "
        "generation, which the published code runs in its evaluation script and does not count.", "",
        "| set | whole questions agree | decisions agree | replayed rounds agree | published s/question | "
        "fastrag s/question | speed-up | published generate calls/q | fastrag generate calls/q |",
        "|---|---|---|---|---|---|---|---|---|", *rows, ""]
    args.out.write_text("\n".join(head) + "\n" + "\n".join(details), encoding="utf-8")
    print(f"wrote {args.out}")


def _commit(git) -> str:
    if not isinstance(git, dict) or not git.get("commit"):
        return "an unknown commit"
    return git["commit"][:10] + (" with uncommitted changes" if git.get("dirty") else "")


if __name__ == "__main__":
    main()
