"""Compare fastrag's answers with the published DRAGIN code's own decisions (`fastrag compare-published`).

The published side is a decisions file: one JSON object a line, as recorded from the published code
(`method, qid, retrieve_count, generate_count, hallucination_checks, retrievals, final_text, seconds, ...`; each
retrieval `hallucinated_sentence_words, hit_words, ptext, query, retrieved_ids, ...`). fastrag's side is a run's
results.jsonl (`fastrag run --method dragin-published`, whose rounds carry the same fields). Decisions compared, in
the order the published loop takes them:

    check      retrieve or not, one a generation judged (hallucination_checks vs the rounds)
    kept       the text kept before the trigger sentence (ptext)
    words      the trigger sentence's words (hallucinated_sentence_words; DRAGIN)
    hits       its hit words after the real-word filter (DRAGIN)
    curr       the trigger sentence with its uncertain tokens marked "[xxx]" (TokenRAG)
    query      the formulated query (before the retriever's truncation)
    doc_ids    the retrieved passage ids
    final_text the generated text the loop ends with

A question agrees when every decision does; its first divergence is the first decision in that order that differs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (decision, the published record's key, our round's key); a decision whose key the published record lacks is not
# compared (DRAGIN's records log the sentence's words and hits, TokenRAG's the marked sentence `curr`)
RETRIEVAL_FIELDS = (("kept", "ptext", "kept"), ("words", "hallucinated_sentence_words", "sentence_words"),
                    ("hits", "hit_words", "hit_words"), ("curr", "curr", "trigger_sentence"),
                    ("query", "query", "query"), ("doc_ids", "retrieved_ids", "doc_ids"))
DECISIONS = ("check",) + tuple(d for d, _, _ in RETRIEVAL_FIELDS) + ("final_text",)


class CompareError(ValueError):
    """A decisions or results file that cannot be read; the message names the file, line and field."""


def read_jsonl(path: str | Path, need: tuple[str, ...], what: str) -> list[dict]:
    path = Path(path)
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CompareError(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CompareError(f"{path}: cannot read the {what} file: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CompareError(f"{path}, line {n}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rec, dict):
            raise CompareError(f"{path}, line {n}: expected a JSON object, got {type(rec).__name__}")
        for k in need:
            if k not in rec:
                raise CompareError(f"{path}, line {n}: field {k!r} is missing (a {what} record needs "
                                   f"{', '.join(need)})")
        out.append(rec)
    return out


PUBLISHED_FIELDS = ("qid", "hallucination_checks", "retrievals", "final_text")


def read_published(path: str | Path, method: str = "dragin") -> list[dict]:
    """The records of `method` in a published decisions file (records without `method` count as DRAGIN's)."""
    recs = read_jsonl(path, ("qid",), "published decisions")
    recs = [r for r in recs if r.get("method", "dragin") == method]
    for r in recs:
        for k in PUBLISHED_FIELDS:
            if k not in r:
                raise CompareError(f"{path}: question {r['qid']}: field {k!r} is missing")
    return recs


@dataclass
class QuestionCompare:
    qid: str
    agree: bool
    first_divergence: dict | None  # {decision, round, published, fastrag}
    counts: dict = field(default_factory=dict)  # decision -> [equal, compared]
    published_seconds: float | None = None
    fastrag_seconds: float | None = None
    published_generates: int | None = None
    fastrag_generates: int | None = None


# the published retriever pads a short result with random ids ("_" + a uuid4) beside its empty passages; fastrag's
# rounds list the passages found, so the padding is left out of the comparison
_PADDING_ID = re.compile(r"_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _found(ids):
    return [i for i in ids if not (isinstance(i, str) and _PADDING_ID.fullmatch(i))] if isinstance(ids, list) else ids


def compare_question(pub: dict, ours: dict) -> QuestionCompare:
    counts = {d: [0, 0] for d in DECISIONS}
    first: dict | None = None

    def see(decision: str, rnd: int | None, a: Any, b: Any) -> None:
        nonlocal first
        counts[decision][1] += 1
        if a == b:
            counts[decision][0] += 1
        elif first is None:
            first = {"decision": decision, "round": rnd, "published": a, "fastrag": b}

    checks = [bool(c) for c in pub["hallucination_checks"]]
    rounds = ours.get("rounds") or []
    mine = [r.get("query") is not None for r in rounds]
    pub_ret = list(pub["retrievals"])
    our_ret = [r for r in rounds if r.get("query") is not None]
    ri = 0
    for k in range(max(len(checks), len(mine))):
        a = checks[k] if k < len(checks) else None
        b = mine[k] if k < len(mine) else None
        see("check", k, a, b)
        if a is not b:
            break  # the two paths part here: later rounds answer different inputs
        if a:
            p, o = pub_ret[ri] if ri < len(pub_ret) else {}, our_ret[ri] if ri < len(our_ret) else {}
            for decision, pk, ok in RETRIEVAL_FIELDS:
                if pk in p or not p:
                    a = _found(p.get(pk)) if decision == "doc_ids" else p.get(pk)
                    see(decision, k, a, o.get(ok))
            ri += 1
    see("final_text", None, pub["final_text"], ours.get("text"))
    agree = all(e == n for e, n in counts.values()) and len(checks) == len(mine)
    return QuestionCompare(
        qid=str(pub["qid"]), agree=agree and first is None, first_divergence=first, counts=counts,
        published_seconds=pub.get("seconds"), fastrag_seconds=ours.get("wall_s"),
        published_generates=pub.get("generate_count"),
        fastrag_generates=(ours.get("counters") or {}).get("generate_calls", ours.get("llm_calls")))


def compare(published: list[dict], results: list[dict]) -> dict:
    """Per-question and per-decision agreement of `results` (results.jsonl records) with `published`; questions
    of the published file that the results lack (or hold as errors) are listed under `missing`."""
    by_qid = {str(r["qid"]): r for r in results if not r.get("error")}
    questions, missing = [], []
    for pub in published:
        ours = by_qid.get(str(pub["qid"]))
        if ours is None:
            missing.append(str(pub["qid"]))
            continue
        questions.append(compare_question(pub, ours))
    totals = {d: [sum(q.counts[d][0] for q in questions), sum(q.counts[d][1] for q in questions)]
              for d in DECISIONS}
    n = len(questions)
    all_eq = sum(e for e, _ in totals.values())
    all_n = sum(c for _, c in totals.values())
    ps = [q.published_seconds for q in questions if q.published_seconds is not None]
    fs = [q.fastrag_seconds for q in questions if q.fastrag_seconds is not None]
    return {
        "n": n,
        "questions_agree": sum(q.agree for q in questions),
        "question_agreement": sum(q.agree for q in questions) / n if n else None,
        "decision_agreement": all_eq / all_n if all_n else None,
        "per_decision": {d: {"equal": e, "compared": c, "rate": e / c if c else None} for d, (e, c) in totals.items()},
        "published_retrievals_per_question": sum(len(p["retrievals"]) for p in published) / len(published)
        if published else None,
        "published_seconds_per_question": sum(ps) / len(ps) if ps else None,
        "fastrag_seconds_per_question": sum(fs) / len(fs) if fs else None,
        "published_generates_per_question": _mean(q.published_generates for q in questions),
        "fastrag_generates_per_question": _mean(q.fastrag_generates for q in questions),
        "missing": missing,
        "questions": [q.__dict__ for q in questions],
    }


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def markdown(report: dict, title: str) -> str:
    """The report as a markdown table: per decision, then per question with its first divergence."""
    lines = [f"## {title}", "", "| decision | equal / compared | rate |", "|---|---|---|"]
    for d, v in report["per_decision"].items():
        rate = "n/a" if v["rate"] is None else f"{v['rate']:.3f}"
        lines.append(f"| {d} | {v['equal']} / {v['compared']} | {rate} |")
    lines += ["", f"Whole questions: **{report['questions_agree']} / {report['n']}**; all decisions: "
              f"{_pct(report['decision_agreement'])}.", "",
              "| question | agrees | first divergence | published gen. calls | fastrag gen. calls |",
              "|---|---|---|---|---|"]
    for q in report["questions"]:
        fd = q["first_divergence"]
        what = "" if fd is None else (f"{fd['decision']} (round {fd['round']}): published {_short(fd['published'])} / "
                                      f"fastrag {_short(fd['fastrag'])}")
        lines.append(f"| {q['qid']} | {'yes' if q['agree'] else 'no'} | {what} | {q['published_generates']} | "
                     f"{q['fastrag_generates']} |")
    if report["missing"]:
        lines += ["", f"Not in the results (or failed there): {', '.join(report['missing'])}."]
    return "\n".join(lines) + "\n"


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _short(v, n: int = 60) -> str:
    s = json.dumps(v, ensure_ascii=False)
    s = s if len(s) <= n else s[: n - 3] + "..."
    return s.replace("|", "\\|")


def published_method(method: str) -> str:
    """The `method` the published decisions file names for one of fastrag's methods."""
    return "dragin" if method.startswith("dragin") else method


def run_compare(opts, decisions: str, trace: str | None = None, results: str | None = None) -> dict:
    """`fastrag compare-published`: run `opts.method` on the decisions file's questions into `opts.output`
    (resumable like `fastrag run`; `results`: compare that results.jsonl instead), compare, and with `trace`
    replay the published rounds through our rules. Writes compare.json and compare.md into opts.output."""
    from dataclasses import replace

    from fastrag.eval import run, write_json

    import warnings

    from fastrag.eval import method_config

    with warnings.catch_warnings():  # (the run loads the config again, and says its warnings then)
        warnings.simplefilter("ignore")
        fidelity = getattr(method_config(opts), "fidelity", None)
    if fidelity != "published":
        raise CompareError(f"--method {opts.method} runs fastrag's reading of the rules: compare-published compares "
                           "the published fidelity, so give --config a file with \"fidelity\": \"published\" (or "
                           "use --method dragin-published)")
    pub = read_published(decisions, published_method(opts.method))
    if not pub:
        raise CompareError(f"{decisions}: no record of method {published_method(opts.method)!r}")
    out = Path(opts.output)
    if results is None:
        metrics = run(replace(opts, qids=tuple(str(p["qid"]) for p in pub), limit=None))
        results = str(out / "results.jsonl")
    else:
        metrics = None
    ours = read_jsonl(results, ("qid",), "results")
    report = compare(pub, ours)
    if metrics is not None:
        report["fastrag_questions_per_s"] = metrics.get("questions_per_s")
    if trace is not None:
        report["replay"] = replay_trace(opts, trace)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "compare.json", report)
    md = markdown(report, f"{opts.method} vs the published code: {Path(decisions).name}")
    if "replay" in report:
        md += replay_markdown(report["replay"])
    (out / "compare.md").write_text(md, encoding="utf-8")
    return report


def replay_trace(opts, trace: str) -> dict:
    """Replay a published trace through the oracle's published-mode rules (fastrag.published_replay)."""
    from fastrag.eval import method_config
    from fastrag.methods.registry import get_method
    from fastrag.model.loading import load_tokenizer
    from fastrag.parity import oracle_model
    from fastrag.published_replay import read_trace, replay
    from fastrag.retrieval import make_retriever

    cfg = method_config(opts)
    if getattr(cfg, "fidelity", None) != "published":
        raise CompareError(f"--trace replays the published rules: run it with --method dragin-published (the config of "
                           f"--method {opts.method} is not fidelity 'published')")
    recs = read_trace(trace)
    tok = load_tokenizer(opts.model)
    # (SDPA: the replay's forwards need no attention probabilities but the last layer's, which the oracle recomputes)
    oracle = get_method(opts.method).make_oracle(oracle_model(opts.model, "tuned"), tok,
                                                 make_retriever(opts.retriever, corpus_path=opts.corpus,
                                                                show_progress=opts.progress), cfg)
    return replay(oracle, recs, progress=opts.progress)


def replay_markdown(rep: dict) -> str:
    lines = ["", f"### Replay of the published trace ({rep['questions']} questions, {rep['rounds']} rounds)", "",
             "Each rule fed the published run's own inputs, round by round (fastrag/published_replay.py).", "",
             "| decision | equal / compared | rate |", "|---|---|---|"]
    for d, v in rep["per_decision"].items():
        rate = "n/a" if v["rate"] is None else f"{v['rate']:.3f}"
        label = "text (the carried text, a check of the replay itself)" if d == "text" else d
        lines.append(f"| {label} | {v['equal']} / {v['compared']} | {rate} |")
    lines += ["", f"All decisions but the carried text: **{_pct(rep['decision_agreement'])}**; generations whose "
              f"text re-tokenised to other tokens: {rep['retokenised']}.", ""]
    diffs = [(q["qid"], d) for q in rep["per_question"] for d in q["differences"]]
    if diffs:
        lines += ["| question | round | decision | published | fastrag |", "|---|---|---|---|---|"]
        lines += [f"| {qid} | {d['round']} | {d['decision']} | {_short(d['published'])} | {_short(d['fastrag'])} |"
                  for qid, d in diffs]
    return "\n".join(lines) + "\n"
