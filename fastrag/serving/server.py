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



# (no `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at run time)
import asyncio
import logging
import math
import signal
import threading
import time

from fastrag.serving.async_engine import AsyncEngine
from fastrag.serving.errors import error_response as _error
from fastrag.serving.errors import error_status, install_error_handlers
from fastrag.serving.metrics_text import prometheus_text
from fastrag.serving.routes_openai import add_openai_routes
from fastrag.serving.schemas import request_models

__all__ = ["check_timeout", "create_app", "error_status", "prometheus_text", "serve"]


def check_timeout(timeout_s) -> float:
    """A per-request timeout: a finite number of seconds > 0 (0, a negative or NaN timed every request out or
    none), else ValueError naming --timeout."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def create_app(engine: AsyncEngine, timeout_s: float = 600.0, max_question_chars: int = 8192,
               model_name: str = "smollm2"):
    """The FastAPI app serving `engine`: the OpenAI-style endpoints (fastrag.serving.routes_openai), the model
    list, /health and /metrics; requests past `timeout_s` get 504, questions longer than `max_question_chars` 422."""
    timeout_s = check_timeout(timeout_s)
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    Completion, Chat = request_models(engine, max_question_chars)
    app = FastAPI(title="fastrag", version="0.1.0")
    app.state.engine = engine
    install_error_handlers(app)
    add_openai_routes(app, engine, Completion, Chat, timeout_s, model_name)

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

    from fastrag.api import RAG, EngineConfig, retriever_spec

    if not (isinstance(shutdown_timeout_s, (int, float)) and shutdown_timeout_s >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout_s!r}")
    check_timeout(timeout_s)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an int in [0, 65535], got {port!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an int >= 1, got {batch_size!r}")
    # (EngineConfig checks the decoding: ValueError naming a bad value, before the model loads)
    config = EngineConfig(model=model, batch_size=batch_size, kv_cache_gb=kv_cache_gb, temperature=temperature,
                          top_p=top_p, seed=seed, top_k=top_k, search_concurrency=search_concurrency)
    rag = RAG(config, retriever=retriever_spec(retriever, corpus))
    engine = rag.serving(max_queue=max_queue)
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
