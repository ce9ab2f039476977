"""Our forward on other Llama-family shapes (GQA ratios, Qwen2-style q/k/v bias, llama3 rope, untied head),
random-initialised by transformers, saved as an HF directory and loaded by us; and sampled decoding."""

from __future__ import annotations

import math

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton signal kernels on CPU (before fastrag.kernels loads)

from fastrag.cache.kv import BlockTable, KVPool
from fastrag.model.llama import AttnBatch, LlamaModel


def _tiny_hf(kind: str, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "llama3-rope":
        cfg = LlamaConfig(num_key_value_heads=3, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama-bias":  # attention_bias: q/k/v and o_proj biases
        cfg = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama-swish":  # "swish" is transformers' other name of SiLU (it was refused as another MLP)
        cfg = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, hidden_act="swish", **common)
        model = LlamaForCausalLM(cfg)
    else:  # multi-head (no GQA), tied embeddings
        cfg = LlamaConfig(num_key_value_heads=6, tie_word_embeddings=True, **common)
        model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # larger weights than the init, so errors would show
        torch.nn.init.normal_(p, std=0.2)
    model.eval()
    model.save_pretrained(tmp_path)
    return model


def _forward_all(model: LlamaModel, prompts: list[list[int]], garbage: float | None = None) -> torch.Tensor:
    c = model.c
    pool = KVPool(c.num_layers, 64, 8, c.num_kv_heads, c.head_dim, next(model.parameters()).dtype)
    if garbage is not None:  # stale values in slots no sequence owns (a freed block) must not leak into attention
        for t in pool.k + pool.v:
            t.uniform_(-garbage, garbage)
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    pos = torch.zeros(B, T, dtype=torch.long)
    write, ctx = [], []
    for b, p in enumerate(prompts):
        t = BlockTable(pool)
        t.reserve(len(p))
        ids[b, : len(p)] = torch.tensor(p)
        valid[b, : len(p)] = True
        pos[b, : len(p)] = torch.arange(len(p))
        write += t.slots(0, len(p))
        ctx.append(t.blocks)
    NB = max(map(len, ctx))
    cb = torch.zeros(B, NB, dtype=torch.long)
    for b, c_ in enumerate(ctx):
        cb[b, : len(c_)] = torch.tensor(c_)
    batch = AttnBatch(torch.tensor(write), valid, pos, 0, torch.zeros(0, dtype=torch.long), cb,
                      torch.tensor([len(p) for p in prompts]), block_size=pool.block_size)
    with torch.no_grad():
        return model(ids, batch, pool.k, pool.v)


@pytest.mark.parametrize("kind", ["mha-tied", "qwen2", "llama3-rope", "llama-bias", "llama-swish"])
def test_tiny_models_match_transformers(kind, tmp_path):
    hf = _tiny_hf(kind, tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 41, 130)]
    logits = _forward_all(ours, prompts)
    off = 0
    with torch.no_grad():
        for p in prompts:
            ref = hf(torch.tensor([p])).logits[0]
            mine = logits[off: off + len(p)]
            off += len(p)
            rel = ((mine - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-4, f"{kind}, {len(p)} tokens: relative logit error {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loading_in_half_precision_holds_half_precision_weights(dtype, tmp_path):
    # an HF directory loaded with dtype=bf16 once came back float32 (the meta-device skeleton kept the default
    # dtype): a GPU engine then ran at twice the weight bytes with a float32 KV cache
    hf = _tiny_hf("llama3-rope", tmp_path)
    full = LlamaModel.from_pretrained(tmp_path)
    half = LlamaModel.from_pretrained(tmp_path, dtype=dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    assert half.inv_freq.dtype == torch.float32 and torch.equal(half.inv_freq, full.inv_freq)
    assert sum(p.numel() * p.element_size() for p in half.parameters()) * 2 == \
        sum(p.numel() * p.element_size() for p in full.parameters())
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 60)]
    ref, out = _forward_all(full, prompts), _forward_all(half, prompts)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 3e-2, rel  # half-precision weights and activations, float32 logits
    with torch.no_grad():  # and the float32 load is still the transformers model's function
        want = hf(torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(ref[7:], want, atol=2e-4, rtol=2e-4)  # the logits of all prompts' tokens, packed


def test_random_init_from_config_has_real_shapes():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaModel.from_hf_config(cfg, seed=0)
    assert m.layers[0].qkv.weight.shape == (64 + 2 * 32, 64)
    assert m.lm_head.weight.shape == (320, 64)
    logits = _forward_all(m, [[1, 2, 3], [4, 5]])
    assert logits.shape == (5, 320) and torch.isfinite(logits).all()


def test_stale_pool_contents_do_not_reach_the_output():
    """Padding positions of a partly filled block and the padded block-table entries point at slots holding stale
    keys/values; attention must give them exactly zero weight."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaModel.from_hf_config(cfg, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7]]
    clean = _forward_all(m, prompts)
    dirty = _forward_all(m, prompts, garbage=1e4)
    assert torch.isfinite(clean).all()
    torch.testing.assert_close(dirty, clean, rtol=1e-5, atol=1e-5)


def test_never_written_pool_memory_may_hold_nan(monkeypatch):
    """The pool is allocated uninitialised (no memory is committed for unused blocks); whatever that memory holds,
    NaN included, must not reach the output: blocks are zeroed when first handed out."""
    from transformers import LlamaConfig

    import fastrag.cache.kv as kv

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaModel.from_hf_config(cfg, seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7]]
    clean = _forward_all(m, prompts)
    real_empty = torch.empty
    monkeypatch.setattr(kv.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    poisoned = _forward_all(m, prompts)
    monkeypatch.undo()
    torch.testing.assert_close(poisoned, clean, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_top_p_limits_the_support():
    from transformers import LlamaConfig

    from fastrag.engine import Engine, SamplingParams

    class Tok:
        eos_token_id = None

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=0)

    def sample(sp, n=12):
        eng = Engine(m, Tok(), kv_cache_gb=0.01, sampling=sp)
        s = eng.new_sequence()
        eng.start(s, [1, 2, 3], n)
        while eng.has_work:
            eng.step()
        return s.out

    a, b = sample(SamplingParams(temperature=1.0, seed=7)), sample(SamplingParams(temperature=1.0, seed=7))
    assert a.ids == b.ids
    greedy = sample(SamplingParams(temperature=0.0))
    tiny_p = sample(SamplingParams(temperature=1.0, top_p=1e-6, seed=3))
    assert tiny_p.ids == greedy.ids  # top-p this small keeps only the argmax
    assert all(abs(h) < 1e-6 for h in tiny_p.entropy)  # entropy of the warped distribution (one token left)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    top1 = sample(SamplingParams(temperature=1.0, top_k=1, seed=3))  # top-k 1: the argmax, whatever the draw
    assert top1.ids == greedy.ids and all(abs(h) < 1e-6 for h in top1.entropy)
    top5 = sample(SamplingParams(temperature=1.0, top_k=5, seed=3))  # entropy of 5 tokens at most: <= ln 5
    assert all(0 < h <= math.log(5) + 1e-5 for h in top5.entropy), top5.entropy
    plain = sample(SamplingParams(temperature=1.0, seed=3))  # (50 tokens: the unfiltered entropy is larger)
    assert sum(plain.entropy) > sum(top5.entropy)
    for bad in (dict(top_k=-1), dict(top_k=2.5), dict(top_k=True), dict(top_k=5)):  # (the last: greedy)
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(**bad)


def test_sampled_tokens_depend_on_the_generation_key_not_on_the_batch():
    """A generation started with a sample_key draws the same tokens alone or beside other sequences (its keys are
    (seed, sample_key, token index), not a shared stream), and another key draws other tokens."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine, SamplingParams

    class Tok:
        eos_token_id = None

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=2)

    def run(jobs):  # jobs: (prompt, sample_key, start at step)
        eng = Engine(m, Tok(), kv_cache_gb=0.01, sampling=SamplingParams(temperature=1.5, top_p=0.95, seed=4))
        seqs = [eng.new_sequence() for _ in jobs]
        step = 0
        while True:
            for s, (prompt, key, at) in zip(seqs, jobs):
                if at == step:
                    eng.start(s, prompt, 20, sample_key=key)
            if not eng.has_work and step > max(at for *_, at in jobs):
                break
            if eng.has_work:
                eng.step()
            step += 1
        return [s.out.ids for s in seqs]

    alone = run([([5, 6, 7], 123, 0)])[0]
    crowded = run([([9, 8], 77, 0), ([1, 2, 3, 4], 55, 0), ([5, 6, 7], 123, 3)])[2]
    assert alone == crowded and len(alone) == 20
    other = run([([5, 6, 7], 124, 0)])[0]
    assert other != alone


def test_top_p_sampling_same_tokens_on_every_signals_backend():
    """Nucleus sampling runs inside the fused decode kernel: with the same seed, the torch (sort), C++ and Triton
    (radix select, interpreted on CPU) backends draw the same tokens and report the same entropies; and every
    reported entropy is that of the nucleus (below the full distribution's on average)."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine, SamplingParams
    from fastrag.signals import BackendUnavailableError, get_backend

    class Tok:
        eos_token_id = None

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=1)

    def run(backend, top_p):
        eng = Engine(m, Tok(), kv_cache_gb=0.01, sampling=SamplingParams(temperature=1.3, top_p=top_p, seed=11),
                     signals=backend)
        seqs = [eng.new_sequence() for _ in range(3)]
        for i, s in enumerate(seqs):
            eng.start(s, [1 + i, 2, 3], 16)
        while eng.has_work:
            eng.step()
        return [s.out for s in seqs]

    backends = ["torch"]
    for name in ("cpp", "triton"):
        try:
            if "cpu" in get_backend(name).devices:
                backends.append(name)
        except BackendUnavailableError:
            pass
    assert "cpp" in backends, "the C++ extension must be built for this test"
    base = run("torch", 0.7)
    for name in backends[1:]:
        other = run(name, 0.7)
        for a, b in zip(base, other):
            assert a.ids == b.ids, f"{name} drew other tokens than torch under top_p=0.7"
            assert max(abs(x - y) for x, y in zip(a.entropy, b.entropy)) < 1e-4
    full = run("torch", 1.0)
    mean = lambda outs: sum(sum(o.entropy) for o in outs) / sum(len(o.entropy) for o in outs)  # noqa: E731
    assert mean(base) < mean(full) - 0.1, "top_p=0.7 entropies are not those of the nucleus"


def test_small_kv_pool_waits_and_evicts_instead_of_failing():
    """More sequences than the pool holds at once: they wait for blocks (and give up their own cache when nothing
    runs); every generation completes and equals the same generation run alone with a roomy pool."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine

    class Tok:
        eos_token_id = None

        def encode(self, s):
            return [int(x) for x in s.split()]

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=0)
    shared = list(range(20, 36))  # one block of shared prefix
    prompts = [shared + [1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][: 6 + i] for i in range(4)]
    per_block = 2 * 2 * 16 * 2 * 8 * 4  # layers * block * kv heads * head dim * fp32, k and v

    def run(n_blocks, batch):
        eng = Engine(m, Tok(), kv_cache_gb=n_blocks * per_block / 2**30, max_batch=batch)
        assert eng.set_prefix(" ".join(map(str, shared))).length == 16
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            eng.start(s, p, 30)  # up to 39 tokens: 3 blocks of 16 each
        done, most = [], 0
        while eng.has_work:
            done += eng.step()
            most = max(most, len(eng.running))
        assert len(done) == len(prompts)
        return [s.out.ids for s in seqs], eng.pool.num_blocks, most

    roomy, _, most_roomy = run(64, 8)
    tight, n, most_tight = run(8, 8)  # the pool minimum: 8 blocks, 1 for the prefix; 4 sequences need 12
    assert n == 8 and most_roomy == 4 and most_tight == 2  # at most two fit at once: the others waited
    assert tight == roomy
    # a sequence larger than the whole pool is refused when it starts, with the sizes and the fix in the message
    eng = Engine(m, Tok(), kv_cache_gb=8 * per_block / 2**30)
    s = eng.new_sequence()
    with pytest.raises(ValueError, match=r"137 tokens .* 8 KV blocks .* raise --kv-cache-gb"):
        eng.start(s, list(range(1, 40)) * 3, 20)
    assert not eng.has_work


def test_kv_pool_is_sized_from_the_device_memory_when_not_given():
    from types import SimpleNamespace

    from fastrag.engine import CPU_KV_CACHE_GB, GPU_MEMORY_FRACTION, Engine, kv_room_gb

    # Llama-2-7B shape on an 80 GB GPU with its bf16 weights loaded: the pool takes the planned share of the device
    # less the weights and the activation room, about 48 GiB (a fixed 8 GB pool held ten questions at once there)
    c = SimpleNamespace(hidden_size=4096, intermediate_size=11008, vocab_size=32000)
    total, used = 80 * 10**9, 14 * 10**9
    gb = kv_room_gb(c, total, used, max_batch=128, max_prefill_tokens=4096)
    act = 4096 * (4 * 4096 + 2 * 11008) * 16 + 128 * 32000 * 16
    assert gb == pytest.approx((GPU_MEMORY_FRACTION * total - used - act) / 2**30)
    assert 40 < gb < 50
    # a bigger batch or prefill chunk leaves less; a device that is nearly full is refused, saying what to change
    assert kv_room_gb(c, total, used, 256, 16384) < gb
    with pytest.raises(ValueError, match="kv_cache_gb"):
        kv_room_gb(c, total, int(0.79 * total), 128, 4096)
    # on a CPU the engine keeps its fixed default; a size given is used as given, a size <= 0 is refused
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=0)
    tok = SimpleNamespace(eos_token_id=None)
    assert Engine(m, tok).kv_cache_gb == CPU_KV_CACHE_GB
    assert Engine(m, tok, kv_cache_gb=0.01).kv_cache_gb == 0.01
    for bad in (0, -1.0, float("nan"), float("inf")):  # (NaN and inf reached int(): an unclear ValueError, an
        # OverflowError)
        with pytest.raises(ValueError, match="kv_cache_gb must be a finite number > 0"):
            Engine(m, tok, kv_cache_gb=bad)


def _save(model_cls, cfg, path):
    torch.manual_seed(0)
    m = model_cls(cfg)
    m.save_pretrained(path)
    return path


_COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("make, msg", [
    (lambda t: (t.Qwen3ForCausalLM, t.Qwen3Config(**_COMMON)), "model_type 'qwen3' is not supported"),
    (lambda t: (t.GemmaForCausalLM, t.GemmaConfig(**_COMMON, head_dim=8)), "model_type 'gemma' is not supported"),
    (lambda t: (t.LlamaForCausalLM, t.LlamaConfig(**_COMMON, mlp_bias=True)), "mlp_bias"),
    (lambda t: (t.LlamaForCausalLM, t.LlamaConfig(**_COMMON, hidden_act="gelu")), "hidden_act 'gelu'"),
    (lambda t: (t.LlamaForCausalLM, t.LlamaConfig(**_COMMON, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 64})), "longrope"),
])
def test_architectures_and_options_it_does_not_compute_are_refused(make, msg, tmp_path):
    """A checkpoint whose math is not this Llama-family model's is refused by name (it used to load and run as
    Llama: Qwen3's q/k norms and Gemma's scaled embeddings were dropped, GELU ran as SiLU)."""
    import transformers

    cls, cfg = make(transformers)
    _save(cls, cfg, tmp_path)
    with pytest.raises(ValueError, match=msg):
        LlamaModel.from_pretrained(tmp_path)


def test_unused_checkpoint_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 weight\(s\) this Llama-family model does not use.*q_norm"):
        LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("drop", ["lm_head.weight", "model.layers.1.mlp.down_proj.weight"])
def test_missing_checkpoint_weights_are_named(drop, tmp_path):
    """A checkpoint without a weight the model computes with (an untied head, a layer's projection) is refused with
    the weight's name (it used to end in a bare KeyError traceback)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON, tie_word_embeddings=False), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd[drop]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing 1 weight\(s\) this model needs \(first: {drop}\)"):
        LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("key, value", [("num_key_value_heads", 6), ("intermediate_size", 96), ("vocab_size", 98)])
def test_a_config_that_does_not_match_its_weights_is_named(key, value, tmp_path):
    """config.json giving other shapes than the weights have (heads, MLP width, vocabulary) is an error naming a
    weight and both shapes (it was a RuntimeError traceback from load_state_dict, which the CLI does not catch)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"do not have the shapes its config\.json gives: \d+ differ, first \S+ of "
                                         r"shape \[\d+, \d+\] where the config gives \[\d+, \d+\]"):
        LlamaModel.from_pretrained(tmp_path)


def test_a_model_directory_without_safetensors_weights_says_so(tmp_path):
    """A directory whose weights are missing, or only in a PyTorch pickle, is refused naming what it lacks and what
    it holds (it was a bare "No such file or directory: .../model.safetensors")."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights in the model directory \(expected model\.safetensors"):
        LlamaModel.from_pretrained(tmp_path)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds pytorch_model\.bin, which fastrag does not read"):
        LlamaModel.from_pretrained(tmp_path)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_an_error_not_an_index_error():
    """A model whose vocabulary is smaller than its tokenizer's (a tokenizer that is not the model's): the shared
    prefix's out-of-range ids are refused by name (they reached the embedding, an IndexError traceback)."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine
    from fastrag.model.loading import load_tokenizer

    tok = load_tokenizer("smollm2")
    m = LlamaModel.from_hf_config(LlamaConfig(**_COMMON), seed=0)
    eng = Engine(m, tok, block_size=4, kv_cache_gb=0.01)
    text = "Question: Who wrote Hamlet? Answer: William Shakespeare wrote it."
    assert max(tok.encode(text)) >= m.c.vocab_size and len(tok.encode(text)) >= 4
    with pytest.raises(ValueError, match=r"the shared prefix .* holds token id \d+, outside the model's vocabulary"):
        eng.set_prefix(text)
    assert not eng.prefixes and eng.pool.num_free == eng.pool.num_blocks


def test_a_truncated_weights_file_is_named(tmp_path):
    """A safetensors file cut short (an interrupted copy or download) is an error naming the file (safetensors'
    own SafetensorError is neither an OSError nor a ValueError: the CLI printed a traceback)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON), tmp_path)
    w = tmp_path / "model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file, truncated or damaged"):
        LlamaModel.from_pretrained(tmp_path)


def test_a_sliding_window_shorter_than_the_context_caps_the_context(tmp_path):
    """Full attention equals windowed attention only within the window: the engine's context stops there."""
    from transformers import MistralConfig, MistralForCausalLM

    _save(MistralForCausalLM, MistralConfig(**_COMMON, sliding_window=32), tmp_path)
    assert LlamaModel.from_pretrained(tmp_path).c.max_position_embeddings == 32
    _save(MistralForCausalLM, MistralConfig(**_COMMON, sliding_window=None), tmp_path)
    assert LlamaModel.from_pretrained(tmp_path).c.max_position_embeddings == 256


def test_end_of_generation_ids_of_the_generation_config_end_a_generation(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from fastrag.engine import Engine

    class Tok:
        eos_token_id = None

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON, eos_token_id=90), tmp_path)
    m = LlamaModel.from_pretrained(tmp_path)
    eng = Engine(m, Tok(), kv_cache_gb=0.01)
    s = eng.new_sequence()
    eng.start(s, [1, 2, 3], 12)
    while eng.has_work:
        eng.step()
    assert len(s.out.ids) >= 2
    stop = s.out.ids[1]  # the second greedy token, named an end-of-generation id in generation_config.json only
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [90, stop]}))
    m = LlamaModel.from_pretrained(tmp_path)
    assert set(m.c.eos_token_ids) == {90, stop}
    eng = Engine(m, Tok(), kv_cache_gb=0.01)
    s2 = eng.new_sequence()
    eng.start(s2, [1, 2, 3], 12)
    while eng.has_work:
        eng.step()
    assert s2.out.ended_by_eos and s2.out.ids == s.out.ids[:1]


def test_float16_decodes_on_the_cpu(tmp_path):
    """A float16 model decodes on the CPU (the masked softmax clamped with float32 bounds fp16 cannot hold)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastrag.engine import Engine

    class Tok:
        eos_token_id = None

    _save(LlamaForCausalLM, LlamaConfig(**_COMMON, eos_token_id=None), tmp_path)
    out = {}
    for dt in (torch.float32, torch.float16):
        eng = Engine(LlamaModel.from_pretrained(tmp_path, dtype=dt), Tok(), kv_cache_gb=0.01)
        seqs = [eng.new_sequence() for _ in range(2)]
        eng.start(seqs[0], [1, 2, 3], 6)
        eng.start(seqs[1], [4, 5, 6, 7, 8, 9, 10], 6)
        while eng.has_work:
            eng.step()
        out[dt] = [s.out for s in seqs]
    for a, b in zip(out[torch.float32], out[torch.float16]):
        assert len(b.ids) == 6 and all(x == x for x in b.entropy)
        assert b.ids[0] == a.ids[0]  # the first token of a random model agrees across precisions
