"""The model context the per-question oracles respect, as the engine does (Engine.start refuses a prompt whose
tokens and generation budget exceed it): a transformers model runs past its `max_position_embeddings` with at most
a warning, and its text there means nothing, so an oracle question that would do so fails with this error instead
of writing an answer."""

from __future__ import annotations


def check_context(model, prompt_tokens: int, max_new_tokens: int = 0) -> None:
    """Raise ValueError when `prompt_tokens` + `max_new_tokens` exceed the model's `config.max_position_embeddings`
    (a config without one: nothing to check)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new exceeds the model context of "
                         f"{limit} tokens (the prompt holds the method's demos, the question, its retrieved passages "
                         "and the text generated so far)")
