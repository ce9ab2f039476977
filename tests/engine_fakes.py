"""Stand-ins shared by the engine and scheduler tests: a tokenizer whose text is the token ids, a question record,
and a small random Llama model."""

from __future__ import annotations

from dataclasses import dataclass, field


class IntTok:
    """A text of space-separated token ids; `encode` reads them back. No EOS (generations run to their budget)."""

    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


@dataclass
class Ex:
    """A question as the scheduler's policies see it."""

    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["x"])


def tiny_llama(dtype=None, device: str = "cpu", seed: int = 3, **cfg):
    """A random 2-layer Llama with grouped-query heads (cfg overrides the shape). transformers is imported here, not
    at collection (test modules that set TRITON_INTERPRET=1 must import triton first)."""
    import torch
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    base = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, eos_token_id=None)
    return LlamaModel.from_hf_config(LlamaConfig(**(base | cfg)), dtype=dtype or torch.float32, seed=seed,
                                     device=device)
