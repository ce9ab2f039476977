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


def drive(eng, arrivals, after_step=None, max_steps: int = 500, step_fn=None) -> list:
    """Step an engine until it is idle, starting each generation of `arrivals` (step, prompt, max_new) before that
    engine step; after_step(eng) runs after every step; step_fn(eng) steps instead of eng.step(). Returns the
    sequences in the order they started."""
    seqs, step = [], 0
    todo = sorted(arrivals, key=lambda a: a[0])
    while todo or eng.has_work:
        while todo and todo[0][0] <= step:
            _, prompt, n = todo.pop(0)
            s = eng.new_sequence()
            eng.start(s, prompt, n)
            seqs.append(s)
        if eng.has_work:
            eng.step() if step_fn is None else step_fn(eng)
            if after_step is not None:
                after_step(eng)
        step += 1
        assert step < max_steps, "the run did not finish"
    return seqs


def count_ops(fn) -> int:
    """The torch operations `fn()` dispatches (each a launch, or at least a dispatch, on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def tiny_dragin_run(tmp_path):
    """A function out -> fastrag.eval.RunOptions of a real DRAGIN run over 3 bundled HotpotQA questions (BM25 over
    the bundled passages) with a tiny random model written under tmp_path: batch 4, overlap on, results in
    tmp_path / out."""
    import json
    import sys
    from pathlib import Path

    import torch

    from fastrag.eval import BUNDLED, RunOptions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from make_random_model import make

    model_dir = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    cfg = tmp_path / "dragin.json"
    cfg.write_text(json.dumps({"method": "attn_entropy", "generate_max_length": 16, "hallucination_threshold": 0.5,
                               "retrieve_topk": 2, "query_formulation": "real_words"}))

    def opts(out: str) -> RunOptions:
        return RunOptions(method="dragin", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                          corpus=str(BUNDLED / "wiki_passages.jsonl"), model=str(model_dir), config=str(cfg),
                          limit=3, batch_size=4, output=str(tmp_path / out), progress=False, overlap=True)

    return opts
