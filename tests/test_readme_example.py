"""The first ```python block of README.md runs as written (the real embedded model and bundled passages)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def first_python_block(text: str) -> str | None:
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    return m.group(1) if m else None


def test_readme_example_runs(tmp_path):
    # (two DRAGIN questions on the embedded model: about as long as the README's quick start per question)
    code = first_python_block(README.read_text(encoding="utf-8"))
    assert code is not None and "from fastrag import RAG" in code, "README.md lost its Python example"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.strip()
    # each question printed with its answer, in the order given (an answer may run over several lines)
    first = out.index("Which magazine was started first, Arthur's Magazine or First for Women? -> ")
    assert out.index("Who was born first, Albert Einstein or Niels Bohr? -> ") > first
    em, f1, qps = out.splitlines()[-1].split()
    assert 0 <= float(em) <= 1 and 0 <= float(f1) <= 1 and float(qps) > 0
    assert list(tmp_path.iterdir()) == []  # (nothing written)
