"""`fastrag serve`: OpenAI-style HTTP API over `AsyncEngine` (FastAPI + uvicorn).

    POST /v1/completions        {"prompt": "question", "stream": false, "max_tokens": 64,
                                 "retrieval": {"method": "dragin", "dataset": "hotpotqa", "config": {...}}}
    POST /v1/chat/completions   {"messages": [{"role": "user", "content": "question"}], ...same extras}
    GET  /v1/models             the served model (a request naming another model gets 404)
    GET  /health                {"status": "ok", ...}
    GET  /metrics               Prometheus text: queue depth, in flight, decode batch, tokens/s, retrievals/s, ...

The prompt is the question; the `retrieval` object picks the dynamic-RAG method, the dataset whose prompts and
settings it uses, and the method's config (the same keys as its `--config` JSON). `max_tokens` (chat: or
`max_completion_tokens`), when given, is the length of each generation round (`generate_max_length`; BeamSearchQA: `answer_max_tokens`). Non-streaming answers carry the prediction as the
completion text and the method's whole trace under `retrieval`. With `"stream": true` the response is server-sent
events an OpenAI client reads unchanged: every chunk has its one choice, and the text deltas join into exactly the
non-streaming completion text (the prediction, sent in the last chunk with `finish_reason` and the trace under
`retrieval`). Progress rides in each chunk's `fastrag` field beside an empty delta: `{"event": "token", "text",
"token_id", "branch"}` for every decoded token of every generation the method runs (draft rounds included: a
round a method throws away is progress, never completion text), and `search` / `documents` / `generate` events as
the method decides; then `data: [DONE]`. OpenAI fields
the server cannot honour (`n` > 1, `stop`, `logprobs`, `echo`, penalties, a decoding other than the server's) get a
422; `usage.prompt_tokens` counts cached prompt tokens too (`prompt_tokens_details.cached_tokens`).

Admission is bounded: beyond `max_queue` waiting questions a request gets 429 with Retry-After (the pending
questions' drain time at the recent service rate: `AsyncEngine._eta`). A request that
runs past `timeout_s` gets 504 (streaming: an error event) and its question is cancelled. A client that
disconnects (streaming or not) cancels its question; the others are not affected.
"""


# (no `from __future__ import annotations` here: FastAPI reads the request models of the endpoints, which are
# defined inside create_app, from their annotations at run time)
import asyncio
import json
import logging
import math
import signal
import threading
import time
import uuid
from typing import Any, Literal

from fastrag.model.loading import control_token_strings, find_control_token
from fastrag.serving.async_engine import AsyncEngine, QueueFull


def check_timeout(timeout_s) -> float:
    """A per-request timeout: a finite number of seconds > 0 (0, a negative or NaN timed every request out or
    none), else ValueError naming --timeout."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def create_app(engine: AsyncEngine, timeout_s: float = 600.0, max_question_chars: int = 8192,
               model_name: str = "smollm2"):
    timeout_s = check_timeout(timeout_s)
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
    from starlette.exceptions import HTTPException as StarletteHTTPException

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

    core = getattr(getattr(engine, "scheduler", None), "engine", None)
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

    def _json_media_type(content_type: str) -> bool:
        kind = content_type.split(";", 1)[0].strip().lower()
        return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))

    app = FastAPI(title="fastrag", version="0.1.0")
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # loc ("body", character offset)
                at = e.get("loc", ())[-1]
                why = (e.get("ctx") or {}).get("error", "")
                errs.append(f"body: not valid JSON at character {at}" + (f" ({why})" if why else ""))
                continue
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            kind = request.headers.get("content-type")
            if loc == "body" and not _json_media_type(kind or ""):
                # the framework reads a body as JSON only under a JSON media type: curl -d sends
                # application/x-www-form-urlencoded, and the framework's own message blames the body's shape
                had = f"its Content-Type is {kind!r}" if kind else "it has no Content-Type"
                errs.append(f"body: not read as JSON, {had}: send Content-Type: application/json")
                continue
            errs.append(f"{loc}: {e.get('msg')}")
        return JSONResponse(status_code=422, content={"error": {"type": "invalid_request_error",
                                                                "message": "; ".join(errs), "fields": errs}})

    def _error(status: int, message: str, headers: dict | None = None, kind: str | None = None):
        err = {"type": "invalid_request_error" if status < 500 else "server_error", "message": message}
        if kind:
            err["code"] = kind
        return JSONResponse(status_code=status, headers=headers, content={"error": err})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own errors (a path not served, a method the path does not take, a body that
        cannot be parsed) in the `{"error": ...}` shape of every other error here (they answered `{"detail": ...}`);
        a body that is not UTF-8 says so."""
        message = str(exc.detail)
        if exc.status_code == 400:
            try:
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError as e:
                message = f"body: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})"
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

    async def _open(question: str, body: Common):
        cfg = dict(body.retrieval.config or {})
        if body.max_tokens is not None:  # the length of each generation round (BeamSearchQA: of its answers)
            cfg["answer_max_tokens" if body.retrieval.method == "beamsearchqa" else "generate_max_length"] = \
                body.max_tokens
        try:
            return await engine.submit(question, method=body.retrieval.method, dataset=body.retrieval.dataset,
                                       config=cfg or None), None
        except QueueFull as e:
            return None, _error(429, str(e), {"Retry-After": str(e.retry_after_s)})
        except (ValueError, KeyError) as e:
            return None, _error(422, f"retrieval: {e}")

    async def _drop(nxt: asyncio.Future) -> None:
        """Cancel a pending wait for the next event (the question's stream closes: it is cancelled)."""
        nxt.cancel()
        try:
            await nxt
        except (asyncio.CancelledError, StopAsyncIteration):
            pass

    async def _answer(question: str, body: Common, chat: bool, request: Request):
        if body.model and body.model != model_name:  # (an empty model: the client names none)
            return _error(404, f"the model {body.model!r} is not served here; this server serves {model_name!r} "
                          "(GET /v1/models)", kind="model_not_found")
        events, err = await _open(question, body)
        if err is not None:
            return err
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(events, rid, created, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # the answer, while watching the client: one that hangs up cancels its question (its KV blocks and its
        # place in the queue go to the others), as a streaming client's does
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        look = loop.time() + 0.25  # the next look at the deadline and the client

        async def gone():
            """The error response if the deadline passed or the client hung up, else None."""
            nonlocal look
            look = loop.time() + 0.25
            if loop.time() >= deadline:
                return _error(504, f"the question did not finish within {timeout_s:g}s")
            if await request.is_disconnected():
                return _error(499, "the client closed the request")
            return None

        it = events.__aiter__()
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                while not nxt.done():
                    await asyncio.wait({nxt}, timeout=min(0.25, max(0.0, deadline - loop.time())))
                    if nxt.done():
                        break
                    if (err := await gone()) is not None:
                        await _drop(nxt)
                        return err
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    return _error(500, "the engine ended the request without an answer")
                if ev.kind == "error":
                    return _error(_error_status(ev.data["message"]), ev.data["message"])
                if ev.kind == "answer":
                    return JSONResponse(_final(ev.data["result"], rid, created, chat))
                # a progress event: a decoding question sends one per token, more often than the wait above gives
                # up, so the deadline and the client are looked at every 0.25 s whether events come or not
                if loop.time() >= look and (err := await gone()) is not None:
                    return err  # (the question is cancelled below)
        finally:
            await events.aclose()  # (a cancelled wait: the question is cancelled)

    def _final(result: dict, rid: str, created: int, chat: bool) -> dict:
        text = result.get("prediction", "")
        usage = _usage(result)
        choice = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage, "retrieval": result}

    def _usage(result: dict) -> dict:
        """Tokens of every generation the method ran: prompt tokens whether computed or taken from the cache
        (`prompt_tokens_details.cached_tokens`: the cached part), and tokens decoded."""
        cached = int((result.get("counters") or {}).get("reused_prompt_tokens", 0))
        prompt = int(result.get("prefill_tokens", 0)) + cached
        done = int(result.get("decode_tokens", 0))
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _sse(events, rid: str, created: int, chat: bool, include_usage: bool = False):
        """Server-sent events an OpenAI client reads as it reads OpenAI's: every line is a chunk with one choice
        (the usage chunk and an error event, `{"error": ...}` as OpenAI sends it, have none), and the text deltas join into exactly the non-streaming completion text
        (the prediction, in the last chunk). What the method does on the way (each decoded token of every
        generation, draft rounds included, and each search) rides in the chunks' `fastrag` field with an empty
        delta: a generation a method throws away never reaches the client's text."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, extra: dict | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            d = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if extra:
                d.update(extra)
            return "data: " + json.dumps(d, ensure_ascii=False) + "\n\n"

        if chat:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                         "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                      "finish_reason": None}]}) + "\n\n"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        it = events.__aiter__()
        try:
            while True:
                # the deadline is looked at before each event and bounds each wait for one. (One timeout around the
                # whole loop fired wherever this generator was suspended, at a `yield` too: it then cancelled the
                # sending of a chunk instead of a wait here, and the client got a stream cut short, without the
                # error event or [DONE].) An event already queued is taken without a timer (wait_for costs tens
                # of microseconds, about the cost of sending the chunk)
                left = deadline - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                try:
                    ev = await (it.__anext__() if events.ready() else asyncio.wait_for(it.__anext__(), left))
                except StopAsyncIteration:
                    break
                if ev.kind in ("token", "search", "documents", "generate"):
                    yield chunk(None, extra={"fastrag": {"event": ev.kind, **ev.data}})
                elif ev.kind == "answer":
                    r = ev.data["result"]
                    yield chunk(r.get("prediction", ""), "stop", {"retrieval": r})
                    if include_usage:  # (OpenAI's stream_options.include_usage: a last chunk, no choices)
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": model_name, "choices": [],
                                                     "usage": _usage(r)}) + "\n\n"
                elif ev.kind == "error":
                    yield "data: " + json.dumps({"id": rid, "object": "error",
                                                 "error": {"message": ev.data["message"]}}) + "\n\n"
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            yield "data: " + json.dumps({"id": rid, "object": "error", "error": {
                "message": f"the question did not finish within {timeout_s:g}s"}}) + "\n\n"
        finally:
            await events.aclose()  # a disconnected client lands here too: its question is cancelled
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: Completion, request: Request):
        return await _answer(body.prompt, body, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, request: Request):
        # the question is the last user message: the method builds its own prompts (demos, documents), so
        # system messages and earlier turns are not part of them
        question = [m for m in body.messages if m.role == "user"][-1].content
        return await _answer(question, body, chat=True, request=request)

    started = int(time.time())

    def _model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "fastrag"}

    @app.get("/v1/models")
    async def models():
        """The one model this server serves (OpenAI's model list: clients and UIs ask it first)."""
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return _error(404, f"the model {model_id!r} is not served here; this server serves {model_name!r}",
                          kind="model_not_found")
        return _model_card()

    @app.get("/health")
    async def health():
        m = engine.metrics()
        if not engine.alive:  # the worker thread is gone: nothing will be served
            return JSONResponse(status_code=503, content={"status": "down", "inflight": m["inflight"],
                                                          "queue_depth": m["queue_depth"]})
        return {"status": "ok", "inflight": m["inflight"], "queue_depth": m["queue_depth"]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.metrics()), media_type="text/plain; version=0.0.4")

    return app


# engine errors a request's own settings cause (422, not 500): its prompt or budget past the context, the method's
# demos (its dataset, fewshot) leaving no room in the context, a sequence larger than the KV pool
_REQUEST_ERRORS = ("exceeds the model context", "leaves no room in the model context",
                   "the pool can ever give one sequence")


def _error_status(message: str) -> int:
    return 422 if any(k in message for k in _REQUEST_ERRORS) else 500


def prometheus_text(m: dict) -> str:
    """The engine's metrics in the Prometheus text exposition format (prometheus_client's own writer)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    up = max(m["uptime_s"], 1e-9)
    for name, doc, value in (
        ("fastrag_queue_depth", "questions waiting for a slot in the batch", m["queue_depth"]),
        ("fastrag_inflight", "questions being served", m["inflight"]),
        ("fastrag_decode_batch", "sequences in the decode batch", m["decode_batch"]),
        ("fastrag_tokens_per_second", "streamed tokens per second since start", m["tokens"] / up),
        ("fastrag_retrievals_per_second", "retrievals per second since start", m["retrievals"] / up),
    ):
        Gauge(name, doc, registry=reg).set(value)
    for key in ("submitted", "finished", "failed", "cancelled", "rejected", "tokens", "retrievals"):
        Counter(f"fastrag_{key}", f"{key} since start", registry=reg).inc(m[key])
    for key, value in m["engine"].items():
        Counter(f"fastrag_engine_{key}", f"engine counter {key}", registry=reg).inc(value)
    # the registry is built per scrape from the engine's totals: a counter's `_created` sample would be the scrape
    # time, which a Prometheus reading it takes for a reset at every scrape (dropped here; prometheus_client's own
    # switch for it is process-wide, and would change the metrics of an application that embeds the server)
    def name(line: str) -> str:  # the metric a line is about ("# HELP name ...", "# TYPE name ...", "name value")
        parts = line.split()
        if line.startswith("#"):
            return parts[2] if len(parts) > 2 else ""
        return parts[0] if parts else ""

    return "".join(line for line in generate_latest(reg).decode().splitlines(keepends=True)
                   if not name(line).endswith("_created"))


class _CancelledAtShutdown(logging.Filter):
    """uvicorn cancels the requests still running when the shutdown timeout ends and logs each one's CancelledError
    as "Exception in ASGI application" with a traceback through the framework: one line says what happened instead."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self.timeout_s = timeout_s

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "a request still running %gs after the shutdown began (--shutdown-timeout) was cancelled, its "
                "question with it", (self.timeout_s,), None, None)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class _Stopped(Exception):
    """SIGTERM, raised again by uvicorn once it has shut down."""


def _stopped(signum, frame):
    raise _Stopped


def serve(model: str = "smollm2", corpus: str | None = None, retriever: str = "bm25", host: str = "127.0.0.1",
          port: int = 8000, batch_size: int = 32, max_queue: int = 256, timeout_s: float = 600.0,
          kv_cache_gb: float | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
          top_k: int = 0, served_model_name: str | None = None, search_concurrency: int | None = None,
          shutdown_timeout_s: float = 30.0) -> None:
    """Serve the HTTP API (create_app). temperature/top_p/top_k/seed: the engine's decoding for every request
    (greedy by default); a request's sampling keys come from its id (the client's qid, else its arrival number).
    served_model_name: the model id of /v1/models and of requests (default: `model` as given). search_concurrency:
    retrieval batches in flight at once (default: the retriever's `concurrent_searches`, 1 for the bundled ones).
    shutdown_timeout_s: on SIGINT/SIGTERM the server refuses new connections and gives the requests in flight this
    long to finish; then they are cancelled (their questions with them) and the process exits."""
    import uvicorn

    from fastrag.engine import SamplingParams
    from fastrag.eval import BUNDLED, build_engine
    from fastrag.retrieval import make_retriever

    if not (isinstance(shutdown_timeout_s, (int, float)) and shutdown_timeout_s >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout_s!r}")
    check_timeout(timeout_s)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an int in [0, 65535], got {port!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an int >= 1, got {batch_size!r}")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, top_k=top_k)  # ValueError: bad value
    eng = build_engine(model, batch_size, kv_cache_gb=kv_cache_gb, sampling=sampling)
    ret = make_retriever(retriever, corpus_path=corpus or str(BUNDLED / "wiki_passages.jsonl"))
    engine = AsyncEngine(eng, ret, max_inflight=2 * batch_size, max_queue=max_queue,
                         search_concurrency=search_concurrency)
    # uvicorn stops on SIGINT/SIGTERM (requests in flight get shutdown_timeout_s), then raises the signal again for
    # the handler it found: SIGTERM's default would kill the process before engine.close() (text worker processes
    # left behind, exit status -15), so SIGTERM raises _Stopped here, and both end the call normally
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _stopped) if main else None
    cancelled = _CancelledAtShutdown(shutdown_timeout_s)
    logging.getLogger("uvicorn.error").addFilter(cancelled)
    try:
        try:
            app = create_app(engine, timeout_s=timeout_s, model_name=served_model_name or model)
            uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout_s)
        except (_Stopped, KeyboardInterrupt):  # (uvicorn has shut down: it raises the signal that stopped it)
            pass
    finally:
        logging.getLogger("uvicorn.error").removeFilter(cancelled)
        if main:
            signal.signal(signal.SIGTERM, before)
        engine.close()
