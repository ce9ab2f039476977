"""What the per-question oracles take from the model as the engine does.

The context (Engine.start refuses a prompt whose tokens and generation budget exceed it): a transformers model runs
past its `max_position_embeddings` with at most a warning, and its text there means nothing, so an oracle question
that would do so fails with `check_context`'s error instead of writing an answer. The end of a generation: the EOS
ids of `eos_ids`, which the engine stops at and counts no token of."""

from __future__ import annotations


def check_context(model, prompt_tokens: int, max_new_tokens: int = 0) -> None:
    """Raise ValueError when `prompt_tokens` + `max_new_tokens` exceed the model's `config.max_position_embeddings`
    (a config without one: nothing to check)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new exceeds the model context of "
                         f"{limit} tokens (the prompt holds the method's demos, the question, its retrieved passages "
                         "and the text generated so far)")


def eos_ids(tokenizer, model) -> set[int]:
    """The ids that end a generation, as the engine reads them: the tokenizer's EOS, the model's generation config's
    and its config's (each an id or a list). ValueError when none names one."""
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None),
                getattr(model.config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(i) for i in src)
    if not ids:
        raise ValueError("the tokenizer and the model's configs name no EOS token")
    return ids
