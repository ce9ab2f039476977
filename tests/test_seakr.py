"""SeaKR-style retrieval (fastrag/methods/seakr.py): the engine features it stands on (a generation's own sampling
beside greedy rows, stop tokens, a layer's hidden state kept by a prefill), the eigen score, the config, and the
policy against its per-question oracle with the real model."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))

import engine_fuzz as F  # noqa: E402
from test_etc_self_ask import _parity  # noqa: E402  (the real-model parity run of the new methods)

from fastrag.config import ConfigError  # noqa: E402
from fastrag.engine import Engine, SamplingParams  # noqa: E402
from fastrag.eval import BUNDLED  # noqa: E402
from fastrag.methods.registry import make_config  # noqa: E402
from fastrag.methods.seakr import answer_of, eigen_score  # noqa: E402

OWN = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "questions_outside_shared.jsonl"
EOS = 95


def _engine(**kw) -> Engine:
    _, m, _ = F.models()
    return Engine(m, F.IdTok(96, EOS), block_size=4, kv_cache_gb=0.02, max_batch=8, cuda_graphs=False, **kw)


def _run(e: Engine, jobs) -> list:
    seqs = []
    for prompt, n, kw in jobs:
        s = e.new_sequence()
        e.start(s, prompt, n, **kw)
        seqs.append(s)
    for _ in range(500):
        if not e.has_work:
            break
        e.step()
    return [s.out for s in seqs]


def _prompt(rng, n):
    return [rng.randrange(0, EOS) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("seed", range(3))
def test_own_sampling_rows_draw_as_they_would_alone(seed):
    """Greedy rows and rows of two sampling settings in one batch: each row's tokens are those of an engine whose
    only setting is that row's, with the same sample key."""
    rng = random.Random(seed)
    a = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    b = SamplingParams(temperature=0.7, top_p=1.0, seed=3)
    jobs = [(_prompt(rng, rng.randint(3, 12)), 10, kw) for kw in
            ({}, dict(sampling=a, sample_key=11), dict(sampling=b, sample_key=12), dict(sampling=a, sample_key=13),
             {})]
    mixed = _run(_engine(), jobs)
    for (prompt, n, kw), got in zip(jobs, mixed):
        sp = kw.get("sampling")
        alone = _run(_engine(sampling=sp), [(prompt, n, {"sample_key": kw["sample_key"]} if sp else {})])[0]
        assert got.ids == alone.ids and np.allclose(got.logprob, alone.logprob, atol=1e-5)
    assert mixed[1].ids != mixed[3].ids  # (two keys of one setting draw differently)


def test_stop_ids_end_a_generation_with_the_token_kept():
    rng = random.Random(5)
    p = _prompt(rng, 8)
    free = _run(_engine(), [(p, 12, {})])[0]
    stop = free.ids[4]
    first = free.ids.index(stop)
    got = _run(_engine(), [(p, 12, {"stop_ids": {stop}})])[0]
    assert got.ids == free.ids[: first + 1] and not got.ended_by_eos


def _hf_hidden(ids, layer):
    hf, _, _ = F.models()
    got = []
    h = hf.model.layers[layer].register_forward_hook(lambda m, i, o: got.append((o[0] if isinstance(o, tuple)
                                                                                  else o)[0, -1]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    h.remove()
    return got[0]


@pytest.mark.parametrize("layer", [0, 1])
def test_hidden_layer_is_the_residual_stream_at_the_last_prompt_token(layer):
    """Fresh prompts of different lengths in one padded prefill, a prompt whose own cache covers all but its last
    token (the SeaKR feed: sample, then EOS in place of its last token), and one behind a shared prefix: each
    Generation.hidden is the transformers layer's output at the prompt's last token (no NaN left from the output
    buffer)."""
    rng = random.Random(layer)
    e = _engine()
    prompts = [_prompt(rng, n) for n in (5, 9, 14)]
    outs = _run(e, [(p, 1, {"hidden_layer": layer}) for p in prompts])
    for p, o in zip(prompts, outs):
        assert torch.isfinite(o.hidden).all()
        torch.testing.assert_close(o.hidden, _hf_hidden(p, layer), atol=1e-4, rtol=1e-4)
    s = e.new_sequence()
    p = prompts[1]
    e.start(s, p, 6)
    while e.has_work:
        e.step()
    fed = p + s.out.ids[:-1] + [EOS]
    e.start(s, fed, 1, hidden_layer=layer)
    while e.has_work:
        e.step()
    assert s.out.prefilled == 1  # (only the EOS computed: the sample's KV reused)
    torch.testing.assert_close(s.out.hidden, _hf_hidden(fed, layer), atol=1e-4, rtol=1e-4)
    head = _prompt(rng, 8)
    assert e.set_prefix(" ".join(map(str, head))) is not None
    q = head + _prompt(rng, 5)
    o = _run(e, [(q, 1, {"hidden_layer": layer})])[0]
    torch.testing.assert_close(o.hidden, _hf_hidden(q, layer), atol=1e-4, rtol=1e-4)


def test_bad_engine_arguments_are_named():
    e = _engine()
    s = e.new_sequence()
    with pytest.raises(ValueError, match="hidden_layer"):
        e.start(s, [1, 2], 1, hidden_layer=2)
    with pytest.raises(TypeError, match="sampling"):
        e.start(s, [1, 2], 1, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="stop_ids"):
        e.start(s, [1, 2], 1, stop_ids={96})


# ---------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("seed", range(4))
def test_eigen_score_against_eigenvalues(seed):
    g = torch.Generator().manual_seed(seed)
    k, d = 3 + seed, 16 + 8 * seed
    z = torch.randn(k, d, generator=g)
    zc = (z - z.mean(1, keepdim=True)).double().numpy()
    want = np.log(np.linalg.eigvalsh(zc @ zc.T + 1e-3 * np.eye(k))).sum() / k
    assert math.isclose(eigen_score(z, 1e-3), want, rel_tol=1e-4, abs_tol=1e-4)


def test_identical_samples_score_their_one_direction_and_alpha():
    """k equal rows: the Gram matrix has one eigenvalue k |z_c|^2 + alpha and k - 1 equal to alpha."""
    z = torch.arange(8, dtype=torch.float32).repeat(5, 1)
    c = float(((z[0] - z[0].mean()) ** 2).sum())
    want = (math.log(5 * c + 1e-3) + 4 * math.log(1e-3)) / 5
    assert math.isclose(eigen_score(z, 1e-3), want, rel_tol=1e-4)
    assert eigen_score(z + 0.5 * torch.randn(5, 8), 1e-3) > eigen_score(z, 1e-3)  # spread raises it


def test_answer_pattern():
    assert answer_of("So the answer is Paris.") == "paris"
    assert answer_of("Thus the answer is: 1942, as said") == "1942"
    assert answer_of("He lived in Rome. Paris is the answer") == "paris"
    assert answer_of("The answer is") is None and answer_of("Paris is the capital.") is None


@pytest.mark.parametrize("bad, field", [
    ({"samples": 1}, "samples"), ({"sample_temperature": 0}, "sample_temperature"),
    ({"sample_top_p": 0}, "sample_top_p"), ({"sample_top_k": -1}, "sample_top_k"),
    ({"hidden_layer": -1}, "hidden_layer"), ({"eigen_alpha": 0}, "eigen_alpha"),
    ({"eigen_threshold": float("inf")}, "eigen_threshold"), ({"prob_threshold": 1.5}, "prob_threshold"),
    ({"max_docs": 0}, "max_docs"), ({"step_max_tokens": 0}, "step_max_tokens"), ({"eigen_treshold": 1}, "eigen_tr"),
])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        make_config("seakr", "hotpotqa", bad)


def test_defaults_are_the_published_ones():
    c = make_config("seakr", "2wikimultihopqa")
    assert (c.samples, c.sample_temperature, c.sample_top_k, c.sample_top_p, c.step_max_tokens, c.hidden_layer,
            c.eigen_alpha, c.eigen_threshold, c.prob_threshold, c.max_reasoning_steps, c.max_docs) == \
        (20, 1.0, 50, 0.9, 100, 15, 1e-3, -6.0, 0.1, 10, 5)


# ---------------------------------------------------------------------------------------------- real model


def test_seakr_parity_with_the_real_model(tmp_path):
    """One of the project's own questions with every step judged uncertain (threshold far below any score): the
    retrieval path runs, each new document is judged by its step's samples, and engine and oracle agree on the
    steps, queries, documents, the document kept and the answer."""
    recs = _parity(tmp_path, "seakr", {"samples": 2, "step_max_tokens": 12, "max_reasoning_steps": 1, "fewshot": 2,
                              "eigen_threshold": -1e6}, OWN, "hotpotqa", 1)
    rounds = [r for r in recs[0]["rounds"] if r["query"] is not None]
    assert rounds and all(r["chosen_doc"] in r["doc_ids"] for r in rounds)
    assert all(r["uncertainty"] is None or math.isfinite(r["uncertainty"]) for r in recs[0]["rounds"])


@pytest.mark.slow
def test_seakr_parity_on_hotpotqa(tmp_path):
    _parity(tmp_path, "seakr", {"samples": 4, "step_max_tokens": 32}, BUNDLED / "hotpotqa_dev20.jsonl", "hotpotqa", 2)


def test_query_keeps_the_sure_content_words_of_the_dropped_step():
    """Sure: in the question, in the previous step, or 1 - p <= prob_threshold over the word's tokens; then only
    content words (the RealWords answer, sent here by hand) not in the published stop list; no sure word: the
    question's content words."""
    from fastrag.loop.requests import RealWords
    from fastrag.methods.seakr import Seakr, Step
    from fastrag.model.loading import load_tokenizer

    tok = load_tokenizer("smollm2")
    policy = Seakr(make_config("seakr", "hotpotqa"), tok)
    ids = tok.encode(" Paris is the capital of France, so the answer is Lyon.", add_special_tokens=False)
    words = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    unsure = {i for i, w in enumerate(words) if w.endswith("capital") or w.endswith("Lyon")}
    lp = [math.log(0.5) if i in unsure else math.log(0.97) for i in range(len(ids))]
    step = Step("Paris is the capital of France, so the answer is Lyon.", ids, lp, 9.0)

    def drive(gen, answers):
        req = next(gen)
        asked = []
        try:
            while True:
                assert isinstance(req, RealWords)
                asked.append(req.text)
                req = gen.send(answers(req.text))
        except StopIteration as e:
            return e.value, asked

    q, asked = drive(policy.query("Where was Lyon founded?", step, ""),
                     lambda text: {"Paris", "capital", "France", "answer", "Lyon", "founded"})
    # Lyon: unsure but in the question; capital: unsure; is/the/of/so: not content; answer: the stop list
    assert asked == ["Paris is the of France so the answer is Lyon"] and q == "Paris France Lyon"
    none_sure = Step(step.text, ids, [math.log(0.5)] * len(ids), 9.0)
    q, asked = drive(policy.query("Who built it?", none_sure, ""), lambda text: {"built"} if "built" in text else set())
    assert asked == ["Who built it?"] and q == "built"


def test_one_prefill_keeps_the_layers_its_generations_ask_for():
    """Generations of different hidden layers prefilled together (two methods in one run) each get their own."""
    rng = random.Random(9)
    prompts = [_prompt(rng, n) for n in (4, 7)]
    outs = _run(_engine(), [(prompts[0], 1, {"hidden_layer": 0}), (prompts[1], 1, {"hidden_layer": 1})])
    for p, o, layer in zip(prompts, outs, (0, 1)):
        torch.testing.assert_close(o.hidden, _hf_hidden(p, layer), atol=1e-4, rtol=1e-4)


def test_hidden_layer_through_the_packed_forward_of_sequences_of_two_prefixes(monkeypatch):
    """Sequences behind different shared prefixes prefilled together take the packed forward; it keeps the layer
    too."""
    import fastrag.model.attention.packed as packed

    calls = []
    real = packed.forward_packed
    monkeypatch.setattr(packed, "forward_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = random.Random(11)
    e = _engine(mix_prefill=True)  # (sequences of different prefixes in one prefill)
    heads = [_prompt(rng, 8), _prompt(rng, 8)]
    prompts = []
    for h in heads:
        assert e.set_prefix(" ".join(map(str, h))) is not None
        prompts.append(h + _prompt(rng, 3 + len(prompts) * 4))
    outs = _run(e, [(p, 1, {"hidden_layer": 0}) for p in prompts])
    assert calls, "the prefill did not take the packed forward"
    for p, o in zip(prompts, outs):
        torch.testing.assert_close(o.hidden, _hf_hidden(p, 0), atol=1e-4, rtol=1e-4)
