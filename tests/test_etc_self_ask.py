"""ETC (fastrag.methods.etc) and Self-Ask (fastrag.methods.self_ask): the entropy-trend rule on hand-made entropy
sequences against a plain computation written here and against the oracle's own, config errors, Self-Ask's
transcript parsing, both policies over the scripted engine of test_methods, and their parity with the per-question
oracles on the real SmolLM2 with BM25 over the bundled corpus."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fastrag.config import ConfigError
from fastrag.eval import BUNDLED
from fastrag.methods.etc import cut_line, entropy_trend, sentence_hits
from fastrag.methods.registry import make_config
from fastrag.methods.self_ask import cut_at_stops, exemplar_text, final_answer, follow_up_question
from fastrag.oracle.etc import trend_by_search

CORPUS = BUNDLED / "wiki_passages.jsonl"
OWN = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "questions_outside_shared.jsonl"


# ---------------------------------------------------------------------------------------------- ETC rule


def plain_trend(h, content):
    """The rule as docs/methods.md states it, computed over the list of content words (an independent reading)."""
    idx = [i for i, c in enumerate(content) if c]
    d1 = {i: 0.0 for i in range(len(h))}
    for a, b in zip(idx, idx[1:]):
        d1[b] = h[b] - h[a]
    nz1 = [i for i in range(len(h)) if d1[i] != 0.0]
    d2 = {i: 0.0 for i in range(len(h))}
    for i in idx:
        before = [j for j in nz1 if j < i]
        if before:
            d2[i] = d1[i] - d1[before[-1]]
    nz2 = [i for i in range(len(h)) if d2[i] != 0.0]
    m = [0.0] * len(h)
    for c, i in enumerate(nz2):
        e = sum(d2[j] for j in nz2[: c + 1]) / (c + 1)
        p = d2[nz2[c - 1]] if c else 0.0
        den = abs(d2[i] - e) + abs(p - e)
        alpha = 0.9 + 0.1 * (abs(p - e) / den) if den else math.nan
        m[i] = alpha * d2[i] + (1 - alpha) * p
    return [d1[i] for i in range(len(h))], [d2[i] for i in range(len(h))], m


def test_entropy_trend_by_hand():
    # content words 0, 2, 3, 4: d1 = [0, 0, 1, -1, 2]; d2 = [0, 0, 0, -2, 3] (word 2's d1 has no earlier non-zero
    # d1); M: the first non-zero d2 is kept (w = 1), then mean 0.5, w = 2.5 / 5, alpha 0.95: 0.95*3 + 0.05*(-2)
    d1, d2, m = entropy_trend([1.0, 0.5, 2.0, 1.0, 3.0], [True, False, True, True, True])
    assert d1 == [0.0, 0.0, 1.0, -1.0, 2.0]
    assert d2 == [0.0, 0.0, 0.0, -2.0, 3.0]
    assert m[:4] == [0.0, 0.0, 0.0, -2.0] and m[4] == pytest.approx(2.75, abs=1e-12)
    # a function word in between changes nothing but the indices; the first content word never has a d1
    _, _, m2 = entropy_trend([5.0, 1.0, 9.0, 2.0, 1.0, 3.0], [False, True, False, True, True, True])
    assert m2[0] == m2[1] == m2[2] == 0.0 and m2[5] == pytest.approx(2.75, abs=1e-12)


def test_entropy_trend_matches_plain_and_oracle_readings():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(0, 14)
        # (a few repeated values make zero differences, which the rule skips)
        h = [rng.choice([0.5, 1.0, rng.uniform(0, 4)]) for _ in range(n)]
        content = [rng.random() < 0.7 for _ in range(n)]
        d1, d2, m = entropy_trend(h, content)
        e1, e2, em = plain_trend(h, content)
        assert d1 == pytest.approx(e1, abs=1e-12) and d2 == pytest.approx(e2, abs=1e-12)
        for a, b, c in zip(m, em, trend_by_search(h, content)):
            assert (math.isnan(a) and math.isnan(b) and math.isnan(c)) or (a == pytest.approx(b, abs=1e-12)
                                                                           and a == pytest.approx(c, abs=1e-12))


def test_equal_trend_makes_nan_which_never_hits():
    # d2 = [.., 1, 1]: at the second, E = 1 = d2 = p, 0/0
    _, d2, m = entropy_trend([0.0, 1.0, 3.0, 6.0], [True] * 4)
    assert d2 == [0.0, 0.0, 1.0, 1.0] and m[2] == 1.0 and math.isnan(m[3])
    assert sentence_hits([1.0, 1.0], [m[3], 5.0], 1.0, False) == [False, True]


def test_sentence_hits_rescale_attention_to_mean_one():
    att, m = [1.0, 3.0], [1.0, 1.0]  # rescaled: 0.5, 1.5
    assert sentence_hits(att, m, 1.0, False) == [False, True]
    assert sentence_hits(att, [-4.0, 0.0], 1.0, False) == [False, False]
    assert sentence_hits(att, [-4.0, 0.0], 1.0, True) == [True, False]


def test_cut_line_keeps_the_first_newline_token():
    class Tok:
        def decode(self, ids):
            return {1: "a", 2: " b", 3: ".\n", 4: "c"}[ids[0]]

    assert cut_line(Tok(), [1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4]) == ([1, 2, 3], [0.1, 0.2, 0.3], True)
    assert cut_line(Tok(), [1, 2], [0.1, 0.2]) == ([1, 2], [0.1, 0.2], False)


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("method, bad, field", [
    ("etc", {"hallucination_threshold": "high"}, "hallucination_threshold"),
    ("etc", {"hallucination_threshold": float("nan")}, "hallucination_threshold"),
    ("etc", {"retrieve_keep_top_k": 0}, "retrieve_keep_top_k"),
    ("etc", {"thres_abs": "yes"}, "thres_abs"),
    ("etc", {"generate_max_length": 0}, "generate_max_length"),
    ("etc", {"treshold": 1.0}, "treshold"),
    ("self-ask", {"max_iter": 0}, "max_iter"),
    ("self-ask", {"fewshot": 5}, "fewshot"),
    ("self-ask", {"retrieve_first": 1}, "retrieve_first"),
    ("self-ask", {"retrieve_topk": 0}, "retrieve_topk"),
])
def test_config_errors_name_the_field(method, bad, field):
    with pytest.raises(ConfigError, match=field):
        make_config(method, "hotpotqa", bad)


def test_defaults():
    c = make_config("etc", "2wikimultihopqa")
    assert (c.hallucination_threshold, c.retrieve_keep_top_k, c.thres_abs, c.generate_max_length, c.fewshot) == \
        (1.3, 35, False, 64, 6)
    s = make_config("self-ask", "hotpotqa")
    assert (s.max_iter, s.fewshot, s.retrieve_first, s.single_hop) == (5, 4, True, False)


# ---------------------------------------------------------------------------------------------- Self-Ask parsing


def test_self_ask_parsing():
    out = "Follow up: Who wrote Dune?\nIntermediate answer: Frank Herbert.\nFollow up: x"
    assert cut_at_stops(out, ("Context:", "#", "Intermediate answer:")) == "Follow up: Who wrote Dune?\n"
    assert cut_at_stops("a # b Context: c", ("Context:", "#")) == "a "
    assert cut_at_stops("no stop", ("#",)) == "no stop"
    assert follow_up_question("x\nFollow up: Who wrote Dune?\nFollow up: Why?") == "Who wrote Dune?"
    assert follow_up_question("Follow up:no space") is None
    assert final_answer("Intermediate answer: 1965.\nSo the final answer is: Frank Herbert \nSo the final answer "
                        "is: no") == "Frank Herbert"
    assert final_answer("So the answer is: x") is None
    demo = exemplar_text(1)
    assert demo.startswith("Question: ") and "\nAre follow up questions needed here: Yes.\nFollow up: " in demo
    assert demo.endswith("So the final answer is: New Delhi\n\n")


def test_self_ask_policy_over_a_scripted_engine():
    from test_methods import Ex, Retriever, ScriptEngine

    from fastrag.loop import QuestionLoop
    from fastrag.methods.registry import get_method
    from fastrag.model.loading import load_tokenizer

    tk = load_tokenizer("smollm2")
    head = "Are follow up questions needed here: Yes.\n"
    script = {
        "": "Follow up: Who founded Acme?\nIntermediate answer: Bob Smith.",
        "Follow up: Who founded Acme?": "\nIntermediate answer: Bob Smith.\nFollow up: When was Bob Smith born?",
        "Follow up: Who founded Acme?\nIntermediate answer: Bob Smith.":
            "\nFollow up: When was Bob Smith born?\nIntermediate answer: 1950.",
        "Follow up: Who founded Acme?\nIntermediate answer: Bob Smith.\nFollow up: When was Bob Smith born?":
            "\nIntermediate answer: 1950.\nSo the final answer is: 1950\n\nQuestion: # more",
    }

    def world(prompt):
        return [(script[prompt[prompt.rindex(head) + len(head):]], 0.9, 0.1), None]

    cfg = make_config("self-ask", "hotpotqa", {"generate_max_length": 64})
    eng, ret, out = ScriptEngine(tk, world), Retriever(), []
    QuestionLoop(eng, ret, get_method("self-ask").make_policy(cfg, tk), max_inflight=2).run(
        [Ex("1", "When was the founder of Acme born?", ["1950"])], out.append)
    r = out[0]
    assert r.error is None, r.error
    assert ret.queries == ["When was the founder of Acme born?", "Who founded Acme?", "When was Bob Smith born?"]
    assert [x.trigger_sentence for x in r.rounds] == [None, "Follow up: Who founded Acme?",
                                                      "Follow up: When was Bob Smith born?"]
    # the answer phase sees the follow-up's documents; the final line ends the question
    assert "Context1: doc 0 about Who founded Acme?\n" in eng.prompts[1][0]
    assert len(eng.prompts) == 4 and r.prediction == "So the answer is 1950"
    assert r.text.endswith("So the final answer is: 1950\n\nQuestion: ")


# ---------------------------------------------------------------------------------------------- real model


def _parity(tmp_path, method, config, data, dataset, limit):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps(config))
    out = tmp_path / "p"
    p = subprocess.run([sys.executable, "-m", "fastrag", "parity", "--method", method, "--dataset", dataset, "--data",
                        str(data), "--corpus", str(CORPUS), "--config", str(cfg), "--limit", str(limit),
                        "--batch-size", str(limit), "--kv-cache-gb", "0.25", "--output", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "parity.json").read_text())
    assert rep["n_errored"] == 0 and rep["agreement"] == 1.0, rep
    return [json.loads(x) for x in (out / "engine" / "results.jsonl").read_text().splitlines()]


def test_self_ask_parity_with_the_real_model(tmp_path):
    """The quick real check: one of the project's own questions, two generations."""
    recs = _parity(tmp_path, "self-ask", {"max_iter": 2, "generate_max_length": 24, "fewshot": 2}, OWN, "hotpotqa", 1)
    assert recs[0]["retrievals"] >= 1


@pytest.mark.slow
def test_self_ask_parity_on_hotpotqa(tmp_path):
    recs = _parity(tmp_path, "self-ask", {}, BUNDLED / "hotpotqa_dev20.jsonl", "hotpotqa", 2)
    assert max(r["retrievals"] for r in recs) >= 2  # a follow-up question was searched


@pytest.mark.slow
def test_etc_parity_on_hotpotqa(tmp_path):
    """ETC's engine policy and its oracle on two bundled HotpotQA questions (8 exemplars, the default threshold)."""
    _parity(tmp_path, "etc", {}, BUNDLED / "hotpotqa_dev20.jsonl", "hotpotqa", 2)


def test_etc_policy_over_a_scripted_engine():
    """Uniform attention (the scripted engine's pass) makes a_w = 1 for every word, so the trigger is M alone: content
    words Paris 0.5, capital 1.0, city 1.0, France. 3.5 give d1 = 0.5, 0, 2.5 and d2 = -0.5 (city), 2.0 (France.,
    against capital's d1); M(France.) = 0.95 * 2.0 + 0.05 * (-0.5) = 1.875 > 1.3. The text keeps the words before
    it; the query is the real words of the question and of those words, in text order (equal attention)."""
    from test_methods import Ex, Retriever, ScriptEngine, continuation

    from fastrag.loop import QuestionLoop
    from fastrag.methods.registry import get_method
    from fastrag.model.loading import load_tokenizer

    tk = load_tokenizer("smollm2")
    pieces = [(" Paris", 0.9, 0.5), (" is a", 0.9, 0.1), (" capital", 0.9, 1.0), (" city", 0.9, 1.0), (" in", 0.9, 0.1),
              (" France", 0.9, 3.5), (".", 0.9, 0.1), ("\n", 0.9, 0.1), ("Question: next", 0.9, 0.1), None]

    def world(p):
        return [(" France", 0.9, 0.1), None] if p.endswith(" So the answer is ") else continuation(p, pieces)

    cfg = make_config("etc", "2wikimultihopqa", {"fewshot": 0})
    eng, ret, out = ScriptEngine(tk, world), Retriever(), []
    QuestionLoop(eng, ret, get_method("etc").make_policy(cfg, tk), max_inflight=2).run(
        [Ex("1", "Where is Paris?", ["France"])], out.append)
    r = out[0]
    assert r.error is None, r.error
    assert [x.trigger_sentence for x in r.rounds] == ["Paris is a capital city in France."]
    assert r.rounds[0].hit_words == ["France."]
    assert ret.queries == ["Paris? Paris capital city"]
    assert r.text == "Paris is a capital city in France."
    assert r.prediction == "Paris is a capital city in France. So the answer is France"
    # the retrieval prompt continues the text kept before the trigger word
    assert any(p.startswith("Context:\n[1] doc 0 about Paris? Paris capital city\n") and
               p.endswith("Answer: Paris is a capital city in") for p, _ in eng.prompts)
