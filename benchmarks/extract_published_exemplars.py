"""Extract the published DRAGIN code's few-shot exemplars into fastrag/data/exemplars/published/*.json.

`python benchmarks/extract_published_exemplars.py PATH/TO/src/data.py` (the published repository's data module, read
as text and parsed with `ast`, never imported). Each dataset class holds a list `examplars` of dicts with
`question`, `cot` (a string, or a tuple of strings the code joins with "") and `answer`; the published `fidelity`
mode builds its demos from them byte for byte (fastrag.data.exemplars.published_demo_text), which is not the paper's
appendix text: e.g. HotpotQA's "The Phantom Hour." answer carries its own period, so its demo ends "..", and the
code holds 8 2WikiMultihopQA, 11 HotpotQA and 20 IIRC exemplars where the paper prints 6, 8 and 8.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "fastrag" / "data" / "exemplars" / "published"
CLASSES = {"WikiMultiHopQA": "2wikimultihopqa", "HotpotQA": "hotpotqa", "StrategyQA": "strategyqa",
           "IIRC": "iirc"}


def extract(source: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in CLASSES):
            continue
        for st in node.body:
            target = st.target if isinstance(st, ast.AnnAssign) else (st.targets[0] if isinstance(st, ast.Assign)
                                                                       else None)
            if getattr(target, "id", None) != "examplars":
                continue
            items = []
            for e in ast.literal_eval(st.value):
                cot = e.get("cot")
                # (a missing cot is formatted as the string "None" by the published template; none is missing)
                cot = "".join(cot) if isinstance(cot, (tuple, list)) else cot
                items.append({"question": e["question"], "cot": cot, "answer": e["answer"]})
            out[CLASSES[node.name]] = items
    missing = set(CLASSES.values()) - set(out)
    if missing:
        raise SystemExit(f"no `examplars` list found for {', '.join(sorted(missing))}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_py", type=Path, help="the published repository's src/data.py")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, items in extract(args.data_py.read_text(encoding="utf-8")).items():
        (OUT / f"{name}.json").write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{name}: {len(items)} exemplars")


if __name__ == "__main__":
    main()
