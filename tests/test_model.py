"""Our Llama forward over the paged KV cache vs transformers (fp32), and the engine's batched greedy decoding."""

from __future__ import annotations

import pytest
import torch

from fastrag.engine import Engine, SamplingParams
from fastrag.model.llama import LlamaModel
from fastrag.model.loading import load_hf_model, load_tokenizer, resolve_model

PROMPTS = [
    "Question: Who wrote Hamlet?\nAnswer:",
    "The capital of France is",
    "Question: Jeremy Theobald and Christopher Nolan share what profession?\nAnswer: Jeremy Theobald is an actor",
    "1, 2, 3, 4,",
    "In 1492, Columbus",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Paris is the capital of France. Berlin is the capital of",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village near the mountains, there lived an old carpenter who",
    "List three primary colors:",
    "Translate to French: cheese ->",
    "The largest planet in the solar system is",
    "Alan Turing was born in",
    "Water is made of hydrogen and",
    "The director of the film Inception is",
]


@pytest.fixture(scope="module")
def smol():
    torch.manual_seed(0)
    tok = load_tokenizer("smollm2")
    ours = LlamaModel.from_pretrained(resolve_model("smollm2"))
    hf = load_hf_model("smollm2")
    return tok, ours, hf


def _engine(ours, tok, **kw):
    return Engine(ours, tok, block_size=16, kv_cache_gb=0.25, max_batch=32, **kw)


def test_logits_match_transformers_on_a_batch(smol):
    """One padded batch of prompts of different lengths through the paged forward == transformers, per prompt."""
    tok, ours, hf = smol
    eng = _engine(ours, tok)
    prompts = [tok.encode(p) for p in PROMPTS[:6]]
    seqs = [eng.new_sequence() for _ in prompts]
    items = [(s, ids) for s, ids in zip(seqs, prompts)]
    T = max(len(p) for p in prompts)
    with torch.inference_mode():
        # all rows' logits: ask for every valid position
        idx = torch.tensor([b * T + t for b, p in enumerate(prompts) for t in range(len(p))])
        for s, ids in items:
            s.table.reserve(len(ids))
        logits = _all_logits(eng, items, idx)
        off = 0
        for p in prompts:
            ref = hf(torch.tensor([p])).logits[0].float()
            mine = logits[off: off + len(p)]
            off += len(p)
            rel = ((mine - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-4, f"prompt of {len(p)} tokens: max relative logit error {rel:.2e}"


def _all_logits(eng, items, idx):
    """Run ModelRunner.prefill's batch construction but return the logits of every valid position."""
    T = max(len(ids) for _, ids in items)
    B = len(items)
    ids_t = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    pos = torch.zeros(B, T, dtype=torch.long)
    write, ctx = [], []
    for b, (s, ids) in enumerate(items):
        ids_t[b, : len(ids)] = torch.tensor(ids)
        valid[b, : len(ids)] = True
        pos[b, : len(ids)] = torch.arange(len(ids))
        write += s.table.slots(0, len(ids))
        ctx.append((s.table.blocks, len(ids)))
    batch = eng.runner.batch(write, valid, pos, None, ctx)
    return eng.model(ids_t, batch, eng.pool.k, eng.pool.v, logits_index=idx)


def test_batched_greedy_equals_transformers_generate(smol):
    """16 prompts decoded together in one batch == transformers generate (batch 1), token for token.

    A divergence is accepted only at a near-tie (top-2 logit gap < 1e-4 in the reference), and reported.
    """
    tok, ours, hf = smol
    eng = _engine(ours, tok, sampling=SamplingParams(temperature=0.0))
    n_new = 24
    seqs = []
    for p in PROMPTS:
        s = eng.new_sequence()
        eng.start(s, tok.encode(p), n_new)
        seqs.append(s)
    done = []
    while eng.has_work:
        done += eng.step()
    assert len(done) == len(PROMPTS)
    near_ties = []
    for p, s in zip(PROMPTS, seqs):
        ids = tok.encode(p)
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n_new, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=tok.eos_token_id)
        ref = out.sequences[0, len(ids):].tolist()
        if ref and ref[-1] == tok.eos_token_id:
            ref = ref[:-1]
        mine = s.out.ids
        if mine == ref:
            continue
        i = next(i for i in range(min(len(mine), len(ref))) if mine[i] != ref[i])
        top2 = out.scores[i][0].float().topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < 1e-4, f"prompt {p!r}: diverges at token {i} with top-2 gap {gap:.3g} (not a near-tie)"
        near_ties.append((p, i, gap))
    if near_ties:
        print(f"near-tie divergences (accepted): {near_ties}")


def test_entropy_and_logprob_of_decoding_match_reference(smol):
    """Per-token entropy/logprob recorded during decode == float64 reference on transformers' scores."""
    from fastrag.signals.reference import token_signals_ref

    tok, ours, hf = smol
    eng = _engine(ours, tok)
    ids = tok.encode(PROMPTS[2])
    s = eng.new_sequence()
    eng.start(s, ids, 8)
    while eng.has_work:
        eng.step()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    for i, t in enumerate(s.out.ids):
        h, lp, am = token_signals_ref(out.scores[i].float(), torch.tensor([t]))
        assert am.item() == t
        assert abs(h.item() - s.out.entropy[i]) < 1e-4 * max(1.0, h.item()), (i, h.item(), s.out.entropy[i])
        assert abs(lp.item() - s.out.logprob[i]) < 1e-4 * max(1.0, abs(lp.item()))


def test_rebuild_after_truncation_equals_fresh_prefill(smol):
    """A sequence that reuses the shared prefix + part of its own cache gives the logits of a from-scratch run."""
    tok, ours, hf = smol
    demos = "Question: Who is the author of Hamlet?\nAnswer: William Shakespeare wrote it. So the answer is " \
            "William Shakespeare.\n" * 3
    eng = _engine(ours, tok)
    pre = eng.set_prefix(demos)
    assert pre is not None and pre.length % 16 == 0 and pre.length > 0
    s = eng.new_sequence()
    first = tok.encode(demos + "Question: Where is Paris?\nAnswer: Paris is in France. It is")
    eng.start(s, first, 6)
    while eng.has_work:
        eng.step()
    # new prompt shares the prefix and a part of the sequence's own tokens, then differs
    second = tok.encode(demos + "Question: Where is Paris?\nAnswer: Paris is a city in Europe")
    eng.start(s, second, 1)
    assert eng.stats["own_hit_tokens"] > 0 and eng.stats["prefix_hit_tokens"] >= 2 * pre.length
    assert len(s.pending_prompt) < len(second) - pre.length  # reused some of its own cache
    logits = None
    with torch.inference_mode():
        logits = eng.runner.prefill([(s, s.pending_prompt)], want_logits=True)[0]
        ref = hf(torch.tensor([second])).logits[0, -1].float()
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"rebuilt sequence logits differ from a fresh prefill: {rel:.2e}"


def test_prompt_longer_than_context_is_rejected(smol):
    tok, ours, _ = smol
    eng = _engine(ours, tok)
    with pytest.raises(ValueError, match="exceeds the model context"):
        eng.start(eng.new_sequence(), [1] * (ours.c.max_position_embeddings + 1), 4)


def test_model_paths_that_cannot_load_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found: .*nowhere"):
        resolve_model(tmp_path / "nowhere")
    d = tmp_path / "hf"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        resolve_model(d)
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(FileNotFoundError, match=r"hf: no tokenizer in the model directory \(expected one of"):
        load_tokenizer(d)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"hf: cannot load the model directory's tokenizer"):
        load_tokenizer(d)
    with pytest.raises(ValueError, match="unsupported model file"):
        resolve_model(d / "config.json")


@pytest.mark.parametrize("head", [b"GGUF\x03\x00\x00\x00\x00", b"GGUF\x03\x00\x00\x00" + (0).to_bytes(8, "little")
                                  + (3).to_bytes(8, "little")], ids=["header-cut", "metadata-cut"])
def test_a_truncated_gguf_file_is_refused_by_name(head, tmp_path, monkeypatch):
    """A file that starts like a GGUF and then ends (a cut download) is an error naming it, not a traceback from
    deep inside the GGUF reader (struct.error, which the CLI does not catch)."""
    monkeypatch.setenv("FASTRAG_CACHE", str(tmp_path / "cache"))
    # (a GGUF is known by its suffix in any case, or by its magic bytes: each reaches the reader)
    for name in ("cut.gguf", "CUT.GGUF", "cut.bin"):
        bad = tmp_path / name
        bad.write_bytes(head)
        with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: transformers' GGUF reader cannot load it "
                                             r"\(a truncated or damaged file"):
            resolve_model(bad)
    assert not list((tmp_path / "cache").glob("models/*"))  # no half conversion left in the cache
