"""Answer extraction and scoring, as the published DRAGIN evaluator does it (src/evaluate.py + src/data.py).

Pipeline for one question (`score`): the final generated text ->
1. `clean_prediction`: for each of `ANSWER_SPLIT_WORDS` in order, cut the text at its first occurrence when that
   occurrence is not at position 0 (the model ran on into a new "Question:" etc.).
2. If "the answer is" (lowercase, exact) is absent, the published evaluator runs ONE extra generation
   (`regenerate_answer`); the engine does it, with the pieces given here:
     prompt   = demos + case + " " + cleaned_text + ANSWER_PROMPT_SUFFIX
                (demos = `demo_text(dataset, fewshot)`, i.e. `"".join(demo + "\\n")`; case = the test case;
                 ANSWER_PROMPT_SUFFIX = " So the answer is ", trailing space included)
     generate ANSWER_MAX_TOKENS = 20 new tokens (the model's default decoding; greedy in parity runs)
     kept     = cleaned_text + ANSWER_PROMPT_SUFFIX + decode(new tokens).strip(), then cut at the first
                occurrence of each split word (this time at any position)   -> `complete_answer`
   (`answer_prompt` builds the prompt.) This is the rule of the evaluate.py that goes with the paper-era configs
   (keys `model_name_or_path`, output.txt). A later revision batches the call and uses the split words
   "\\nQuestion:", "#10000000", "Note:", ". Question:", EOS and pad; we follow the first.
3. `extract_answer`: the text after the first "the answer is" minus one character (the space), with trailing
   end-of-text markers, whitespace and periods removed (the published loaders strip "</s>", "<|endoftext|>",
   "\\n" and one "."; normalisation drops the punctuation anyway). None when "the answer is" is absent.
   When it is absent (no extra generation was run), the published loaders disagree: 2WikiMultihopQA scores the
   whole text, HotpotQA, IIRC and StrategyQA score "" (always wrong). We follow each; NQ/WebQ (not in DRAGIN)
   score the whole text like 2Wiki, so bare short answers can be scored.
4. EM / F1 against every gold alias, max over aliases (SQuAD normalisation). StrategyQA: the answer is "yes" if
   its first three characters are "yes" (case-insensitive), else "no" (published `StrategyQA.get_real_prediction`);
   accuracy = EM of that label against the gold "yes"/"no".
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

ANSWER_TRIGGER = "the answer is"  # lowercase only, as published
ANSWER_PROMPT_SUFFIX = " So the answer is "
ANSWER_MAX_TOKENS = 20
ANSWER_SPLIT_WORDS = ("Question:", "#10000000", "Note:")
_EOS_MARKERS = ("</s>", "<|endoftext|>")
_YES_NO = ("yes", "no", "noanswer")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """EM = max over gold aliases g of [normalize(pred) == normalize(g)]; 0.0 with no golds."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def f1_precision_recall(pred: str, golds: str | Iterable[str]) -> tuple[float, float, float]:
    """Token-overlap (F1, precision, recall), each maxed over gold aliases independently (as published).

    For one alias g with normalised token bags P, G and overlap c = |P & G| (multiset):
    precision = c/|P|, recall = c/|G|, F1 = 2pr/(p+r); 0 when c = 0, and 0 when either normalised side is one
    of "yes", "no", "noanswer" and the two differ (a yes/no answer gets no partial credit).
    """
    p = normalize_answer(pred)
    best = [0.0, 0.0, 0.0]
    for g in _golds(golds):
        g = normalize_answer(g)
        if (p in _YES_NO or g in _YES_NO) and p != g:
            continue
        pt, gt = p.split(), g.split()
        common = sum((Counter(pt) & Counter(gt)).values())
        if common == 0:
            continue
        prec, rec = common / len(pt), common / len(gt)
        f1 = 2 * prec * rec / (prec + rec)
        best = [max(best[0], f1), max(best[1], prec), max(best[2], rec)]
    return best[0], best[1], best[2]


def f1_score(pred: str, golds: str | Iterable[str]) -> float:
    """Max over gold aliases of token F1 (see `f1_precision_recall`)."""
    return f1_precision_recall(pred, golds)[0]


def clean_prediction(text: str) -> str:
    """Cut `text` at the first occurrence of each split word, in order, unless it occurs at position 0."""
    for word in ANSWER_SPLIT_WORDS:
        pos = text.find(word)
        if pos > 0:
            text = text[:pos]
    return text


def needs_answer_generation(text: str) -> bool:
    """True when the evaluator must run the extra answer generation ("the answer is" absent after cleaning)."""
    return ANSWER_TRIGGER not in clean_prediction(text)


def answer_prompt(demos: str, case: str, text: str) -> str:
    """Prompt of the extra answer generation: `demos + case + " " + clean(text) + " So the answer is "`."""
    return demos + case + " " + clean_prediction(text) + ANSWER_PROMPT_SUFFIX


def complete_answer(text: str, generated: str) -> str:
    """The text kept after the extra generation: `clean(text) + " So the answer is " + generated.strip()`,
    cut at the first occurrence of each split word (at any position)."""
    out = clean_prediction(text) + ANSWER_PROMPT_SUFFIX + generated.strip()
    for word in ANSWER_SPLIT_WORDS:
        pos = out.find(word)
        if pos != -1:
            out = out[:pos]
    return out


def _after_trigger(text: str) -> str | None:
    text = clean_prediction(text)
    pos = text.find(ANSWER_TRIGGER)
    if pos == -1:
        return None
    return text[pos + len(ANSWER_TRIGGER) + 1 :]  # +1 skips the space, as published


def extract_answer(text: str) -> str | None:
    """The answer after "the answer is" (trailing EOS markers, whitespace and periods trimmed); None if absent."""
    ans = _after_trigger(text)
    if ans is None:
        return None
    while True:
        trimmed = ans.rstrip().rstrip(".")
        for marker in _EOS_MARKERS:
            trimmed = trimmed.removesuffix(marker)
        if trimmed == ans:
            return ans.strip()
        ans = trimmed


def _yes_no(gold: bool | str | Sequence[str]) -> str:
    if isinstance(gold, bool):
        return "yes" if gold else "no"
    g = gold if isinstance(gold, str) else (gold[0] if len(gold) else "")
    g = normalize_answer(g)
    if g not in ("yes", "no"):
        raise ValueError(f"StrategyQA gold must be a bool or 'yes'/'no', got {gold!r}")
    return g


def strategyqa_label(text: str) -> str:
    """The published StrategyQA reading of a prediction: "yes" / "no" after "the answer is", else "".

    Without "the answer is", a text that is exactly a bare "yes"/"no" (after normalisation) is read as such.
    """
    ans = _after_trigger(text)
    if ans is None:
        bare = normalize_answer(text)
        return bare if bare in ("yes", "no") else ""
    return "yes" if ans[:3].lower() == "yes" else "no"


def strategyqa_accuracy(pred: str, gold: bool | str | Sequence[str]) -> float:
    """1.0 if `strategyqa_label(pred)` equals the gold label (bool, "yes"/"no" or ["yes"]), else 0.0."""
    return float(strategyqa_label(pred) == _yes_no(gold))


def score(example, prediction: str) -> dict:
    """Score the final generated text of one `Example`.

    Returns {"answer": the extracted answer that was scored, "em", "f1", "precision", "recall" (floats),
    "accuracy": float for strategyqa, None otherwise}.
    """
    if example.dataset == "strategyqa":
        answer = strategyqa_label(prediction)
    else:
        answer = extract_answer(prediction)
        if answer is None:  # see the module docstring, step 3
            whole_text = example.dataset in ("2wikimultihopqa", "nq", "webq", "qa")
            answer = clean_prediction(prediction).strip() if whole_text else ""
    f1, prec, rec = f1_precision_recall(answer, example.answers)
    em = exact_match(answer, example.answers)
    accuracy = em if example.dataset == "strategyqa" else None
    return {"answer": answer, "em": em, "f1": f1, "precision": prec, "recall": rec, "accuracy": accuracy}


def aggregate(scores: Iterable[dict]) -> dict:
    """Mean of every numeric key over the score dicts that have it (None skipped; a key never numeric -> None).

    Adds "n", the number of score dicts. Non-numeric keys (e.g. "answer") are dropped.
    """
    scores = list(scores)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    keys: list[str] = []
    for s in scores:
        for k, v in s.items():
            if k not in keys:
                keys.append(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                continue
            sums[k] = sums.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    out: dict = {}
    for k in keys:
        if k in counts:
            out[k] = sums[k] / counts[k]
        elif all(s.get(k) is None for s in scores):
            out[k] = None
    out["n"] = len(scores)
    return out
