"""The request bodies of `fastrag serve` (OpenAI's completion and chat requests, and fastrag's `retrieval` object),
validated as they arrive: a request the server cannot honour as asked is refused with what is wrong.

(no `from __future__ import annotations` here: FastAPI reads the request models from the endpoints' annotations at
run time, and pydantic the fields' annotations; the models are made per app, for its decoding and tokenizer)
"""

from typing import Any, Literal

from fastrag.model.loading import control_token_strings, find_control_token


def request_models(engine, max_question_chars: int = 8192):
    """(Completion, Chat): the request models of an app serving `engine` (an AsyncEngine): its decoding is the only
    one a request may ask for, and its tokenizer's control-token strings are refused in questions."""
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    class Retrieval(BaseModel):
        model_config = ConfigDict(extra="forbid")
        method: str = "dragin"
        dataset: str = "hotpotqa"
        config: dict[str, Any] | None = None

    # OpenAI fields accepted only when off, and why
    UNSUPPORTED = {"stop": "stop sequences are not supported: the method decides where its rounds end",
                   "logprobs": "logprobs is not supported", "echo": "echo is not supported",
                   "presence_penalty": "presence_penalty is not supported (only 0)",
                   "frequency_penalty": "frequency_penalty is not supported (only 0)",
                   "logit_bias": "logit_bias is not supported"}

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        include_usage: bool = False

    core = getattr(getattr(engine, "loop", None), "engine", None)
    sampling = getattr(core, "sampling", None)  # the server's decoding (fastrag serve --temperature ...)
    # the served tokenizer's control-token strings (e.g. "<|im_end|>"): prompts are tokenized as the published
    # research code tokenizes, which reads such a string as the control token itself, so a question holding one
    # could end or restructure the method's prompt: it is refused
    tok = getattr(core, "tok", None)
    specials = control_token_strings(tok)

    class Common(BaseModel):
        # OpenAI's request fields: those the server honours, and those it accepts only at the value it serves
        # (a request asking for more is refused, never silently served otherwise); any other field is refused
        model_config = ConfigDict(extra="forbid")
        model: str | None = None
        user: str | None = None
        stream: bool = Field(default=False, strict=True)  # ("yes" or 1: refused, never read as true)
        stream_options: StreamOptions | None = None
        max_tokens: int | None = Field(default=None, ge=1, le=4096, strict=True)  # (true or "16": refused)
        retrieval: Retrieval = Field(default_factory=Retrieval)
        n: int = 1
        stop: str | list[str] | None = None
        logprobs: bool | int | None = None
        echo: bool = False
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None  # (not OpenAI's; vLLM-style clients send it)
        seed: int | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        logit_bias: dict[str, float] | None = None

        @field_validator("n")
        @classmethod
        def _n(cls, v):
            if v != 1:
                raise ValueError("only n=1 is served (one answer per question)")
            return v

        @field_validator(*UNSUPPORTED)
        @classmethod
        def _unsupported(cls, v, info):  # accepted only when off (None, False, 0, empty)
            if v:
                raise ValueError(UNSUPPORTED[info.field_name])
            return v

        @field_validator("temperature", "top_p", "top_k", "seed")
        @classmethod
        def _served(cls, v, info):
            """Decoding is the server's (one engine, one sampler): a request may restate it, not change it."""
            if v is None or sampling is None:
                return v
            served = getattr(sampling, info.field_name)
            if info.field_name == "seed" and sampling.temperature <= 0:
                return v  # greedy: no seed in play
            if float(v) != float(served):
                raise ValueError(f"this server decodes with {info.field_name}={served} (fastrag serve "
                                 f"--{info.field_name.replace('_', '-')}); a request cannot change it")
            return v

    class Completion(Common):
        prompt: str

        @field_validator("prompt", mode="before")
        @classmethod
        def _one(cls, v):
            """OpenAI's prompt may be a list of prompts (clients such as LangChain's send even one as a list): a
            list of one string is that string; more prompts, or token ids, are refused by what they are."""
            if not isinstance(v, list):
                return v
            if len(v) == 1 and isinstance(v[0], str):
                return v[0]
            if v and all(isinstance(x, str) for x in v):
                raise ValueError(f"a list of {len(v)} prompts: one question per request (send each as its own "
                                 "request: concurrent requests share the decode batch)")
            raise ValueError("the question is text: a string (or a list of one string), not token ids")

        @field_validator("prompt")
        @classmethod
        def _prompt(cls, v: str) -> str:
            if not v.strip():
                raise ValueError("prompt is empty")
            _unicode(v, "prompt")
            if len(v) > max_question_chars:
                raise ValueError(f"prompt has {len(v)} characters; at most {max_question_chars}")
            return v

    class Message(BaseModel):
        # OpenAI's roles and content shapes: a string, a list of content parts (the text parts' texts, joined, are
        # the content; a part of another kind, e.g. an image, is refused), or none (an assistant turn that called
        # tools); only the last user message is read, so the earlier turns' roles are accepted as they come
        role: Literal["system", "developer", "user", "assistant", "tool", "function"]
        content: str | list[dict[str, Any]] | None = None

        @field_validator("content")
        @classmethod
        def _parts(cls, v):
            if not isinstance(v, list):
                return v
            for i, part in enumerate(v):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} is of type {part.get('type')!r}: only text parts "
                                     "({'type': 'text', 'text': ...}) are served")
            return "".join(part["text"] for part in v)

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)
        # OpenAI's newer name of max_tokens for chat: either may be given (both: they must agree)
        max_completion_tokens: int | None = Field(default=None, ge=1, le=4096, strict=True)

        @model_validator(mode="after")
        def _completion_tokens(self):
            m, c = self.max_tokens, self.max_completion_tokens
            if m is not None and c is not None and m != c:
                raise ValueError(f"max_tokens={m} and max_completion_tokens={c} disagree (give one)")
            if c is not None:
                self.max_tokens = c
            return self

        @field_validator("messages")
        @classmethod
        def _messages(cls, v: list[Message]) -> list[Message]:
            users = [m for m in v if m.role == "user"]
            if not users or not (users[-1].content or "").strip():
                raise ValueError("messages need a non-empty user message (the question)")
            _unicode(users[-1].content, "the user message")
            if len(users[-1].content) > max_question_chars:
                raise ValueError(f"the user message has {len(users[-1].content)} characters; "
                                 f"at most {max_question_chars}")
            return v

    def _unicode(v: str, what: str) -> None:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} holds a lone surrogate at character {e.start} (not Unicode text)") from None
        if (hit := find_control_token(v, specials)) is not None:
            raise ValueError(f"{what} holds the model's control token {hit[0]!r} at character {hit[1]}: it would "
                             "be read as that token, not as text")

    return Completion, Chat
