"""BeamSearchQA through the scheduler and the engine vs the per-question oracle (transformers `generate`):
a tiny random-initialised Llama whose outputs are noise (every parser sees malformed text), and one short run of the
real SmolLM2 through `fastrag parity`."""

from __future__ import annotations

import json

import pytest
import torch

from beamsearchqa_fakes import ListRetriever
from fastrag.data.datasets import Example
from fastrag.engine import Engine
from fastrag.loop import QuestionLoop
from fastrag.methods.beamsearchqa import BeamSearchQA, beamsearchqa_config, decisions
from fastrag.model.llama import LlamaModel
from fastrag.oracle.beamsearchqa import BeamSearchQAOracle
from fastrag.retrieval.base import Doc

EOS = 3


class CharTok:
    """One token per ASCII character (others -> '?'); EOS is the control character 3."""

    eos_token_id = EOS

    def encode(self, text):
        return [ord(c) if ord(c) < 128 else 63 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=EOS,
                      bos_token_id=1, pad_token_id=EOS)
    hf = LlamaForCausalLM(cfg)
    for p in hf.parameters():  # large weights: top-2 logit gaps far above float noise, so greedy paths are stable
        torch.nn.init.normal_(p, std=0.3)
    hf.eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, LlamaModel.from_pretrained(path)


QUESTIONS = [Example(str(i), q, ["x"], "nq") for i, q in enumerate([
    "who wrote the song hey jude", "when did the berlin wall fall", "what is the capital of australia"])]


def short_config():
    """The paper's K, D, N, S, B with short generations (a tiny model's noise needs no more)."""
    return beamsearchqa_config("nq", overrides={"answer_max_tokens": 8, "ask_max_tokens": 24,
                                                "summary_max_tokens": 12, "score_max_tokens": 4})


def test_engine_and_oracle_take_the_same_path_on_noise(tiny):
    hf, ours = tiny
    cfg = short_config()
    tok = CharTok()
    eng = Engine(ours, tok, kv_cache_gb=0.05, max_batch=16)
    policy = BeamSearchQA(cfg, tok)
    ret = ListRetriever()
    out = []
    QuestionLoop(eng, ret, policy, max_inflight=3).run(QUESTIONS, out.append)
    by = {r.qid: r for r in out}
    assert len(by) == 3 and all(r.error is None for r in out), [r.error for r in out]
    oracle = BeamSearchQAOracle(hf, tok, ListRetriever(), cfg)
    for ex in QUESTIONS:
        e, o = by[ex.qid], oracle.run(ex.qid, ex.question, ex.answers)
        assert decisions(e) == decisions(o), ex.question
        assert e.beams == o.beams and e.llm_calls == o.llm_calls and e.retrievals == o.retrievals
        assert e.decode_tokens == o.decode_tokens  # same generations, token for token
        assert e.prefill_tokens < o.prefill_tokens  # the engine reused cached prefixes
        assert 0 <= e.chosen.score <= 1 and e.chosen.depth == len(e.beams) - 1
    # the searches of one depth of all questions in flight went out together
    assert max(len(b) for b in ret.batches) > 2
    assert eng.stats["own_hit_tokens"] > 0
    assert not eng.live  # every KV sequence was released


class SameDocs(ListRetriever):
    """The same two documents for every query: every summary prompt of a question is the same text."""

    def search(self, queries, k):
        self.batches.append(list(queries))
        return [[Doc(id=f"d{i}", title="T", text=f"shared text {i}") for i in range(k)] for _ in queries]


def test_repeated_summaries_are_generated_once_and_decide_as_the_oracle(tiny):
    hf, ours = tiny
    cfg = short_config()
    tok = CharTok()
    eng = Engine(ours, tok, kv_cache_gb=0.05, max_batch=16)
    sched = QuestionLoop(eng, SameDocs(), BeamSearchQA(cfg, tok), max_inflight=3)
    out = []
    sched.run(QUESTIONS, out.append)
    by = {r.qid: r for r in out}
    assert all(r.error is None for r in out), [r.error for r in out]
    oracle = BeamSearchQAOracle(hf, tok, SameDocs(), cfg)
    reused = 0
    for ex in QUESTIONS:
        e, o = by[ex.qid], oracle.run(ex.qid, ex.question, ex.answers)
        assert decisions(e) == decisions(o) and e.beams == o.beams, ex.question
        assert e.llm_calls == o.llm_calls  # the algorithm's calls; the engine ran fewer
        n = e.counters.get("reused_generations", 0)
        # every summary after a question's first repeats it: none of them decoded again
        assert n == e.retrievals - 1
        assert e.decode_tokens < o.decode_tokens or n == 0
        reused += n
    assert reused > 0 and sched.reused_generations == reused


def test_smollm2_parity_through_the_cli_entry(tmp_path):
    """The real model: `fastrag parity --method beamsearchqa` on one bundled HotpotQA question, small settings."""
    from fastrag.eval import BUNDLED, RunOptions
    from fastrag.parity import parity

    conf = tmp_path / "bsq.json"
    conf.write_text(json.dumps({"K": 1, "D": 1, "N": 1, "B": 1, "answer_max_tokens": 8, "ask_max_tokens": 20,
                                "summary_max_tokens": 16, "score_max_tokens": 4, "max_doc_chars": 300}))
    opts = RunOptions(method="beamsearchqa", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                      corpus=str(BUNDLED / "wiki_passages.jsonl"), output=str(tmp_path / "p"), config=str(conf),
                      limit=1, batch_size=4, kv_cache_gb=0.25, progress=False)
    rep = parity(opts)
    assert rep["n"] == 1 and set(rep) >= {"answer_agreement", "path_agreement"}
    assert rep["agreement"] == 1.0, rep["disagreements"]
    rec = json.loads((tmp_path / "p" / "engine" / "results.jsonl").read_text().splitlines()[0])
    assert rec["error"] is None and rec["llm_calls"] >= 5 and rec["chosen"] is not None
    assert rec["retrievals"] >= 1 and rec["metrics"]["answer"] == rec["chosen"]["answer"]
