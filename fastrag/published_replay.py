"""Replay a published DRAGIN trace through fastrag's published-mode rules, one decision at a time.

A whole-question comparison (fastrag.compare_published) stops meaning much after the first divergence: from there
the two sides judge different generations. A replay instead feeds each of fastrag's rules the published run's own
inputs, round by round, and compares each answer with the published one:

    generate_attn (new_text)   -> our RIND on those tokens: retrieve or not, kept text, sentence words, hit words
    check (ptext, curr_tokens, hit_words), on the published run's retrieval
                               -> our query from the published kept text, words and hits: the query
    retrieve (query)           -> our search for the published query: the passage ids
    generate (new_text)        -> the text carried into the next round, by our join rules (checked against the
                                  published `text_at_trigger`, the retrieval prompt's text after the case)

The generated tokens are the published text re-tokenised (a generation's text decodes from its ids; encoding it
back gives the same ids unless the model chose a non-canonical split, which the replay counts as `retokenised`),
and their entropies come from one forward over the prompt and those tokens (teacher forcing: the distributions
greedy decoding drew them from). The trace format: one JSON object a question with `qid, question, steps`, each
step `{kind: generate_attn | check | retrieved_ids | retrieve | generate, ...}`.
"""

from __future__ import annotations

import torch

from fastrag.compare_published import CompareError, read_jsonl
from fastrag.data.exemplars import case_text
from fastrag.methods import published as P
from fastrag.methods.common import join
from fastrag.oracle import decisions as D
from fastrag.text.sentences import first_sentence

REPLAY_DECISIONS = ("check", "kept", "words", "hits", "query", "doc_ids", "text")


def read_trace(path) -> list[dict]:
    recs = read_jsonl(path, ("qid", "question", "steps"), "published trace")
    for r in recs:
        if not isinstance(r["steps"], list):
            raise CompareError(f"{path}: question {r['qid']}: field 'steps' must be a list")
    return recs


def _flags(words: list[str], hit_words: list[str]) -> list[bool]:
    """Hit flags over `words` for the published hit list (its words in order): each hit word on the first word
    left that spells it."""
    flags, j = [False] * len(words), 0
    for i, w in enumerate(words):
        if j < len(hit_words) and w == hit_words[j]:
            flags[i], j = True, j + 1
    return flags


@torch.no_grad()
def teacher_entropy(oracle, prompt: str, ids: list[int]) -> torch.Tensor:
    """Entropies [N] of the distributions that produced `ids` after `prompt` (one forward)."""
    p = oracle.tokenizer.encode(prompt)
    x = torch.tensor([p + ids], device=oracle.model.device)
    logits = oracle.model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, len(p) - 1: len(p) + len(ids) - 1]
    return D.token_entropy(logits.float().cpu())


def replay_question(oracle, rec: dict) -> dict:
    """Per-decision [equal, compared] counts of one traced question and its decisions that differ."""
    cfg = oracle.config
    case = case_text(rec["question"], cfg.dataset)
    steps = rec["steps"]
    counts = {d: [0, 0] for d in REPLAY_DECISIONS}
    diffs: list[dict] = []
    retokenised = 0

    def see(decision, rnd, pub, ours):
        counts[decision][1] += 1
        if pub == ours:
            counts[decision][0] += 1
        else:
            diffs.append({"decision": decision, "round": rnd, "published": pub, "fastrag": ours})

    text, rnd, i = "", 0, 0
    while i < len(steps):
        st = steps[i]
        if st["kind"] != "generate_attn":
            raise CompareError(f"question {rec['qid']}: step {i} is {st['kind']!r}, expected 'generate_attn'")
        check = steps[i + 1] if i + 1 < len(steps) else None
        if check is None or check.get("kind") != "check":
            raise CompareError(f"question {rec['qid']}: step {i + 1} should be the 'check' of step {i}")
        new_text = st["new_text"]
        ids = oracle.tokenizer.encode(new_text, add_special_tokens=False)
        retokenised += oracle.decode(ids) != new_text
        hit = oracle.rind(ids, teacher_entropy(oracle, oracle.demos + join(case, text), ids)) if ids else None
        see("check", rnd, bool(check["hallucination"]), hit is not None)
        i += 2
        if not check["hallucination"]:
            text = P.plain_join(text, new_text)
            rnd += 1
            continue
        if hit is not None:
            see("kept", rnd, check["ptext"], hit.kept)
            see("words", rnd, check["curr_tokens"], hit.words)
            see("hits", rnd, check["hit_words"], [w for w, h in zip(hit.words, hit.hits) if h])
        words, pub_hits = check["curr_tokens"], check["hit_words"]
        flags = hit.hits if hit is not None and hit.words == words and \
            [w for w, h in zip(hit.words, hit.hits) if h] == pub_hits else _flags(words, pub_hits)
        by_kind = {}
        while i < len(steps) and steps[i]["kind"] in ("retrieved_ids", "retrieve", "generate"):
            by_kind[steps[i]["kind"]] = steps[i]
            i += 1
        if "retrieve" not in by_kind or "generate" not in by_kind:
            raise CompareError(f"question {rec['qid']}: round {rnd} retrieved without a 'retrieve' and a 'generate' "
                               "step")
        # text_at_trigger is what follows the case in the published retrieval prompt: " " + join(text, kept)
        see("text", rnd, by_kind["generate"].get("text_at_trigger"),
            join(case, text, check["ptext"].strip())[len(case):])
        pub_query = by_kind["retrieve"]["query"]
        see("query", rnd, pub_query, oracle.query(rec["question"], text, check["ptext"], words, flags))
        if "retrieved_ids" in by_kind:
            see("doc_ids", rnd, list(by_kind["retrieved_ids"]["ids"]),
                [str(d.id) for d in oracle.search(pub_query)])
        text = join(text.strip(), check["ptext"].strip(), first_sentence(by_kind["generate"]["new_text"]))
        rnd += 1
    return {"qid": str(rec["qid"]), "rounds": rnd, "counts": counts, "differences": diffs,
            "retokenised": retokenised}


def replay(oracle, trace: list[dict], progress: bool = True) -> dict:
    """Replay every traced question; totals per decision, and per question its differences."""
    from tqdm.auto import tqdm

    qs = [replay_question(oracle, rec) for rec in tqdm(trace, desc="replay", unit="q", disable=not progress)]
    totals = {d: [sum(q["counts"][d][0] for q in qs), sum(q["counts"][d][1] for q in qs)] for d in REPLAY_DECISIONS}
    eq = sum(e for d, (e, _) in totals.items() if d != "text")
    n = sum(c for d, (_, c) in totals.items() if d != "text")
    return {"questions": len(qs), "rounds": sum(q["rounds"] for q in qs),
            "decision_agreement": eq / n if n else None,
            "per_decision": {d: {"equal": e, "compared": c, "rate": e / c if c else None}
                             for d, (e, c) in totals.items()},
            "retokenised": sum(q["retokenised"] for q in qs), "per_question": qs}
