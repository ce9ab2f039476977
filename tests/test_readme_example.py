"""The first ```python block of README.md runs as written (the real embedded model and bundled passages)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# the example the README opens with (what its first python block holds; used until README.md has one)
EXAMPLE = '''from fastrag import RAG, BM25

rag = RAG(model="smollm2", retriever=BM25(), batch_size=8)  # embedded SmolLM2 + bundled Wikipedia passages
results = rag.run(
    ["Which magazine was started first, Arthur's Magazine or First for Women?",
     {"question": "Who was born first, Albert Einstein or Niels Bohr?", "answers": ["Niels Bohr"]}],
    method="dragin", dataset="hotpotqa")
for r in results:
    print(r.question, "->", r.prediction)
print(results.metrics["em"], results.metrics["f1"], results.metrics["questions_per_s"])
'''


def first_python_block(text: str) -> str | None:
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    return m.group(1) if m else None


@pytest.mark.slow  # (the default DRAGIN config over two questions: minutes on a CPU)
def test_readme_example_runs(tmp_path):
    code = first_python_block(README.read_text(encoding="utf-8")) if README.exists() else None
    if code is None or "from fastrag import RAG" not in code:  # (the README before its API example)
        code = EXAMPLE
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("Which magazine was started first") and " -> " in lines[0]
    assert lines[1].startswith("Who was born first") and " -> " in lines[1]
    em, f1, qps = lines[-1].split()
    assert 0 <= float(em) <= 1 and 0 <= float(f1) <= 1 and float(qps) > 0
    assert list(tmp_path.iterdir()) == []  # (nothing written)
