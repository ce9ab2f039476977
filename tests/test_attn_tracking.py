"""In-context attention tracking in the decode step (DRAGIN streaming's a_i): the engine's running per-head maximum
of the last layer's attention each tracked token receives, folded in by the fused attention-statistics kernel from
the decode attention's own row log-sum-exp, equals the same statistic computed from scratch (a cache-free causal
pass over the whole sequence, softmax in float64) — with and without a shared prefix, on the C++ decode path and the
torch cascade path, with the torch, C++ and Triton (interpreted on CPU) signal backends, across a generation resumed
in chunks and after a cache loss; tracking leaves the generated tokens of every sequence in the batch unchanged."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU tensors; before any kernels import

from engine_fakes import count_ops  # noqa: E402
from fastrag.engine import Engine, track_capacity  # noqa: E402
from fastrag.model.llama import LlamaModel  # noqa: E402
from fastrag.signals import BackendUnavailableError, get_backend  # noqa: E402
from fastrag.signals.reference import _causal_probs  # noqa: E402


class ByteTok:
    """Bytes 0-255 are the tokens; no EOS (every generation runs to its length)."""

    eos_token_id = None

    def encode(self, s: str) -> list[int]:
        return list(s.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, max_position_embeddings=2048)
    return LlamaModel.from_hf_config(cfg, seed=1).eval()


def torch_path(model):
    m = copy.deepcopy(model)
    m.native_decode = None  # the torch cascade attention (what a non-fp32 / GPU-less build without _C runs)
    return m


def expected_attn(model, tokens: list[int], fed: int, track_from: int, rows_from: int = 0) -> list[float]:
    """mean_h max_{j <= r < fed, r >= rows_from} A[h, r, j] for j = track_from .. len(tokens)-1, from scratch
    (0 where no such row); A is the reference's float64 causal softmax of a cache-free pass."""
    with torch.no_grad():
        q, k = model.last_layer_qk(torch.tensor([tokens[:fed]]), torch.tensor([fed]))
    p = _causal_probs(q[0], k[0], fed, model.scale)  # [H, fed, fed]
    out = []
    for j in range(track_from, len(tokens)):
        r0 = max(j, rows_from)
        out.append(float(p[:, r0:, j].amax(dim=1).mean()) if r0 < fed else 0.0)
    return out


def run_one(eng, seq, prompt, n, track_from=None):
    if track_from is None:
        eng.start(seq, prompt, n)
    else:
        eng.start(seq, prompt, n, track_from=track_from)
    done = []
    while eng.has_work:
        done += eng.step()
    assert seq in done
    return seq.out


BACKENDS = ["torch", "cpp", "triton"]


def backend_or_skip(name):
    """`name` if that backend can run this file's CPU model; else skip, saying why."""
    try:
        be = get_backend(name)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    if "cpu" not in be.devices:  # Triton on a GPU machine without TRITON_INTERPRET=1: CUDA tensors only
        pytest.skip(f"the {name} backend runs on {sorted(be.devices)} here and this test's model is on the CPU "
                    "(tests/test_cuda_graphs.py tracks attention on the GPU)")
    return name


@pytest.mark.parametrize("signals", BACKENDS)
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("with_prefix", [True, False])
def test_tracked_generation_matches_from_scratch(model, signals, path, with_prefix):
    m = model if path == "native" else torch_path(model)
    if path == "native" and m.native_decode is None:
        pytest.skip("fastrag._C is not built")
    eng = Engine(m, ByteTok(), block_size=8, kv_cache_gb=0.01, signals=backend_or_skip(signals))
    demos = "Question: alpha beta gamma? Answer: delta.\n" * 2
    if with_prefix:
        assert eng.set_prefix(demos) is not None
    prompt = ByteTok().encode(demos + "Question: why? Answer:")
    tf = len(prompt) - 3  # the span starts inside the prompt: its last 3 tokens are fed by decode steps
    s = eng.new_sequence()
    g = run_one(eng, s, prompt, 12, track_from=tf)
    assert len(g.ids) == 12 and g.attn is not None and len(g.attn) == 3 + 12
    exp = expected_attn(m, prompt + g.ids, fed=len(prompt) + 11, track_from=tf)
    assert g.attn[-1] == 0.0  # the last sampled token was never fed
    torch.testing.assert_close(torch.tensor(g.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64), atol=2e-6, rtol=1e-4)
    # the same tokens as an untracked generation of the same prompt
    plain = run_one(eng, eng.new_sequence(), prompt, 12)
    assert plain.ids == g.ids and plain.attn is None


@pytest.mark.parametrize("signals", BACKENDS)
def test_resumed_in_chunks_and_after_cache_loss(model, signals):
    # no prefix caching: the second sequence must find nothing cached (tests/test_prefix_cache.py covers tracking
    # with cached blocks)
    eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.01, signals=backend_or_skip(signals),
                 prefix_caching=False)
    demos = "Question: one two three? Answer: four.\n"
    eng.set_prefix(demos)
    prompt = ByteTok().encode(demos + "Question: what? Answer:")
    tf = len(prompt)
    s = eng.new_sequence()
    ids: list[int] = []
    for c in range(3):  # three chunks of 5: each restart feeds one token (the last sampled one), no prefill
        before = eng.stats["prefill_tokens"]
        g = run_one(eng, s, prompt + ids, 5, track_from=tf)
        assert c == 0 or (eng.stats["prefill_tokens"] == before and g.prefilled == 1)
        ids += g.ids
        assert len(g.attn) == len(ids)
    exp = expected_attn(model, prompt + ids, fed=len(prompt) + len(ids) - 1, track_from=tf)
    torch.testing.assert_close(torch.tensor(g.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64), atol=2e-6, rtol=1e-4)
    # a fresh sequence (nothing cached) resuming the same span: the 15 span tokens are fed one per step
    s2 = eng.new_sequence()
    g2 = run_one(eng, s2, prompt + ids, 5, track_from=tf)
    assert g2.prefilled == len(prompt) + len(ids) - eng.prefix.length  # all after the shared prefix is computed
    exp2 = expected_attn(model, prompt + ids + g2.ids, fed=len(prompt) + len(ids) + 4, track_from=tf)
    torch.testing.assert_close(torch.tensor(g2.attn, dtype=torch.float64), torch.tensor(exp2, dtype=torch.float64), atol=2e-6,
                               rtol=1e-4)
    # a different span start on the same sequence starts from zero: the span's tokens already cached keep their
    # cache, and only the queries fed from this start on count
    g3 = run_one(eng, s2, prompt + ids + g2.ids, 3, track_from=tf + 5)
    n = len(prompt) + len(ids) + 5
    exp3 = expected_attn(model, prompt + ids + g2.ids + g3.ids, fed=n + 2, track_from=tf + 5, rows_from=n - 1)
    torch.testing.assert_close(torch.tensor(g3.attn, dtype=torch.float64), torch.tensor(exp3, dtype=torch.float64), atol=2e-6,
                               rtol=1e-4)


def test_span_longer_than_the_cached_context(model):
    # a few own tokens after a block-aligned prefix, then 40 tracked new ones: the span outgrows the cache it
    # starts in (its columns get keys step by step)
    eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.01, signals="torch")
    demos = "Question: a b c d? Answer: e f g h.\n"
    pre = eng.set_prefix(demos)
    prompt = ByteTok().encode(demos)[: pre.length] + ByteTok().encode("Q:")
    g = run_one(eng, eng.new_sequence(), prompt, 40, track_from=len(prompt))
    exp = expected_attn(model, prompt + g.ids, fed=len(prompt) + 39, track_from=len(prompt))
    torch.testing.assert_close(torch.tensor(g.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64),
                               atol=2e-6, rtol=1e-4)


def test_tracked_and_untracked_sequences_share_a_batch(model):
    eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.01, signals="torch")
    prompts = [ByteTok().encode(f"Question {i}: {'x' * (3 * i)}? Answer:") for i in range(4)]
    solo = [run_one(eng, eng.new_sequence(), p, 8).ids for p in prompts]
    seqs = [eng.new_sequence() for _ in prompts]
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        if i % 2:
            eng.start(s, p, 8, track_from=len(p) - 2)
        else:
            eng.start(s, p, 8)
    while eng.has_work:
        eng.step()
    assert [s.out.ids for s in seqs] == solo
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        if i % 2:
            exp = expected_attn(model, p + s.out.ids, fed=len(p) + 7, track_from=len(p) - 2)
            torch.testing.assert_close(torch.tensor(s.out.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64),
                                       atol=2e-6, rtol=1e-4)
        else:
            assert s.out.attn is None


def test_bad_track_from(model):
    eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.01, signals="torch")
    demos = "Question: a? Answer: b.\n" * 2
    eng.set_prefix(demos)
    p = ByteTok().encode(demos + "Q?")
    with pytest.raises(ValueError, match="track_from"):
        eng.start(eng.new_sequence(), p, 4, track_from=len(p) + 1)
    with pytest.raises(ValueError, match="shared prefix"):
        eng.start(eng.new_sequence(), p, 4, track_from=0)


def test_real_smollm2_tracked_attention_and_streaming_dragin(tmp_path):
    """The embedded SmolLM2 (9 query heads on 3 KV heads, shared demo prefix, C++ decode path): the tracked a_i
    equal the from-scratch statistic; then one question of DRAGIN streaming (in-context a_i) runs end to end."""
    import json

    from fastrag.eval import BUNDLED, RunOptions, build_engine, run

    eng = build_engine("smollm2", 4, "torch", kv_cache_gb=0.25, device="cpu")
    demos = "Question: Who wrote Hamlet?\nAnswer: William Shakespeare wrote Hamlet. So the answer is Shakespeare.\n\n"
    eng.set_prefix(demos)
    prompt = eng.tok.encode(demos + "Question: What is the capital of France?\nAnswer:")
    g = run_one(eng, eng.new_sequence(), prompt, 10, track_from=len(prompt) - 2)
    exp = expected_attn(eng.model, prompt + g.ids, fed=len(prompt) + len(g.ids) - (0 if g.ended_by_eos else 1),
                        track_from=len(prompt) - 2)
    torch.testing.assert_close(torch.tensor(g.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64),
                               atol=1e-5, rtol=1e-3)

    cfg = tmp_path / "stream.json"
    cfg.write_text(json.dumps({"generate_max_length": 24, "hallucination_threshold": 0.5, "fewshot": 2}))
    opts = RunOptions(method="dragin-streaming", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                      corpus=str(BUNDLED / "wiki_passages.jsonl"), output=str(tmp_path / "out"), config=str(cfg),
                      limit=1, batch_size=1, progress=False)
    eng.clear_prefixes()
    m = run(opts, engine=eng)
    assert m["errors"] == 0 and m["n"] == 1 and m["decode_tokens_per_question"] > 0


@pytest.mark.parametrize("news", [(8, 8, 8, 8), (8, 5, 8, 3), (8, 70, 3, 130)],
                         ids=["one_capacity", "one_capacity_mixed_spans", "three_capacities"])
def test_tracked_sequences_at_different_points_share_a_step(model, news):
    """Tracked sequences of different prompt lengths and spans in one decode batch, their maxima held in one
    capacity (the engine moves all rows to the kernel at once) or several, interleaved in the batch (moved a
    capacity at a time, the rows reordered by capacity): each sequence's maxima are its own."""
    eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.01, signals="torch")
    prompts = [ByteTok().encode(f"Q{i}: {'y' * (5 * i)}? A:") for i in range(4)]
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p, n in zip(seqs, prompts, news):
        eng.start(s, p, n, track_from=len(p) - 2)
    while eng.has_work:
        eng.step()
    for s, p, n in zip(seqs, prompts, news):
        assert len(s.out.ids) == n
        exp = expected_attn(model, p + s.out.ids, fed=len(p) + n - 1, track_from=len(p) - 2)
        torch.testing.assert_close(torch.tensor(s.out.attn, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64),
                                   atol=2e-6, rtol=1e-4)


def test_track_capacity_is_a_power_of_two_from_the_minimum():
    assert [track_capacity(n) for n in (0, 1, 63, 64, 65, 128, 129, 1000)] == [64, 64, 64, 64, 128, 128, 256, 1024]


def test_tracking_operations_do_not_grow_with_the_batch(model):
    """A decode step's tracking (`ModelRunner.track`) dispatches the same torch operations for 4 and for 16 tracked
    sequences whose spans all differ in length, held in two capacities: on a GPU each operation costs the host a
    launch or a dispatch, and moving the maxima sequence by sequence cost about 6 operations a sequence a step."""
    def ops_per_track(batch: int) -> list[int]:
        eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.02, signals="torch", max_batch=batch)
        counts = []
        track = eng.runner.track

        def counted(*a, **k):
            counts.append(count_ops(lambda: track(*a, **k)))

        eng.runner.track = counted
        for i in range(batch):  # spans of 2 + n tokens, every one a different length: capacities 64 and 128
            p = ByteTok().encode(f"Q{i}: {'z' * (3 * i)}? A:")
            eng.start(eng.new_sequence(), p, 6 + i if i % 2 else 70 + i, track_from=len(p) - 2)
        for _ in range(4):
            eng.step()
        assert len(counts) >= 2 and {s.amax.shape[1] for s in eng.running} == {64, 128}
        return counts

    small, large = ops_per_track(4), ops_per_track(16)
    assert max(large) == max(small), (small, large)


def test_tracked_sequences_ending_together_reach_the_host_in_one_copy(model, monkeypatch):
    """Tracked sequences that end in the same step get their a_i through one host copy, however many they are: a
    `.tolist()` each is a host synchronisation each on a GPU (the step's own is the copy of its sampled tokens).
    Each still gets its own a_i, equal to the statistic from scratch."""
    def finish_copies(batch: int) -> int:
        eng = Engine(model, ByteTok(), block_size=8, kv_cache_gb=0.02, signals="torch", max_batch=batch)
        prompts = [ByteTok().encode(f"Q{i}: {'w' * (6 * i)}? A:") for i in range(batch)]
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):  # prompts of different lengths, ending in the same step
            eng.start(s, p, 9, track_from=len(p) - 2)
        calls = []
        real_tolist, real_finish = torch.Tensor.tolist, eng.step_finish

        def counted_finish(st):
            calls.clear()
            monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (calls.append(1), real_tolist(t))[1])
            try:
                return real_finish(st)
            finally:
                monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)

        eng.step_finish = counted_finish
        ended = []
        while eng.has_work:
            ended.append(len(eng.step()))
        assert ended[-1] == batch and sum(ended) == batch  # all of them in the last step
        for s, p in zip(seqs, prompts):
            exp = expected_attn(model, p + s.out.ids, fed=len(p) + 8, track_from=s.track_from)
            torch.testing.assert_close(torch.tensor(s.out.attn, dtype=torch.float64),
                                       torch.tensor(exp, dtype=torch.float64), atol=2e-6, rtol=1e-4)
        return len(calls)

    small, large = finish_copies(2), finish_copies(12)
    assert large == small, (small, large)
