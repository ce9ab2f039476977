"""Few-shot exemplars and the prompt pieces built from them.

The exemplars are the DRAGIN paper's "Direct" prompts (appendix F, Prompts 1, 3, 5, 7), stored as
`exemplars/<dataset>.json` = `[{"question": q, "answer": cot + " So the answer is X."}, ...]` and extracted by
`benchmarks/extract_exemplars.py`. Counts: 2WikiMultihopQA 6, HotpotQA 8, IIRC 8, StrategyQA 6. (The paper's
Table 8 says 8 StrategyQA exemplars, but its Prompt 5 prints 6, the published code holds 6, and the published
StrategyQA configs use `fewshot: 6`.) NQ and WebQuestions have no exemplars of their own in DRAGIN; they reuse
HotpotQA's (single-hop open-domain QA in the same "... So the answer is X." style).

What the published DRAGIN code does (src/data.py, `BaseDataset.format` and the per-dataset templates):
- demo i = `demo_input_template(q) + " " + output_template(cot, a)` = `"Question: {q}\\nAnswer: {cot} So the
  answer is {a}."`, i.e. our `"Question: {question}\\nAnswer: {answer}"`; the generator joins demos as
  `"".join(d + "\\n" for d in demos)` -> `demo_text`.
- the test "case" is `test_input_template(q)`. For 2WikiMultihopQA and IIRC it is `"Question: {q}\\nAnswer:"`.
  HotpotQA and StrategyQA prefix an instruction (the paper's Prompts 3 and 5 print the same lines):
  HotpotQA `"Answer the following question by reasoning step-by-step, following the example above.\\n"`,
  StrategyQA `"Following the examples above, answer the question by reasoning step-by-step.\\n\\n"`.
  `case_text(question)` gives the plain form (the contract of docs/dragin-reference.md);
  `case_text(question, dataset)` gives the published per-dataset form.

The module shares its name with the data directory `exemplars/`; Python imports this module (a directory
without `__init__.py` only becomes a namespace package when no module of that name exists).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from fastrag.data.datasets import DataError, canonical_dataset

EXEMPLAR_DIR = Path(__file__).resolve().parent / "exemplars"
# the published code's own exemplars (benchmarks/extract_published_exemplars.py): `fidelity: "published"` prompts
PUBLISHED_DIR = EXEMPLAR_DIR / "published"
# datasets without exemplars of their own -> whose exemplars they use
_SHARED = {"nq": "hotpotqa", "webq": "hotpotqa", "qa": "hotpotqa"}
# published test-case instructions (DRAGIN src/data.py test_input_template), placed before "Question: "
CASE_PREFIX = {
    "hotpotqa": "Answer the following question by reasoning step-by-step, following the example above.\n",
    "strategyqa": "Following the examples above, answer the question by reasoning step-by-step.\n\n",
}


def _read(path: Path, keys: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The exemplars of one file: each a tuple of its string fields `keys`; DataError naming the file and item."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot load exemplars: {e}") from None
    out = []
    for i, it in enumerate(items):
        if not (isinstance(it, dict) and all(isinstance(it.get(k), str) for k in keys)):
            raise DataError(f"{path}[{i}]: exemplar needs string fields {', '.join(repr(k) for k in keys)}")
        out.append(tuple(it[k] for k in keys))
    return tuple(out)


@lru_cache(maxsize=None)
def _load(name: str) -> tuple[tuple[str, str], ...]:
    return _read(EXEMPLAR_DIR / f"{name}.json", ("question", "answer"))


def load_exemplars(dataset: str) -> list[tuple[str, str]]:
    """The (question, answer) exemplars of `dataset`, in prompt order; answers end "So the answer is X."."""
    name = canonical_dataset(dataset)
    return list(_load(_SHARED.get(name, name)))


def demo_text(dataset: str, fewshot: int) -> str:
    """`"".join(f"Question: {q}\\nAnswer: {a}\\n" for q, a in first fewshot exemplars)`; "" for fewshot=0.

    Asking for more exemplars than exist is an error (the published code would fail with an IndexError).
    """
    ex = load_exemplars(dataset)
    if isinstance(fewshot, bool) or not isinstance(fewshot, int) or fewshot < 0:
        raise ValueError(f"fewshot must be an int >= 0, got {fewshot!r}")
    if fewshot > len(ex):
        raise ValueError(f"fewshot={fewshot} but {canonical_dataset(dataset)} has only {len(ex)} exemplars")
    return "".join(f"Question: {q}\nAnswer: {a}\n" for q, a in ex[:fewshot])


def case_text(question: str, dataset: str | None = None) -> str:
    """`"Question: {question}\\nAnswer:"`, preceded by the published instruction of `dataset` when one is given."""
    prefix = "" if dataset is None else CASE_PREFIX.get(canonical_dataset(dataset), "")
    return f"{prefix}Question: {question}\nAnswer:"


@lru_cache(maxsize=None)
def _load_published(name: str) -> tuple[tuple[str, str, str], ...]:
    return _read(PUBLISHED_DIR / f"{name}.json", ("question", "cot", "answer"))


def published_exemplar_count(dataset: str) -> int:
    """How many exemplars the published code holds for `dataset` (NQ and WebQuestions: HotpotQA's)."""
    name = canonical_dataset(dataset)
    return len(_load_published(_SHARED.get(name, name)))


def published_demo_text(dataset: str, fewshot: int) -> str:
    """The published code's demos, byte for byte: `"Question: {q}\\nAnswer: {cot} So the answer is {a}.\\n"` for its
    first `fewshot` exemplars (an answer with its own final period gives ".."; the published templates)."""
    ex = _load_published(_SHARED.get(canonical_dataset(dataset), canonical_dataset(dataset)))
    if isinstance(fewshot, bool) or not isinstance(fewshot, int) or fewshot < 0:
        raise ValueError(f"fewshot must be an int >= 0, got {fewshot!r}")
    if fewshot > len(ex):
        raise ValueError(f"fewshot={fewshot} but the published {canonical_dataset(dataset)} exemplars are {len(ex)}")
    return "".join(f"Question: {q}\nAnswer: {cot} So the answer is {a}.\n" for q, cot, a in ex[:fewshot])
