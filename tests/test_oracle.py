"""The per-question DRAGIN oracle: its pure decision rules on hand-built inputs, and one real question.

Expected values in the hand-built cases are computed by hand in the comments (docs/dragin-reference.md).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from fastrag.oracle import decisions as D

DATA = Path(os.environ.get("FASTRAG_DATA", "/work/shared/data"))
CORPUS = DATA / "corpus" / "wiki_passages.jsonl"
HOTPOT = DATA / "hotpotqa" / "dev_distractor_200.jsonl"


# ---------------------------------------------------------------------------------------------- RIND


def test_token_attention_max_over_later_rows_mean_over_heads():
    nan = float("nan")
    # attn[h, j, t]; entries above the diagonal (j < t) must be ignored, so poison them.
    attn = torch.tensor([
        [[1.0, nan, nan],
         [0.5, 0.5, nan],
         [0.2, 0.3, 0.5]],
        [[1.0, 9.0, 9.0],
         [0.9, 0.1, 9.0],
         [0.6, 0.2, 0.2]],
    ])
    # head 0: max_{j>=t} -> [1.0, 0.5, 0.5]; head 1: [1.0, 0.2, 0.2]; mean -> [1.0, 0.35, 0.35]
    a = D.token_attention(attn)
    assert a.dtype == torch.float64
    torch.testing.assert_close(a, torch.tensor([1.0, 0.35, 0.35], dtype=torch.float64))


def test_token_entropy_natural_log_and_masked_logits():
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, float("-inf"), float("-inf"), float("-inf")]])
    h = D.token_entropy(scores)
    torch.testing.assert_close(h, torch.tensor([math.log(4.0), 0.0], dtype=torch.float64))


def test_rind_trigger_first_sentence_with_a_hit():
    # words:       0    1  |  2    3    4  ; sentence 2 (index 2) has no words
    aw = [1.0, 1.0, 2.0, 1.0, 1.0]
    hw = [1.2, 0.1, 1.0, 0.3, 3.0]
    ranges = [(0, 2), (2, 5), (5, 5)]
    # sentence 0: score = a/sum(a) * H * n = 0.5*1.2*2 = 1.2 (NOT > 1.2: strict) and 0.5*0.1*2 = 0.1 -> no hit
    # sentence 1: sum a = 4 -> 2/4*1.0*3 = 1.5 hit, 1/4*0.3*3 = 0.225, 1/4*3.0*3 = 2.25 hit
    trig = D.rind_trigger(aw, hw, ranges, threshold=1.2)
    assert trig is not None
    assert trig.sentence == 1 and trig.words == (2, 5)
    assert trig.raw_hits == [True, False, True]
    # a higher threshold leaves only the 2.25 word; above every score: no trigger
    assert D.rind_trigger(aw, hw, ranges, threshold=2.0).raw_hits == [False, False, True]
    assert D.rind_trigger(aw, hw, ranges, threshold=2.3) is None


def test_rind_from_tokens_word_sum_and_mean():
    # 4 tokens -> words [0, 2) and [2, 4), one sentence. a_t from a 1-head attention; H_t given.
    attn = torch.tensor([[[1.0, 0.0, 0.0, 0.0],
                          [0.5, 0.5, 0.0, 0.0],
                          [0.1, 0.1, 0.8, 0.0],
                          [0.1, 0.1, 0.1, 0.7]]])
    a = D.token_attention(attn)  # [1.0, 0.5, 0.8, 0.7]
    h = torch.tensor([0.2, 0.4, 2.0, 4.0], dtype=torch.float64)
    aw, hw = D.word_values(a, h, [(0, 2), (2, 4)])
    assert aw == pytest.approx([1.5, 1.5]) and hw == pytest.approx([0.3, 3.0])
    # scores: 1.5/3*0.3*2 = 0.3, 1.5/3*3.0*2 = 3.0 -> only the second word hits at 1.2
    trig = D.rind_trigger(aw, hw, [(0, 2)], 1.2)
    assert trig.raw_hits == [False, True]


def test_real_word_filter_clears_hits_but_keeps_the_trigger():
    words = ["Paris,", "is", "the", "capital"]
    real = {"Paris", "capital"}
    hits = D.clear_unreal_hits(words, [True, True, False, False], lambda w: any(r in w for r in real))
    assert hits == [True, False, False, False]  # "Paris," matches "Paris" by substring; "is" is cleared
    assert D.clear_unreal_hits(words, [False, True, True, False], lambda w: any(r in w for r in real)) == [False] * 4


# ---------------------------------------------------------------------------------------------- QFS

# 6 one-token words; the last two (4, 5) are the trigger sentence's words, both hit.
M = torch.tensor([
    [1.00, 0.00, 0.00, 0.00, 0.00, 0.00],
    [0.50, 0.50, 0.00, 0.00, 0.00, 0.00],
    [0.30, 0.30, 0.40, 0.00, 0.00, 0.00],
    [0.25, 0.25, 0.25, 0.25, 0.00, 0.00],
    [0.60, 0.30, 0.00, 0.05, 0.05, 0.00],
    [0.00, 0.10, 0.45, 0.10, 0.20, 0.15],
])
SPANS = [(i, i + 1) for i in range(6)]


def test_qfs_skip_first_renormalisation_changes_the_choice():
    cand = [False, True, True, True, False, False]
    words = ["w0", "w1", "w2", "w3", "w4", "w5"]
    # skip_first: row4 / 0.40 = [1.5, .75, 0, .125, .125, 0]; row5 / 1.0. fwd[1] = (.75+.10)/2 = .425,
    # fwd[2] = (0+.45)/2 = .225, fwd[3] = (.125+.10)/2 = .1125 -> best is w1
    rows = D.qfs_word_rows(M, SPANS, skip_first=True)
    scores = D.qfs_scores(rows, SPANS, hit_words=[4, 5])
    assert scores[1:4] == pytest.approx([0.425, 0.225, 0.1125])
    assert D.select_query_words(words, cand, scores, k=1) == ["w1"]
    assert D.select_query_words(words, cand, scores, k=2) == ["w1", "w2"]
    # no skip: both rows sum to 1 -> fwd[1] = .2, fwd[2] = .225, fwd[3] = .075 -> best is w2
    rows = D.qfs_word_rows(M, SPANS, skip_first=False)
    scores = D.qfs_scores(rows, SPANS, hit_words=[4, 5])
    assert scores[1:4] == pytest.approx([0.2, 0.225, 0.075])
    assert D.select_query_words(words, cand, scores, k=1) == ["w2"]
    # top-2 comes back in text order, not score order
    assert D.select_query_words(words, cand, scores, k=2) == ["w1", "w2"]


def test_qfs_multi_token_words_row_mean_and_column_sum():
    # words: [0, 2) and [2, 4); hit word = 1. Its row: mean of M rows 2, 3 = [.275, .275, .325, .125, 0, 0]
    m = M[:4, :4]
    spans = [(0, 2), (2, 4)]
    rows = D.qfs_word_rows(m, spans, skip_first=False)  # that row sums to 1.0
    scores = D.qfs_scores(rows, spans, hit_words=[1])
    assert scores == pytest.approx([0.55, 0.45])


def test_qfs_ties_keep_the_earlier_word():
    words = ["a", "b", "c", "d"]
    assert D.select_query_words(words, [True] * 4, [0.1, 0.3, 0.3, 0.3], k=2) == ["b", "c"]


def test_qfs_nan_fallback_first_k_candidates_in_text_order():
    # Every hit was cleared by the POS filter: no hit word, the published weights are 0/0 = NaN and the query
    # becomes the first K real words in text order, whatever the attention says.
    words = ["Who", "founded", "the", "Acme", "company", "in", "1990", "?"]
    real = {"founded", "Acme", "company", "1990"}
    hits = D.clear_unreal_hits(["in", "?"], [True, True], lambda w: any(r in w for r in real))
    assert not any(hits)
    assert D.qfs_scores(torch.rand(8, 8), [(i, i + 1) for i in range(8)], hit_words=[]) is None
    cand = [any(r in w for r in real) for w in words]
    assert D.select_query_words(words, cand, None, k=3) == ["founded", "Acme", "company"]
    assert D.select_query_words(words, cand, None, k=35) == ["founded", "Acme", "company", "1990"]


def test_join_drops_empty_parts():
    from fastrag.oracle.dragin import join

    assert join("Question: q\nAnswer:", "", "kept") == "Question: q\nAnswer: kept"
    assert join("", "") == ""


# ---------------------------------------------------------------------------------------------- real run


def test_an_empty_question_is_refused_as_the_engine_refuses_it():
    """The engine's DRAGIN policy ends a blank question with "empty question"; the oracle decoded one from the bare
    few-shot prompt, so `fastrag parity` counted every blank question of a data file as a disagreement."""
    from fastrag.config import dragin_config
    from fastrag.oracle.dragin import DraginOracle

    oracle = DraginOracle.__new__(DraginOracle)  # (no model: nothing may be generated)
    oracle.config = dragin_config("nq")
    oracle.generate = lambda *a, **k: pytest.fail("the oracle generated for an empty question")
    for q in ("", "   \n"):
        with pytest.raises(ValueError, match="^empty question$"):
            oracle.run("q", q, ["x"])


@pytest.mark.parametrize("which", ["dragin", "dragin-attention", "flare", "baselines", "beamsearchqa"])
def test_the_oracles_refuse_a_prompt_past_the_model_context_as_the_engine_does(which):
    """transformers runs past max_position_embeddings with at most a warning; the engine refuses such a prompt, so
    the oracle wrote an answer for a question the engine failed (a parity report leaves it out, but the oracle's
    results.jsonl held the answer). The check comes before the model is used."""
    from types import SimpleNamespace

    from fastrag.oracle.baselines import BaselineOracle
    from fastrag.oracle.beamsearchqa import BeamSearchQAOracle
    from fastrag.oracle.dragin import DraginOracle
    from fastrag.oracle.flare import FlareOracle

    calls = []

    class Model:
        config = SimpleNamespace(max_position_embeddings=32)
        device = torch.device("cpu")

        def generate(self, input_ids, **kw):
            calls.append(input_ids.shape[1])
            raise _Reached

        def __call__(self, input_ids, **kw):
            calls.append(input_ids.shape[1])
            raise _Reached

    class _Reached(Exception):
        pass

    cls = {"dragin": DraginOracle, "dragin-attention": DraginOracle, "flare": FlareOracle,
           "baselines": BaselineOracle, "beamsearchqa": BeamSearchQAOracle}[which]
    oracle = cls.__new__(cls)  # (only what the generation reads)
    oracle.model = Model()
    oracle.tokenizer = SimpleNamespace(encode=lambda text: list(range(1, len(text.split()) + 1)))
    oracle._pad_id = oracle._pad = 0
    oracle.eos_ids = {0}
    oracle._prefill = 0
    if which == "dragin-attention":
        call = lambda n, new: oracle.last_layer_attention(list(range(n)))  # noqa: E731
    else:
        call = lambda n, new: oracle.generate(" ".join(["w"] * n), new)  # noqa: E731
    limit_new = 0 if which == "dragin-attention" else 8
    with pytest.raises(ValueError, match=rf"prompt of {33 - limit_new} tokens \+ {limit_new} new exceeds the model "
                                         "context of 32 tokens"):
        call(33 - limit_new, limit_new)
    assert calls == []
    with pytest.raises(_Reached):  # at the limit: the model runs
        call(32 - limit_new, limit_new)
    assert calls == [32 - limit_new]


@pytest.mark.parametrize("which", ["dragin", "flare", "baselines", "beamsearchqa"])
@pytest.mark.parametrize("ends_at_eos", [True, False])
def test_the_oracles_count_a_generation_as_the_engine_does(which, ends_at_eos):
    """The engine counts a generation's decoded tokens without a final EOS (fastrag.methods.common counts the ids
    its generation returns), and so does each oracle: the same generation, the same decode_tokens in both records.
    The DRAGIN and FLARE oracles used to count the EOS, one token more for each generation ending there (17 more
    than the engine on own-14 of benchmarks/data/questions_outside_shared.jsonl, DRAGIN), and the FLARE oracle's
    records said llm_calls 0."""
    from types import SimpleNamespace

    from fastrag.oracle.baselines import BaselineOracle
    from fastrag.oracle.beamsearchqa import BeamSearchQAOracle
    from fastrag.oracle.dragin import DraginOracle
    from fastrag.oracle.flare import FlareOracle

    eos, prompt_ids = 0, [5, 6, 7]
    body = [int(t) for t in torch.randint(1, 50, (int(torch.randint(1, 9, ())),))]
    new = body + [eos] if ends_at_eos else body

    class Model:
        config = SimpleNamespace(max_position_embeddings=4096)
        device = torch.device("cpu")

        def generate(self, input_ids, max_new_tokens, **kw):
            assert len(new) <= max_new_tokens
            seq = torch.tensor([prompt_ids + new])
            if not kw.get("return_dict_in_generate"):
                return seq
            return SimpleNamespace(sequences=seq, scores=tuple(torch.randn(1, 50) for _ in new))

    cls = {"dragin": DraginOracle, "flare": FlareOracle, "baselines": BaselineOracle,
           "beamsearchqa": BeamSearchQAOracle}[which]
    oracle = cls.__new__(cls)  # (only what the generation reads)
    oracle.model = Model()
    oracle.tokenizer = SimpleNamespace(encode=lambda text: list(prompt_ids),
                                       decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    oracle._pad_id = oracle._pad = eos
    oracle.eos_ids = {eos}
    oracle._prefill = oracle._decode = oracle._calls = 0
    oracle.calls = oracle.prefill = oracle.decode = 0
    out = oracle.generate("a prompt", 16)
    counted = (oracle.decode, oracle.calls) if which == "beamsearchqa" else (oracle._decode, oracle._calls)
    assert counted == (len(body), 1), (which, new)  # (and the call counted: the record's llm_calls)
    if which == "dragin":
        assert out.ids == body and len(out.entropy) == len(body)
    elif which in ("flare", "baselines"):
        assert out[0] == body and len(out[1]) == len(body)


def test_the_oracles_end_a_generation_at_the_engines_eos_ids():
    """The engine ends a generation at the EOS ids of the tokenizer, the model's config and its generation config
    (fastrag.engine, fastrag.model.llama): every oracle reads the same three, each an id, a list or missing."""
    from types import SimpleNamespace

    from fastrag.oracle.context import eos_ids

    def model(config_eos, generation_eos):
        return SimpleNamespace(config=SimpleNamespace(eos_token_id=config_eos),
                               generation_config=SimpleNamespace(eos_token_id=generation_eos))

    assert eos_ids(SimpleNamespace(eos_token_id=2), model(7, [8, 9])) == {2, 7, 8, 9}
    assert eos_ids(SimpleNamespace(eos_token_id=None), model([7], None)) == {7}
    assert eos_ids(SimpleNamespace(eos_token_id=None), model(None, 8)) == {8}
    with pytest.raises(ValueError, match="name no EOS token"):
        eos_ids(SimpleNamespace(eos_token_id=None), model(None, None))


def _hotpot_questions(n: int):
    with HOTPOT.open() as f:
        for _, line in zip(range(n), f):
            rec = json.loads(line)
            yield rec["question_id"], rec["question_text"], rec["answers_objects"][0]["spans"]


@pytest.mark.slow  # minutes on a shared 2-core machine (5 min measured under load 4)
@pytest.mark.skipif(not (CORPUS.exists() and HOTPOT.exists()), reason="shared data not available")
def test_real_question_structural_invariants():
    """Real SmolLM2, BM25 and HotpotQA questions, in file order until one has retrieved (at most 6): every run's
    rounds are consistent. A model may well end its first generation at once (the run's text is then empty and the
    answer comes from the forced "So the answer is" step): no question is assumed to retrieve."""
    from fastrag.config import DraginConfig
    from fastrag.model.loading import load_hf_model, load_tokenizer
    from fastrag.oracle import DraginOracle
    from fastrag.retrieval.bm25 import BM25Retriever

    torch.manual_seed(0)
    tok = load_tokenizer("smollm2")
    model = load_hf_model("smollm2")
    retriever = BM25Retriever(CORPUS)
    cfg = DraginConfig(dataset="hotpotqa", generate_max_length=24, hallucination_threshold=1.2,
                       retrieve_keep_top_k=35, retrieve_topk=3, fewshot=2)
    oracle = DraginOracle(model, tok, retriever, cfg)

    # Record every generation so trigger sentences can be checked against what the model really produced.
    generated: list[str] = []
    with_scores: list[bool] = []
    real_generate = oracle.generate

    def spy(prompt, n, **kw):
        g = real_generate(prompt, n, **kw)
        generated.append(g.text)
        with_scores.append(kw.get("scores", True))
        return g

    oracle.generate = spy
    ids = {json.loads(line)["id"] for line in CORPUS.open()}
    retrieved = 0
    for qid, question, gold in _hotpot_questions(6):
        generated.clear()
        with_scores.clear()
        t0 = time.perf_counter()
        res = oracle.run(qid, question, gold)
        print(f"\noracle {qid}: {time.perf_counter() - t0:.1f}s, {len(res.rounds)} rounds, "
              f"{res.retrievals} retrievals")
        assert res.error is None and res.qid == qid and res.rounds
        assert isinstance(res.text, str) and isinstance(res.prediction, str) and res.prediction.strip()
        assert res.prefill_tokens > 0 and res.decode_tokens > 0 and res.wall_s > 0
        assert 0 <= res.counters["answer_generation_s"] < res.wall_s
        assert res.retrievals == sum(r.query is not None for r in res.rounds)
        # every generate call counted (plain rounds, retrieval rounds, the evaluator's answer generation)
        assert res.llm_calls == len(generated) >= len(res.rounds) + res.retrievals
        # scores (entropies) only where RIND reads them, as the published code: one plain generation per round
        assert sum(with_scores) == len(res.rounds), with_scores
        for r in res.rounds:
            if r.query is None:
                assert r.trigger_sentence is None and not r.doc_ids and not r.hit_words
                continue
            assert r.trigger_sentence and any(r.trigger_sentence in g for g in generated)
            assert r.query.strip() and len(tok.encode(r.query)) <= 64
            assert len(r.doc_ids) == cfg.retrieve_topk and set(r.doc_ids) <= ids
            assert all(w in r.trigger_sentence for w in r.hit_words)
        retrieved += res.retrievals
        if retrieved:
            break
    assert retrieved, "none of the first 6 HotpotQA questions retrieved at threshold 1.2"


# ---------------------------------------------------------------------------------------------- tuned recipe


def test_tuned_oracle_reads_the_same_last_layer_attention_as_eager():
    """The tuned per-question oracle (SDPA; bf16 on a GPU) has no `output_attentions`: it recomputes the last
    layer's probabilities from its input hidden state. They equal eager attention's on the real SmolLM2 (fp32 on the
    CPU), and on a random Qwen2-style model (q/k/v bias, GQA 4/2), and the RIND decision on a real generation is the
    same through both oracles."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrag.config import DraginConfig
    from fastrag.eval import BUNDLED
    from fastrag.model.loading import load_tokenizer
    from fastrag.oracle import DraginOracle
    from fastrag.oracle.dragin import last_layer_probs
    from fastrag.parity import oracle_model
    from fastrag.retrieval.bm25 import BM25Retriever

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    for impl in ("eager", "sdpa"):
        cfg._attn_implementation = impl
    eager = Qwen2ForCausalLM(cfg).eval()
    cfg2 = Qwen2Config(**{k: v for k, v in cfg.to_dict().items() if k in ("vocab_size", "hidden_size",
                          "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")})
    sdpa = Qwen2ForCausalLM._from_config(cfg2, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    eager.config._attn_implementation = "eager"
    x = torch.randint(0, 120, (1, 19))
    with torch.no_grad():
        a = eager(input_ids=x, output_attentions=True).attentions[-1][0]
        b = last_layer_probs(sdpa, sdpa(input_ids=x, output_hidden_states=True).hidden_states[-2])
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)

    tok = load_tokenizer("smollm2")
    retriever = BM25Retriever(BUNDLED / "wiki_passages.jsonl")
    dcfg = DraginConfig(dataset="hotpotqa", generate_max_length=24, hallucination_threshold=0.5,
                        retrieve_keep_top_k=35, retrieve_topk=3, fewshot=1)
    published = DraginOracle(oracle_model("smollm2", "published"), tok, retriever, dcfg)
    tuned = DraginOracle(oracle_model("smollm2", "tuned"), tok, retriever, dcfg)
    assert tuned.model.config._attn_implementation == "sdpa"
    prompt = ("Question: Which country is the birthplace of the author of Dracula?\n"
              "Answer: Dracula was written by Bram Stoker, who was born in")
    gen = published.generate(prompt, 24)
    assert gen.ids, "the model generated nothing"
    torch.testing.assert_close(tuned.last_layer_attention(gen.ids), published.last_layer_attention(gen.ids),
                               atol=1e-5, rtol=1e-4)
    assert tuned.rind(gen) == published.rind(gen)


@pytest.mark.parametrize("method", ["wo-rag", "sr-rag", "fl-rag", "fs-rag", "token-rag"])
def test_the_baseline_oracle_refuses_an_empty_question_as_the_engine_does(method):
    from fastrag.config import method_config
    from fastrag.oracle.baselines import BaselineOracle

    oracle = BaselineOracle.__new__(BaselineOracle)  # (no model: nothing may be generated or searched)
    oracle.config, oracle.method = method_config(method, "nq", None), method
    oracle.generate = lambda *a, **k: pytest.fail("the oracle generated for an empty question")
    oracle.retrieve = lambda *a, **k: pytest.fail("the oracle searched for an empty question")
    for q in ("", "   \n"):
        with pytest.raises(ValueError, match="^empty question$"):
            oracle.run("q", q, ["x"])
    with pytest.raises(ValueError, match="no baseline oracle for method 'flare'"):
        BaselineOracle(None, None, None, oracle.config, "flare")


def test_token_rag_oracle_gives_each_token_the_sentence_the_engine_gives_it():
    """token-rag judges a sentence by the probabilities of its tokens: the oracle's reading of which sentence a
    token is in (the last one that starts before the token's text ends) equals the engine policy's `token_spans`,
    on random tokens and sentence starts, among them starts exactly at a token's end (the boundary: that token is
    the earlier sentence's) and whitespace tokens between sentences."""
    import random
    from types import SimpleNamespace

    from fastrag.methods.common import token_char_ends
    from fastrag.methods.token_rag import token_spans
    from fastrag.oracle.baselines import BaselineOracle
    from fastrag.text.sentences import Sentence

    pieces = ["The", " cat", ".", " ", "\n", " It", " sat", "!", "x", " 1990", ")."]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(pieces[i] for i in ids))
    oracle = SimpleNamespace(text=lambda ids: tok.decode(ids))
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    boundary = 0
    for _ in range(300):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 14))]
        ends = token_char_ends(tok, ids)
        starts = sorted(set([0] + rng.sample(range(ends[-1] + 1), min(ends[-1] + 1, rng.randrange(0, 4)))
                            + rng.sample(ends, rng.randrange(0, min(3, len(ends)) + 1))))
        sents = [Sentence(text="s", start=a, end=a + 1) for a in starts]
        boundary += any(a in ends for a in starts[1:])
        owner = BaselineOracle.token_sentences(oracle, ids, sents)
        spans = token_spans(ends, sents)
        assert [si for si, (l, r) in enumerate(spans) for _ in range(l, r)] == owner, (ids, starts)
    assert boundary > 50  # (the boundary case came up often)


def test_query_truncation_counts_the_query_tokens_only_under_a_bos_adding_tokenizer():
    """A Llama-style tokenizer adds BOS to every encode: the published retriever cuts queries with
    add_special_tokens=False and decodes with skip_special_tokens=True, so a query of exactly max tokens stays whole
    and no '<s>'-like text enters a query (the engine's rule and the oracle's agree)."""
    from types import SimpleNamespace

    from tokenizers.processors import TemplateProcessing

    from fastrag.methods.common import truncate_query
    from fastrag.oracle.dragin import DraginOracle

    try:
        from fastrag.model.loading import load_tokenizer

        tok = load_tokenizer("smollm2")
    except (FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(f"embedded tokenizer not available: {e}")
    bos = tok.convert_ids_to_tokens(1)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    query = "Arthur's Magazine first published"
    own = tok.encode(query, add_special_tokens=False)
    assert tok.encode(query)[0] == 1 and tok.encode(query)[1:] == own  # the tokenizer adds BOS
    n = len(own)
    oracle = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(max_query_tokens=n))
    assert truncate_query(tok, query, n) == query
    assert DraginOracle.truncate_query(oracle, query) == query
    oracle.config.max_query_tokens = n + 5  # a short query is the query, not '<BOS> query'
    assert DraginOracle.truncate_query(oracle, query) == query == truncate_query(tok, query, n + 5)
    cut = tok.decode(own[-(n - 1):]).strip()
    oracle.config.max_query_tokens = n - 1
    assert truncate_query(tok, query, n - 1) == cut == DraginOracle.truncate_query(oracle, query)
    assert bos not in cut


def test_tuned_recipe_runs_sdpa_without_cudnn(monkeypatch):
    """The tuned recipe's SDPA calls may use the engine's backends (every one but cuDNN by default, or what
    $FASTRAG_SDPA names); the published recipe (eager attention) changes nothing; the settings come back after."""
    from fastrag.model import llama
    from fastrag.parity import _recipe_sdpa

    b = torch.backends.cuda
    flags = lambda: (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),  # noqa: E731
                     b.math_sdp_enabled())
    before = flags()
    monkeypatch.delenv(llama.SDPA_ENV, raising=False)
    with _recipe_sdpa("tuned"):
        assert flags() == (True, True, False, True)
    with _recipe_sdpa("published"):
        assert flags() == before
    monkeypatch.setenv(llama.SDPA_ENV, "math")
    with _recipe_sdpa("tuned"):
        assert flags() == (False, False, False, True)
    assert flags() == before


def test_parity_leaves_out_questions_that_failed_on_either_side():
    """Two identical errors are no evidence of agreement: a question that failed on either side is left out of n and
    the rates and listed with both errors; the answered ones are compared as before."""
    from fastrag.parity import compare
    from fastrag.trace import QuestionResult, Round

    def rec(qid, query="q", error=None):
        return QuestionResult(qid=qid, question=f"question {qid}", gold=["x"], error=error,
                              rounds=[] if error else [Round(trigger_sentence="t", query=query)],
                              metrics={"answer": "a"})

    boom = "RuntimeError: boom"
    engine = [rec("1"), rec("2", error=boom), rec("3", error=boom), rec("4", query="other"), rec("5")]
    oracle = [rec("1"), rec("2", error=boom), rec("3"), rec("4"), rec("5", error="ValueError: x")]
    rep = compare(engine, oracle)
    assert rep["n"] == 2 and rep["agreement"] == 0.5 and rep["n_errored"] == 3
    assert [(e["qid"], e["engine_error"], e["oracle_error"]) for e in rep["errored"]] == [
        ("2", boom, boom), ("3", boom, None), ("5", None, "ValueError: x")]
    assert [d["qid"] for d in rep["disagreements"]] == ["4"]
    assert compare([rec("2", error=boom)], [rec("2", error=boom)])["agreement"] is None  # nothing answered
