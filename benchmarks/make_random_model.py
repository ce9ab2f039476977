"""Write a random-initialised Llama-family model of a real shape as an HF directory, for GPU benchmarks.

Nothing is downloaded: the shapes are the published configs' numbers, the tokenizer is the embedded SmolLM2 one
(so prompts tokenise as in every other run; the vocabulary is SmolLM2's 49152 entries, the rest of the shape is
the named model's). Both the engine (`--model DIR`) and the per-question oracle (transformers) load the directory,
so bench_e2e compares them on the same weights; random weights make the generated text meaningless, which is fine
for speed (both sides decode the same greedy tokens) and is why accuracy is not reported from such runs.

    python benchmarks/make_random_model.py --shape llama2-7b --out /tmp/llama2-7b-random   # on the GPU machine
    python benchmarks/bench_e2e.py --model /tmp/llama2-7b-random --limit 50 --batch-size 128 --tuned-oracle-limit 10
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# (hidden, intermediate, layers, heads, kv heads, max positions): the published configs' shapes
SHAPES = {
    "llama2-7b": (4096, 11008, 32, 32, 32, 4096),
    "llama2-13b": (5120, 13824, 40, 40, 40, 4096),
    "smollm2-135m": (576, 1536, 30, 9, 3, 8192),
    "tiny": (64, 128, 2, 4, 2, 4096),  # tests
}
# the published vocabularies (tiny: a test size). bench_decode builds its models with them; make() takes the
# embedded tokenizer's, so that prompts tokenise as in every other run
VOCAB = {"llama2-7b": 32000, "llama2-13b": 32000, "smollm2-135m": 49152, "tiny": 512}


def hf_shape(shape: str) -> dict:
    """A named shape as LlamaConfig keyword arguments, with its published vocabulary."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    hidden, inter, layers, heads, kv, max_pos = SHAPES[shape]
    return dict(vocab_size=VOCAB[shape], hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos)


def make(shape: str, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
         device: str | None = None, tokenizer: str | None = None) -> Path:
    """Create `out` (config.json, weights, tokenizer) and return it. tokenizer: a directory holding the SmolLM2
    tokenizer files (benchmarks/gpu/prepare.sh writes one for machines without the embedded GGUF package);
    default: the embedded one."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fastrag.model.loading import load_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    hidden, inter, layers, heads, kv, max_pos = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else load_tokenizer("smollm2")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=list(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None,
                    help="directory of SmolLM2 tokenizer files (default: the embedded GGUF package's)")
    args = ap.parse_args()
    path = make(args.shape, Path(args.out), getattr(torch, args.dtype), args.seed, tokenizer=args.tokenizer)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
