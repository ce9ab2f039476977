"""benchmarks/record_published_etc.py without the published code: the comparison and the report (the run itself
needs a checkout of the published ETC repository and minutes of CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import record_published_etc as rpe  # noqa: E402

from fastrag.data.datasets import Example  # noqa: E402
from fastrag.trace import QuestionResult, Round  # noqa: E402


def test_query_words_drop_punctuation_and_spacing():
    assert rpe.query_words(" government  position  Kiss  Tell ?") == rpe.query_words("government position Kiss Tell?")
    assert rpe.query_words("a b") != rpe.query_words("a c")


def _ex(qid, answer):
    return Example(qid=qid, question=f"question {qid}?", answers=[answer], dataset="hotpotqa")


def test_compare_counts_each_decision():
    exs = [_ex("1", "Paris"), _ex("2", "Bohr"), _ex("3", "yes")]
    pub = [{"checks": [True, False], "searches": [{"query": " Eiffel  Tower ?", "doc_ids": ["a"]}],
            "text": "It is in Paris. So the answer is Paris.", "seconds": 2.0},
           {"checks": [False], "searches": [], "text": "So the answer is Einstein.", "seconds": 1.0},
           {"checks": [True, True], "searches": [{"query": "x y", "doc_ids": ["b"]}, {"query": "z", "doc_ids": []}],
            "text": "So the answer is yes.", "seconds": 3.0}]
    fa = [QuestionResult(qid="1", question="", gold=["Paris"], prediction="So the answer is Paris.",
                         rounds=[Round(query="Eiffel Tower?", doc_ids=["a"]), Round()]),
          QuestionResult(qid="2", question="", gold=["Bohr"], prediction="So the answer is Bohr.", rounds=[Round()]),
          QuestionResult(qid="3", question="", gold=["yes"], prediction="So the answer is no.",
                         rounds=[Round(query="x w", doc_ids=["b"])])]
    c = rpe.compare(pub, fa, exs)
    assert c["questions"] == 3
    assert c["same_first_decision"] == 3
    assert c["same_retrieval_count"] == 2  # question 3: 2 published, 1 fastrag
    assert c["both_retrieved"] == 2
    assert c["same_first_query"] == 0  # spacing and "?" differ on 1, a word on 3
    assert c["same_first_query_words"] == 1
    assert c["same_answer"] == 1  # Paris only
    assert c["published_em"] == pytest.approx(2 / 3) and c["fastrag_em"] == pytest.approx(2 / 3)
    assert c["published_retrievals_per_question"] == pytest.approx(1.0)
    md = rpe.render({**c, "dataset": "hotpotqa", "data": "d.jsonl", "corpus": "c.jsonl", "threads": 1,
                     "config": {"retrieve_topk": 3}, "published_seconds": 6.0, "fastrag_seconds": 1.0,
                     "command": "python benchmarks/record_published_etc.py"})
    assert "| first line retrieves or not | 3/3 |" in md
    assert "| first query's words equal, punctuation aside | 1/2 |" in md
    assert "| 3 | 2 / 1 | yes / yes |" in md


def test_replay_check_runs_fastrags_rule_on_published_inputs():
    import math
    from types import SimpleNamespace as NS

    import torch

    from fastrag.methods.etc import EtcConfig, entropy_trend

    tokens = ["The", "Ġtower", "Ġis", "Ġin", "ĠParis", "."]
    words = ["The", " tower", " is", " in", " Paris."]

    class Tok:
        def convert_tokens_to_string(self, toks):
            return "".join(toks).replace("Ġ", " ")

    h = torch.tensor([0.1, 0.2, 0.3, 0.1, 2.5]).tolist()  # (float32 values, as the published entropies are)
    content = [True, True, False, False, True]
    _, _, m = entropy_trend(h, content)
    blk = NS(text="The tower is in Paris.", tokens=tokens, range_=[[0, 1], [1, 2], [2, 3], [3, 4], [4, 6]])

    def outputs(pub_m):
        return NS(blocks=[blk], entropies=torch.tensor(h), fun_word=[{"val": torch.tensor(float(c))} for c in content],
                  mt_s2=[{"val": torch.tensor(x, dtype=torch.float64)} for x in pub_m],
                  max_atten=torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2]))

    cfg = EtcConfig(dataset="hotpotqa", generate_max_length=100, fewshot=0, hallucination_threshold=1.3)
    assert words == [Tok().convert_tokens_to_string(tokens[l:r]) for l, r in blk.range_]
    # only " Paris." has a non-zero M here (d2 of the third content word), far above 1.3 at mean attention
    assert m[4] > 1.3 and m[:4] == [0.0] * 4
    hit = NS(hallucination=True, curr_st=4)
    r = rpe.replay_check(Tok(), outputs(m), hit, cfg)
    assert r == {"words": 5, "m_max_abs_diff": 0.0, "m_nan_mismatch": 0, "published_trigger": 4, "fastrag_trigger": 4}
    # a published M that differs (and a NaN where fastrag has a number) is reported, the trigger still ours
    pub = list(m)
    pub[4] += 0.5
    pub[1] = math.nan
    r = rpe.replay_check(Tok(), outputs(pub), NS(hallucination=False, curr_st=None), cfg)
    assert r["m_max_abs_diff"] == pytest.approx(0.5) and r["m_nan_mismatch"] == 1
    assert r["published_trigger"] is None and r["fastrag_trigger"] == 4
