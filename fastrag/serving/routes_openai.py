"""The OpenAI-style endpoints of `fastrag serve`: POST /v1/completions and /v1/chat/completions, answered whole or
as server-sent events (fastrag.serving.server's docstring describes the protocol)."""

# (no `from __future__ import annotations` here: FastAPI reads the endpoints' request models from their annotations)
import asyncio
import json
import time
import uuid

from fastrag.serving.async_engine import QueueFull
from fastrag.serving.errors import error_response as _error
from fastrag.serving.errors import error_status


def add_openai_routes(app, engine, Completion, Chat, timeout_s: float, model_name: str) -> None:
    """Add the completion and chat endpoints for `engine` (an AsyncEngine) to `app`; Completion and Chat: the
    request models (fastrag.serving.schemas.request_models); requests past `timeout_s` get 504."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    Common = Completion.__mro__[1]  # (their shared base: the fields both requests have)

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
                    return _error(error_status(ev.data["message"]), ev.data["message"])
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
