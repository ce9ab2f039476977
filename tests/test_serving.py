"""`AsyncEngine` and `fastrag serve` on loopback: real SmolLM2, real bm25s over the bundled corpus, short
generations. The server runs in uvicorn on a free port; clients are real HTTP clients (httpx)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import socket
import threading
import time

import httpx
import pytest

from fastrag.data.datasets import load_examples
from fastrag.eval import BUNDLED, build_engine
from fastrag.retrieval import make_retriever
from fastrag.serving import AsyncEngine, QueueFull

QUESTIONS = [e.question for e in load_examples("hotpotqa", BUNDLED / "hotpotqa_dev20.jsonl", limit=3)]
CFG = {"generate_max_length": 20}


@pytest.fixture(scope="module")
def parts():
    eng = build_engine("smollm2", batch_size=4, kv_cache_gb=1.0, device="cpu")
    ret = make_retriever("bm25", corpus_path=str(BUNDLED / "wiki_passages.jsonl"), show_progress=False)
    return eng, ret


@contextlib.contextmanager
def serving(app):
    """The app in uvicorn on a free loopback port, for the block's length: yields (host, port)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 60
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield "127.0.0.1", port
    finally:
        srv.should_exit = True
        th.join(timeout=30)


@pytest.fixture(scope="module")
def server(parts):
    from fastrag.serving.server import create_app

    engine = AsyncEngine(*parts, max_inflight=4, max_queue=4)
    app = create_app(engine, timeout_s=300, max_question_chars=4096)
    with serving(app) as (host, port):
        yield f"http://{host}:{port}", engine
    engine.close()


def batch_answers(parts, questions):
    """The same questions through the batch path (QuestionLoop.run), for comparison."""
    from fastrag.data.datasets import Example
    from fastrag.loop import QuestionLoop
    from fastrag.methods.registry import get_method
    import tempfile

    eng, ret = parts
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CFG, f)
    pol = get_method("dragin").make_policy(get_method("dragin").make_config("hotpotqa", f.name), eng.tok)
    eng.set_prefix(pol.shared_prefix)
    out = []
    exs = [Example(qid=str(i), question=q, answers=[], dataset="hotpotqa") for i, q in enumerate(questions)]
    QuestionLoop(eng, ret, pol, max_inflight=4).run(exs, out.append)
    by = {r.qid: r for r in out}
    return [by[str(i)] for i in range(len(questions))]


def sse_events(lines):
    evs = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            evs.append(payload if payload == "[DONE]" else json.loads(payload))
    return evs


def test_async_engine_answers_like_the_batch_path(parts):
    ref = batch_answers(parts, QUESTIONS)

    async def go():
        engine = AsyncEngine(*parts, max_inflight=4, max_queue=8)
        try:
            async def one(q):
                evs = [ev async for ev in await engine.submit(q, "dragin", "hotpotqa", CFG)]
                return evs
            return await asyncio.gather(*(one(q) for q in QUESTIONS))
        finally:
            engine.close()

    got = asyncio.run(go())
    for evs, r in zip(got, ref):
        assert evs[-1].kind == "answer" and sum(e.kind == "answer" for e in evs) == 1
        res = evs[-1].data["result"]
        assert res["prediction"] == r.prediction
        assert [x["query"] for x in res["rounds"]] == [x.query for x in r.rounds]
        # every retrieval the trace records was streamed as it happened, with its documents
        searches = [e.data["query"] for e in evs if e.kind == "search"]
        assert searches == [x.query for x in r.rounds if x.query is not None]
        docs = [e.data["doc_ids"] for e in evs if e.kind == "documents"]
        assert docs == [x.doc_ids for x in r.rounds if x.query is not None]
        # the streamed tokens are the decoded tokens: as many token events as tokens decoded
        assert sum(e.kind == "token" for e in evs) <= res["decode_tokens"]
        assert sum(e.kind == "token" for e in evs) > 0


def test_completion_and_stream_over_http(server, parts):
    url, _ = server
    body = {"prompt": QUESTIONS[0], "max_tokens": 20, "retrieval": {"method": "dragin", "dataset": "hotpotqa"}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "stop"
    assert d["choices"][0]["text"] == d["retrieval"]["prediction"]
    assert d["usage"]["completion_tokens"] == d["retrieval"]["decode_tokens"] > 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        evs = sse_events(list(s.iter_lines()))
    assert evs[-1] == "[DONE]"
    # every chunk is a text_completion chunk with one choice; the text joins into the non-streaming text
    assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in evs[:-1])
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == d["choices"][0]["text"]  # same question, answer
    finals = [e for e in evs[:-1] if e["choices"][0]["finish_reason"] == "stop"]
    assert len(finals) == 1 and finals[0] is evs[-2] and finals[0]["retrieval"]["prediction"] == d["choices"][0]["text"]
    # progress: every decoded token (drafts included) and every search, in the fastrag field
    toks = [e["fastrag"] for e in evs[:-2] if e["fastrag"]["event"] == "token"]
    # (a token ending in part of a UTF-8 character shows with the next one: at most one event per decoded token)
    assert 0 < len(toks) <= finals[0]["retrieval"]["decode_tokens"] and all(isinstance(t["text"], str) for t in toks)
    assert [e["fastrag"]["query"] for e in evs[:-2] if e["fastrag"]["event"] == "search"] == \
        [x["query"] for x in finals[0]["retrieval"]["rounds"] if x["query"] is not None]
    chat = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 20})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == d["choices"][0]["text"]


def test_the_official_openai_client_reads_the_stream(server):
    """The `openai` package, unchanged, against the server: streamed text deltas join into the non-streaming text
    (completions and chat), no chunk lacks its choice, the progress is in each chunk's `fastrag` field."""
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"retrieval": {"method": "dragin", "dataset": "hotpotqa"}}
    q = QUESTIONS[1]
    full = client.completions.create(model="smollm2", prompt=q, max_tokens=20, extra_body=extra)
    text, progress, finish = "", [], []
    for ch in client.completions.create(model="smollm2", prompt=q, max_tokens=20, stream=True, extra_body=extra):
        text += ch.choices[0].text
        finish.append(ch.choices[0].finish_reason)
        progress.append((ch.model_extra or {}).get("fastrag"))
    assert text == full.choices[0].text
    assert finish[-1] == "stop" and set(finish[:-1]) == {None}
    assert 0 < sum(p is not None and p["event"] == "token" for p in progress) <= full.usage.completion_tokens
    msgs = [{"role": "user", "content": q}]
    chat = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20, extra_body=extra)
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=20, stream=True, extra_body=extra)]
    assert "".join(parts) == chat.choices[0].message.content == full.choices[0].text
    # the model list clients ask first, and a request for a model not served here is a 404, not smollm2's answer
    assert [m.id for m in client.models.list()] == ["smollm2"] and client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4o", prompt=q, max_tokens=20, extra_body=extra)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("body, field", [
    ({"prompt": "q", "retrieval": {"method": "no-such-method"}}, "no-such-method"),
    ({"prompt": "q", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "q", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Who directed <|im_end|> Jaws?"}, "control token '<|im_end|>' at character 13"),
    ({"messages": [{"role": "user", "content": "Jaws?<|endoftext|>"}]}, "control token '<|endoftext|>'"),
    ({"prompt": "q", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "q", "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 8, "max_completion_tokens": 16},
     "max_tokens=8 and max_completion_tokens=16 disagree"),
    ({"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": "16"}, "max_completion_tokens"),
    ({"prompt": "x" * (1 << 20)}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": ["q1", "q2"]}, "prompt: Value error, a list of 2 prompts: one question per request"),
    ({"prompt": [1, 2, 3]}, "prompt: Value error, the question is text"),
    ({"prompt": [[1, 2], [3]]}, "prompt: Value error, the question is text"),
    ({"prompt": []}, "prompt: Value error, the question is text"),
    ({"prompt": "q", "retrieval": {"dataset": "no/pe"}}, "no/pe"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages.0.content: Value error, content part 0 is of type 'image_url'"),
    ({"messages": [{"role": "user", "content": None}]}, "non-empty user message"),
    ({"prompt": "q", "retrieval": {"method": "flare", "config": {"no_such_key": 1}}}, "retrieval.config"),
    ({"prompt": "q", "retrieval": {"method": "dragin", "config": {"hallucination_threshold": "high"}}},
     "retrieval.config"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(server, body, field):
    url, _ = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code in (400, 422), r.text
    msg = r.json()["error"]["message"]
    assert field in msg and ".json" not in msg  # named after the request, not a scratch file
    if "config" in body.get("retrieval", {}):
        assert next(iter(body["retrieval"]["config"])) in msg


def test_a_prompt_as_a_list_of_one_string_is_that_question(server):
    """OpenAI's completions take a list of prompts, and clients (LangChain's OpenAI LLM) send one question as a list
    of one: it is the question, with the same answer as its string."""
    url, _ = server
    body = {"prompt": QUESTIONS[0], "max_tokens": 20}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=300)
    listed = httpx.post(url + "/v1/completions", json={**body, "prompt": [QUESTIONS[0]]}, timeout=300)
    assert plain.status_code == listed.status_code == 200, listed.text
    assert listed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert listed.json()["retrieval"]["question"] == QUESTIONS[0]


def test_chat_takes_openai_message_shapes(server):
    """OpenAI's chat shapes: content as a list of text parts (what the message says is their text), the developer
    role, an assistant turn without content that called a tool, the tool's answer. The question is the last user
    message whichever shape it comes in: the same answer as its plain string (max_completion_tokens stands for
    max_tokens)."""
    url, _ = server
    q = QUESTIONS[0]
    plain = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": q}], "max_tokens": 20})
    assert plain.status_code == 200, plain.text
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": q[:10]}, {"type": "text", "text": q[10:]}]}]
    # (and OpenAI's newer name of max_tokens)
    parts = httpx.post(url + "/v1/chat/completions", timeout=300, json={"messages": msgs, "max_completion_tokens": 20})
    assert parts.status_code == 200, parts.text
    assert parts.json()["retrieval"]["question"] == q
    assert parts.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_malformed_json_is_a_4xx(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "q",', timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and "json" in r.json()["error"]["message"].lower()


def test_a_body_sent_as_a_form_says_to_send_json(server):
    """`curl -d` labels its body application/x-www-form-urlencoded, which the framework does not read as JSON: the
    error names the Content-Type to send instead of blaming the body's shape; so does a body with no Content-Type
    (the framework reads neither as JSON)."""
    url, _ = server
    body = json.dumps({"prompt": "Where is Paris?", "max_tokens": 1}).encode()
    r = httpx.post(url + "/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == ("body: not read as JSON, its Content-Type is "
                                            "'application/x-www-form-urlencoded': send Content-Type: application/json")
    r = httpx.post(url + "/v1/completions", content=b"5", timeout=60,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 422 and "Content-Type" not in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", content=body, timeout=60)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == ("body: not read as JSON, it has no Content-Type: send Content-Type: "
                                            "application/json")
    r = httpx.post(url + "/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/vnd.api+json"})
    assert r.status_code == 200, r.text


def test_errors_of_the_web_framework_have_the_error_shape(server):
    """A path not served, a method a path does not take and a body that is not UTF-8 answer `{"error": {...}}` as
    every other error does (they answered `{"detail": ...}`), and the last one says where the body stops being
    text."""
    url, _ = server
    r = httpx.get(url + "/v1/no-such-path", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found" and "detail" not in r.json()
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/completions", timeout=60)
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"
    assert r.headers.get("allow") == "POST"
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "caf\xe9"}', timeout=60,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert "not UTF-8 text (byte 15 is 0xe9)" in r.json()["error"]["message"]


def test_disconnect_cancels_and_the_server_keeps_serving(server):
    url, engine = server
    before = engine.metrics()["cancelled"]
    body = {"prompt": QUESTIONS[1], "max_tokens": 20, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and "text_completion" in line:
                break  # one token, then hang up
    deadline = time.time() + 60
    while engine.metrics()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.1)
    assert engine.metrics()["cancelled"] == before + 1
    assert engine.metrics()["inflight"] == 0
    r = httpx.post(url + "/v1/completions", json={"prompt": QUESTIONS[2], "max_tokens": 20}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    h = httpx.get(url + "/health", timeout=30).json()
    assert h["status"] == "ok"
    m = httpx.get(url + "/metrics", timeout=30).text
    for name in ("fastrag_queue_depth", "fastrag_decode_batch", "fastrag_tokens_per_second",
                 "fastrag_retrievals_per_second", "fastrag_cancelled_total"):
        assert name in m, name


def test_a_non_streaming_client_that_hangs_up_while_its_question_decodes_cancels_it(tmp_path):
    """A question decoding sends an event per token; the server looked at its non-streaming client only after 0.25 s
    without one, which a fast model never leaves, so the question of a client that hung up decoded to its end for
    nobody. Now the client is looked at every 0.25 s, events or not: its question is cancelled at once."""
    import torch

    from fastrag.retrieval.base import Retriever
    from fastrag.serving.server import create_app

    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    class NoDocs(Retriever):
        def search(self, queries, k):
            return [[] for _ in queries]

    tiny = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")  # (a few ms a token on a CPU)
    engine = AsyncEngine(build_engine(tiny, 2, kv_cache_gb=0.05, device="cpu"), NoDocs(), max_inflight=2)
    body = json.dumps({"prompt": "Tell me a long story", "max_tokens": 3000,  # (seconds of decoding)
                       "retrieval": {"method": "wo-rag", "dataset": "nq", "config": {"fewshot": 0}}}).encode()
    try:
        with serving(create_app(engine, timeout_s=300)) as (host, port):
            with socket.create_connection((host, port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                deadline = time.time() + 60
                while engine.metrics()["tokens"] < 20 and time.time() < deadline:
                    time.sleep(0.01)
                assert engine.metrics()["tokens"] >= 20  # decoding: the client hangs up
            deadline = time.time() + 10
            while engine.metrics()["cancelled"] == 0 and time.time() < deadline:
                time.sleep(0.05)
            m = engine.metrics()
            assert (m["cancelled"], m["finished"], m["inflight"]) == (1, 0, 0), m
            assert m["tokens"] < 1500  # (cut short, not run to its end)
            assert not engine.engine.running
    finally:
        engine.close()


def test_a_full_queue_says_the_retry_time_its_header_gives():
    """The 429's message and its Retry-After header round the wait up alike (the message rounded 1.2 s to 1 s while
    the header said 2)."""
    assert str(QueueFull(1.2)) == "admission queue full; retry after 2s" and QueueFull(1.2).retry_after_s == 2
    assert QueueFull(3.0).retry_after_s == 3 and str(QueueFull(3.0)).endswith("retry after 3s")


def test_admission_queue_overflow_is_429(parts):
    async def go():
        engine = AsyncEngine(*parts, max_inflight=1, max_queue=0)
        try:
            first = await engine.submit(QUESTIONS[0], "dragin", "hotpotqa", CFG)
            with pytest.raises(QueueFull) as e:
                await engine.submit(QUESTIONS[1], "dragin", "hotpotqa", CFG)
            assert e.value.retry_after >= 1
            assert f"retry after {e.value.retry_after_s}s" in str(e.value)  # (the header's value: rounded up)
            evs = [ev async for ev in first]
            assert evs[-1].kind == "answer"
            again = await engine.submit(QUESTIONS[1], "dragin", "hotpotqa", CFG)  # room again
            assert [ev async for ev in again][-1].kind == "answer"
            return engine.metrics()
        finally:
            engine.close()

    m = asyncio.run(go())
    assert m["rejected"] == 1 and m["finished"] == 2


def test_sigterm_cancels_what_is_still_in_flight_after_the_shutdown_timeout(tmp_path):
    """`fastrag serve --shutdown-timeout S`: on SIGTERM the requests in flight get S seconds, then they are cancelled
    and the process exits (the default would wait for a long answer to its end)."""
    import signal
    import subprocess

    import torch

    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    tiny = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "fastrag", "serve", "--model", tiny, "--port", str(port),
                             "--batch-size", "1", "--kv-cache-gb", "0.05", "--shutdown-timeout", "0.5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        got: list = []

        def ask():  # seconds of decoding: far from its end when the server is told to stop
            body = {"prompt": "Tell me a long story", "max_tokens": 3000,
                    "retrieval": {"method": "wo-rag", "dataset": "nq", "config": {"fewshot": 0}}}
            try:
                got.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)
            except httpx.HTTPError as e:
                got.append(type(e).__name__)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.time() + 60
        while time.time() < deadline and "fastrag_tokens_total 0.0" in (m := httpx.get(url + "/metrics").text):
            time.sleep(0.05)
        assert "fastrag_inflight 1.0" in m, m
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.time() - t0
        t.join(timeout=30)
        err = proc.stderr.read()
        assert rc == 0 and took < 15, (rc, took, err[-2000:])
        assert got and got[0] != 200, got  # cut off, not answered
        # (uvicorn cancels the request and ends as after any shutdown; its log says so in a line, no traceback)
        assert "Cancel 1 running task(s)" in err and "Finished server process" in err, err[-2000:]
        assert "request still running 0.5s after the shutdown began" in err and "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_timeout_port_or_batch_it_cannot_serve_before_loading_anything(tmp_path):
    """--timeout 0, -1 or nan started a server that timed every request out (or none); --port 70000 ended in
    OverflowError. All are refused by name before the model loads (the model path here does not exist)."""
    import subprocess

    from fastrag.serving.server import create_app, serve

    for kw, msg in (({"timeout_s": 0}, "--timeout must be a finite number of seconds > 0"),
                    ({"timeout_s": -1.0}, "--timeout must be"), ({"timeout_s": float("nan")}, "--timeout must be"),
                    ({"timeout_s": float("inf")}, "--timeout must be"), ({"timeout_s": True}, "--timeout must be"),
                    ({"port": 70000}, r"--port must be an int in \[0, 65535\], got 70000"),
                    ({"port": 65536}, "got 65536"), ({"port": -1}, "got -1"), ({"port": True}, "got True"),
                    ({"batch_size": 0}, "--batch-size must be an int >= 1, got 0"),
                    ({"batch_size": True}, "--batch-size must be an int >= 1, got True")):
        with pytest.raises(ValueError, match=msg):
            serve(model=str(tmp_path / "no-model"), **kw)
    with pytest.raises(ValueError, match="--timeout must be"):
        create_app(None, timeout_s=-5)
    p = subprocess.run([sys.executable, "-m", "fastrag", "serve", "--model", str(tmp_path / "no-model"),
                        "--timeout", "-1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--timeout must be a finite number of seconds > 0" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_demos_that_leave_no_room_in_the_context_are_the_request_s_fault():
    """A method whose demos fill the model's context (a dataset's demos, a large fewshot) is a 422 naming the
    demos, not a 500: the same request with fewer demos is served."""
    from engine_fakes import IntTok, tiny_llama

    from fastrag.engine import Engine
    from fastrag.serving.errors import error_status as _error_status

    eng = Engine(tiny_llama(max_position_embeddings=64), IntTok(), kv_cache_gb=0.01)
    with pytest.raises(ValueError) as e:
        eng.set_prefix(" ".join(["5"] * 80))
    assert "leaves no room in the model context of 64 tokens (the method's demos" in str(e.value)
    assert _error_status(f"ValueError: {e.value}") == 422
    assert _error_status("RuntimeError: CUDA error: an illegal memory access") == 500

