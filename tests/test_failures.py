"""One request's failure stays that request's: misuse of the engine's sequence API is refused with a message, a
retrieval that raises ends only the questions whose queries it served, a server request that cannot fit gets an
answer (not a dead worker and a timeout for everyone after it), and shared prefixes nobody uses give their KV
blocks back when a request needs the room. A tiny random model (benchmarks/make_random_model.py) keeps it fast."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from fastrag.eval import BUNDLED, RunOptions, build_engine, run
from fastrag.retrieval.base import Doc, Retriever

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    return make("tiny", tmp_path_factory.mktemp("tiny"), dtype=torch.float32, device="cpu")


def engine_with_blocks(model: str, blocks: int, batch: int = 4):
    """An engine whose KV pool has exactly `blocks` blocks."""
    eng = build_engine(model, batch, kv_cache_gb=1.0, device="cpu")
    per_block = eng.pool.k[0][0, : eng.pool.block_size].numel() * eng.pool.k[0].element_size() * 2 \
        * len(eng.pool.k) * eng.pool.k[0].shape[0]
    eng = build_engine(model, batch, kv_cache_gb=blocks * per_block / 2**30, device="cpu")
    assert eng.pool.num_blocks == blocks
    return eng


def drain(eng) -> dict[int, list[int]]:
    out = {}
    for _ in range(10_000):
        if not eng.has_work:
            return out
        for s in eng.step():
            out[id(s)] = list(s.out.ids)
    raise AssertionError("the engine did not finish")


PROMPTS = ["alpha bravo", "charlie delta echo", "foxtrot golf hotel india"]


def started(eng, max_new: int = 12):
    seqs = [eng.new_sequence() for _ in PROMPTS]
    for s, p in zip(seqs, PROMPTS):
        eng.start(s, eng.tok.encode(p), max_new)
    return seqs


# ---------------------------------------------------------------------------------------------- engine API
@pytest.mark.parametrize("when", ["queued", "decoding"])
def test_releasing_a_busy_sequence_takes_it_out_and_the_others_decode_unchanged(tiny, when):
    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    ref = started(eng)
    want = drain(eng)
    want = [want[id(s)] for s in ref]
    for s in ref:
        eng.release(s)
    free = eng.pool.num_free
    seqs = started(eng)
    if when == "decoding":
        eng.step()
        eng.step()
        assert seqs[1] in eng.running
    eng.release(seqs[1])
    eng.release(seqs[1])  # a second release does nothing more
    assert not any(x is seqs[1] for x in eng.waiting + eng.running)
    got = drain(eng)
    assert id(seqs[1]) not in got
    assert [got[id(seqs[0])], got[id(seqs[2])]] == [want[0], want[2]]
    for s in seqs:
        eng.release(s)
    assert eng.pool.num_free == free  # every block back


def test_a_prefill_that_raises_leaves_its_sequences_waiting_and_a_later_step_computes_them(tiny, monkeypatch):
    """A prefill forward that fails (out of device memory, a kernel error) raises from step(), and its sequences
    wait again as they were: none is lost between the queues, and once the forward works again they generate
    exactly what an engine that never failed generates."""
    ref = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    ref_seqs = started(ref)
    want = drain(ref)
    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    seqs = started(eng)
    real = type(eng.runner).prefill
    calls = {"n": 0}

    def failing(self, items, *a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, items, *a, **k)

    monkeypatch.setattr(type(eng.runner), "prefill", failing)
    free = eng.pool.num_free
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    assert {id(s) for s in eng.waiting} == {id(s) for s in seqs} and not eng.running
    assert all(s.pending_prompt and s.table.num_tokens == 0 and not s.out.ids for s in seqs)
    assert eng.pool.num_free <= free  # (the blocks reserved for them stay theirs)
    got = drain(eng)
    assert [got[id(s)] for s in seqs] == [want[id(s)] for s in ref_seqs]


@pytest.mark.parametrize("async_prefill", [False, True], ids=["sync-prefill", "async-prefill"])
def test_a_decode_step_that_raises_after_its_prefill_loses_nothing(tiny, monkeypatch, async_prefill):
    """The decode part of a step fails after the step's prefill ran: step() raises, the generations the prefill
    finished (one-token budgets) come back from the next step, the prefill's first tokens (read with the decode
    step's results under async_prefill) are appended, and every generation ends as on an engine that never
    failed."""
    budgets = [1, 5, 1, 9]
    prompts = PROMPTS + ["juliet kilo"]

    def run(fail: bool) -> list:
        eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
        eng.async_prefill = async_prefill
        seqs = [eng.new_sequence() for _ in prompts]
        out = {}

        def begin(idx):
            for i in idx:
                eng.start(seqs[i], eng.tok.encode(prompts[i]), budgets[i])

        begin([1, 3])  # two decode first, so that the failing step has both a prefill and a decode part
        for _ in range(2):
            out |= {id(s): list(s.out.ids) for s in eng.step()}
        begin([0, 2])
        real = type(eng.runner).decode
        calls = {"n": 0}

        def failing(self, batch):
            calls["n"] += 1
            if calls["n"] == 1 and fail:
                raise RuntimeError("an illegal memory access (simulated)")
            return real(self, batch)

        monkeypatch.setattr(type(eng.runner), "decode", failing)
        if fail:
            with pytest.raises(RuntimeError, match="simulated"):
                eng.step()
            assert calls["n"] == 1 and eng.has_work
            assert eng._carried if not async_prefill else True  # (sync: the one-token budget ended in the prefill)
        out |= drain(eng)
        monkeypatch.undo()
        assert not eng.has_work and not eng._carried
        return [out.get(id(s)) for s in seqs]

    want = run(False)
    assert all(w is not None for w in want) and [len(w) for w in want] == budgets
    assert run(True) == want


def test_start_refuses_a_busy_or_released_sequence_and_a_bad_length(tiny):
    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    seqs = started(eng)
    ids = eng.tok.encode("kilo lima")
    with pytest.raises(ValueError, match="queued or running"):
        eng.start(seqs[0], ids, 4)
    eng.step()
    with pytest.raises(ValueError, match="queued or running"):
        eng.start(seqs[1], ids, 4)
    drain(eng)
    eng.start(seqs[1], ids, 4)  # finished: it may generate again
    drain(eng)
    eng.release(seqs[2])
    with pytest.raises(ValueError, match="released"):
        eng.start(seqs[2], ids, 4)
    s = eng.new_sequence()
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            eng.start(s, ids, bad)
    eng.start(s, ids, np.int64(2))  # (any integer type)
    drain(eng)
    assert len(s.out.ids) == 2


def test_a_bad_sample_key_is_refused_at_start_and_the_other_sequences_go_on(tiny):
    """A float or string sample_key was taken by start() and failed the next step's sampling, losing every other
    sequence of that step (in neither the waiting nor the running list: a caller waiting on one hung)."""
    from fastrag.engine import SamplingParams

    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu", sampling=SamplingParams(temperature=0.7, seed=1))
    ids = eng.tok.encode("kilo lima")
    good, bad = eng.new_sequence(), eng.new_sequence()
    eng.start(good, ids, 3, sample_key=11)
    for key in (1.5, "x", True, 2**64, -2**63 - 1):
        with pytest.raises(ValueError, match=f"sample_key must be an int of 64 bits.*got {re.escape(repr(key))}"):
            eng.start(bad, ids, 3, sample_key=key)
    eng.start(bad, ids, 3, sample_key=np.int64(7))  # (numpy integers are integers)
    drain(eng)
    assert len(good.out.ids) == 3 and len(bad.out.ids) == 3


@pytest.mark.parametrize("name", ["block_size", "max_batch", "max_prefill_tokens"])
def test_engine_sizes_must_be_positive_ints(tiny, name):
    """max_batch 0 left every sequence waiting forever; block_size 0 divided by zero; 2.5 failed later."""
    from fastrag.engine import Engine

    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {re.escape(repr(bad))}"):
            Engine(eng.model, eng.tok, kv_cache_gb=0.05, **{name: bad})
    assert getattr(Engine(eng.model, eng.tok, kv_cache_gb=0.05, **{name: np.int64(32)}), name, 32) == 32


def test_an_attention_pass_longer_than_the_context_is_refused(tiny):
    eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
    with pytest.raises(ValueError, match="exceeds the model context"):
        eng.attention_passes([[1, 2, 3], [5] * (eng.max_context + 1)], "colmax")


# ------------------------------------------------------------------------------------- shared prefixes
def test_an_idle_prefix_gives_its_blocks_to_a_sequence_that_needs_them(tiny):
    eng = engine_with_blocks(tiny, 12)
    bs = eng.pool.block_size
    pre = eng.set_prefix(" the" * 100)
    held = len(pre.blocks)
    assert 4 <= held <= 10, held
    prompt = eng.tok.encode("a question about something else entirely")
    n_new = (12 - held + 1) * bs - len(prompt)  # fits only without the prefix's blocks
    assert n_new > 0 and len(prompt) + n_new <= 12 * bs
    # while a live sequence starts from the prefix, its blocks stay and the long request is refused
    user = eng.new_sequence()
    eng.start(user, pre.token_ids + eng.tok.encode(" and more"), 2)
    with pytest.raises(ValueError, match="needs more than"):
        eng.start(eng.new_sequence(), prompt, n_new)
    drain(eng)
    eng.release(user)
    # idle now: dropped for the request, which decodes what an engine that never held the prefix decodes
    s = eng.new_sequence()
    eng.start(s, prompt, n_new)
    assert pre not in eng.prefixes
    got = drain(eng)[id(s)]
    fresh = engine_with_blocks(tiny, 12)
    f = fresh.new_sequence()
    fresh.start(f, prompt, n_new)
    assert got == drain(fresh)[id(f)]


def test_set_prefix_reclaims_idle_prefixes_or_says_there_is_no_room(tiny):
    eng = engine_with_blocks(tiny, 11)
    a = eng.set_prefix(" the" * 100)
    b_text = " of" * 100
    need = len(eng.tok.encode(b_text)) // eng.pool.block_size
    assert len(a.blocks) + need > 11 >= need
    b = eng.set_prefix(b_text)  # a is idle: its blocks go to b
    assert eng.prefixes == [b] and eng.pool.num_free == 11 - len(b.blocks)
    user = eng.new_sequence()
    eng.start(user, b.token_ids + [7], 2)
    with pytest.raises(Exception, match="KV blocks") as e:  # b is in use: nothing to reclaim
        eng.set_prefix(" the" * 100)
    assert type(e.value).__name__ == "OutOfBlocks"
    assert eng.prefixes == [b]


# ----------------------------------------------------------------------------------------- retrieval
class Passages(Retriever):
    def search(self, queries, k):
        return [[Doc(f"d{j}", f"Title {j}", f"passage {j} about {q[:20]}") for j in range(k)] for q in queries]


class Flaky(Passages):
    """Raises for any batch holding a query that contains `bad`."""

    def __init__(self, bad: str):
        self.bad = bad

    def search(self, queries, k):
        if any(self.bad in q for q in queries):
            raise ConnectionError("search backend unreachable")
        return super().search(queries, k)


def test_a_failing_retrieval_ends_only_its_own_question(tiny, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 8, "fewshot": 1}))
    questions = [json.loads(x)["question_text"] for x in DATA.read_text().splitlines()[:6]]
    bad = questions[2][:30]

    def go(name, retriever):
        opts = RunOptions(method="sr-rag", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS),
                          output=str(tmp_path / name), model=tiny, config=str(cfg), limit=6, batch_size=6,
                          progress=False)
        run(opts, engine=build_engine(tiny, 6, kv_cache_gb=0.05, device="cpu"), retriever=retriever)
        return {r["question"]: r for r in map(json.loads, (tmp_path / name / "results.jsonl").read_text()
                                                .splitlines())}

    with pytest.warns(RuntimeWarning, match="retrieval failed"):
        got = go("flaky", Flaky(bad))
    want = go("ok", Passages())
    assert len(got) == 6
    failed = [q for q, r in got.items() if r["error"]]
    assert failed == [questions[2]]
    assert "search backend unreachable" in got[questions[2]]["error"] and bad in got[questions[2]]["error"]
    for q in questions:
        if q != questions[2]:
            assert got[q]["prediction"] == want[q]["prediction"] and got[q]["rounds"] == want[q]["rounds"]
    metrics = json.loads((tmp_path / "flaky" / "metrics.json").read_text())
    assert metrics["errors"] == 1


def test_an_error_record_counts_the_tokens_its_question_used(tiny, tmp_path):
    """A DRAGIN question that decodes, then fails at its first retrieval keeps in its error record the tokens its
    finished generation prefilled and decoded (they were 0, while the engine's counters had them)."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 12, "fewshot": 0, "hallucination_threshold": 0}))
    opts = RunOptions(method="dragin", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS),
                      output=str(tmp_path / "o"), model=tiny, config=str(cfg), limit=3, batch_size=3, progress=False)
    eng = build_engine(tiny, 3, kv_cache_gb=0.05, device="cpu")
    with pytest.warns(RuntimeWarning, match="retrieval failed"):
        m = run(opts, engine=eng, retriever=Flaky(""))  # (every query holds "": every search fails)
    recs = [json.loads(x) for x in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert m["errors"] == 3 and all("search backend unreachable" in r["error"] for r in recs)
    # one finished generation of at most 12 tokens each, before the retrieval that failed, and its prompt
    assert all(r["llm_calls"] == 1 and 0 < r["decode_tokens"] <= 12 and r["prefill_tokens"] > 0 for r in recs), recs
    assert sum(r["prefill_tokens"] for r in recs) <= eng.stats["prefill_tokens"]


# ------------------------------------------------------------------------------------------- serving
@pytest.fixture
def client_of(tiny):
    from fastapi.testclient import TestClient

    from fastrag.serving import AsyncEngine
    from fastrag.serving.server import create_app

    opened = []

    def make(blocks: int, retriever=None):
        ae = AsyncEngine(engine_with_blocks(tiny, blocks), retriever or Passages(), max_inflight=4, max_queue=4)
        c = TestClient(create_app(ae, timeout_s=60), raise_server_exceptions=False)
        c.__enter__()
        opened.append((c, ae))
        return c, ae

    yield make
    for c, ae in opened:
        c.__exit__(None, None, None)
        ae.close()


def ask(c, fewshot: int, method: str = "wo-rag", **extra):
    body = {"prompt": "Who directed Jaws?", "retrieval": {"method": method, "dataset": "hotpotqa",
                                                          "config": {"generate_max_length": 6, "fewshot": fewshot}}}
    body.update(extra)
    return c.post("/v1/completions", json=body)


def test_a_request_that_cannot_fit_is_answered_and_the_server_serves_on(client_of):
    c, ae = client_of(12)
    assert ask(c, 0).status_code == 200
    r = ask(c, 4)  # its demos alone need more blocks than the pool has
    assert r.status_code == 422 and "KV blocks" in r.json()["error"]["message"], r.text
    assert ask(c, 0).status_code == 200
    assert c.get("/health").status_code == 200 and ae.alive and ae.metrics()["pending"] == 0
    ae.close()
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "down"


def test_prompt_families_take_turns_in_a_small_pool(client_of):
    """Each family's demos fit beside a question, not two families' at once: idle prefixes make room."""
    c, ae = client_of(64)
    size = {}
    for fs in (2, 3):  # the demo prefixes' blocks
        key = ae.policy("wo-rag", "hotpotqa", {"generate_max_length": 6, "fewshot": fs})
        size[fs] = len(ae.engine.tok.encode(ae._policies[key][0].shared_prefix)) // ae.engine.pool.block_size
    blocks = max(size.values()) + 6  # room for one question of either family
    assert sum(size.values()) > blocks
    c, ae = client_of(blocks)
    for fs in (2, 3, 2, 3, 2):
        r = ask(c, fs)
        assert r.status_code == 200, (fs, r.text)
        eng = ae.engine
        assert len(eng.prefixes) == 1 and len(eng.prefixes[0].blocks) == size[fs]
        assert eng.pool.num_free == blocks - size[fs]  # nothing else held


def test_one_failing_search_fails_one_request(client_of):
    from concurrent.futures import ThreadPoolExecutor

    c, _ = client_of(64, Flaky("Q3 "))

    def one(i):
        return c.post("/v1/completions", json={"prompt": f"Q{i} who?", "retrieval": {
            "method": "sr-rag", "dataset": "hotpotqa", "config": {"generate_max_length": 4, "fewshot": 0}}})

    with pytest.warns(RuntimeWarning, match="retrieval failed"):
        with ThreadPoolExecutor(6) as ex:
            res = list(ex.map(one, range(6)))
    assert [r.status_code for r in res] == [200, 200, 200, 500, 200, 200]
    assert "search backend unreachable" in res[3].json()["error"]["message"]


def test_request_errors_name_the_problem(client_of):
    c, _ = client_of(64)
    r = c.post("/v1/completions", content=b'{"prompt": "x",,}', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON at character" in r.json()["error"]["message"], r.text
    r = ask(c, 0, retrieval={"method": "wo-rag", "dataset": "hotpotqa", "config": {"dataset": "nq"}})
    assert r.status_code == 422 and "retrieval.config.dataset" in r.json()["error"]["message"], r.text
    r = ask(c, 0, retrieval={"method": "wo-rag", "dataset": "hotpotqa", "config": {"dataset": "HotpotQA"}})
    assert r.status_code == 200, r.text
    # max_tokens sets BeamSearchQA's answer length (it has no generate_max_length)
    r = c.post("/v1/completions", json={"prompt": "Who directed Jaws?", "max_tokens": 3, "retrieval": {
        "method": "beamsearchqa", "dataset": "nq", "config": {"max_depth": 0}}})
    assert r.status_code == 200, r.text


def test_a_run_whose_demos_do_not_fit_the_pool_ends_each_question_with_an_error(tiny, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 2}))  # demos of ~150 tokens: 9 blocks
    opts = RunOptions(method="wo-rag", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS),
                      output=str(tmp_path / "o"), model=tiny, config=str(cfg), limit=3, batch_size=3, progress=False)
    with pytest.warns(RuntimeWarning, match="no room for a shared demo prefix"):
        m = run(opts, engine=engine_with_blocks(tiny, 8), retriever=Passages())
    assert m["n"] == 3 and m["errors"] == 3
    recs = [json.loads(x) for x in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert all("needs more than the 8 KV blocks" in r["error"] for r in recs), recs


# ------------------------------------------------------------------------------------------- NaN logits
def test_nan_logits_end_only_their_own_question(tiny, tmp_path):
    """A model whose output turns NaN for one question (broken weights, an fp16 overflow) ends that question with
    an error that says so; the questions decoded in the same batches are unchanged (no NaN leaks across rows of a
    packed prefill or a decode batch), and nothing decodes garbage tokens from a NaN distribution."""
    questions = ["who wrote the book about the lighthouse?", "where was the xylophonist born?",
                 "when did the bridge open?"]
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": ["x"]}) + "\n" for q in questions))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 8, "fewshot": 0}))

    def go(name, poison: bool):
        eng = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")
        if poison:  # a token only the second question has: its embedding row NaN
            others = {t for q in (questions[0], questions[2]) for t in eng.tok.encode(" " + q)}
            tid = next(t for t in eng.tok.encode(" xylophonist") if t not in others)
            with torch.no_grad():
                eng.model.embed.weight[tid] = float("nan")
        opts = RunOptions(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), model=tiny,
                          output=str(tmp_path / name), config=str(cfg), batch_size=4, progress=False)
        run(opts, engine=eng, retriever=Passages())
        return {r["question"]: r for r in map(json.loads, (tmp_path / name / "results.jsonl").read_text()
                                                .splitlines())}

    got, want = go("nan", True), go("ok", False)
    assert "NaN" in (got[questions[1]]["error"] or ""), got[questions[1]]
    for q in (questions[0], questions[2]):
        assert got[q]["error"] is None and got[q]["prediction"] == want[q]["prediction"]


# ------------------------------------------------------------------------------------- serving (round 2)
class Slow(Passages):
    """Searches that take `delay` seconds."""

    def __init__(self, delay: float):
        self.delay = delay

    def search(self, queries, k):
        import time

        time.sleep(self.delay)
        return super().search(queries, k)


def test_a_slow_retrieval_does_not_stall_the_other_requests(client_of):
    """While one question waits on a search, the server admits, decodes and answers the others (its worker used to
    block on the search whenever nothing else was decoding)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    c, _ = client_of(64, Slow(4.0))
    with ThreadPoolExecutor(2) as ex:
        slow = ex.submit(c.post, "/v1/completions", json={"prompt": "Who directed Jaws?", "retrieval": {
            "method": "sr-rag", "dataset": "hotpotqa", "config": {"generate_max_length": 4, "fewshot": 0}}})
        time.sleep(0.5)  # the search is running
        t = time.perf_counter()
        fast = ask(c, 0)
        took = time.perf_counter() - t
        assert fast.status_code == 200 and took < 2.5, (fast.status_code, took)
        assert slow.result().status_code == 200


def test_a_non_streaming_client_that_hangs_up_cancels_its_question(client_of):
    """The ASGI app called directly: the client's disconnect arrives while its question waits on a search."""
    import asyncio

    c, ae = client_of(64, Slow(3.0))
    body = json.dumps({"prompt": "Who directed Jaws?", "retrieval": {
        "method": "sr-rag", "dataset": "hotpotqa", "config": {"generate_max_length": 4, "fewshot": 0}}}).encode()
    sent = []

    async def call():
        msgs = [{"type": "http.request", "body": body, "more_body": False}]
        t0 = asyncio.get_running_loop().time()

        async def receive():  # (as uvicorn's: the disconnect is there at once once the client is gone)
            if msgs:
                return msgs.pop(0)
            left = 0.3 - (asyncio.get_running_loop().time() - t0)
            if left > 0:
                await asyncio.sleep(left)
            return {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
                 "server": ("t", 80)}
        await c.app(scope, receive, send)

    before = ae.metrics()["cancelled"]
    asyncio.run(call())
    assert sent and sent[0]["status"] == 499, sent[:1]
    import time

    deadline = time.time() + 10
    while ae.metrics()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.05)
    assert ae.metrics()["cancelled"] == before + 1


def test_closing_the_engine_ends_the_questions_it_holds(tiny):
    import asyncio

    from fastrag.serving import AsyncEngine

    ae = AsyncEngine(engine_with_blocks(tiny, 64), Slow(2.0), max_inflight=1, max_queue=4)

    async def go():
        cfg = {"generate_max_length": 4, "fewshot": 0}
        its = [await ae.submit("Who directed Jaws?", method="sr-rag", config=cfg) for _ in range(2)]
        first = [await its[0].__anext__()]  # the first is running (its search is under way)
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().run_in_executor(None, ae.close)
        out = []
        for it in its:
            evs = []
            async with asyncio.timeout(10):
                async for ev in it:
                    evs.append(ev)
            out.append(evs)
        return first, out

    first, out = asyncio.run(go())
    for evs in out:
        assert evs and evs[-1].kind in ("error", "answer"), [e.kind for e in evs]
    assert any(evs[-1].kind == "error" and "closed" in evs[-1].data["message"] for evs in out)


def test_openai_fields_are_served_or_refused_and_usage_is_the_prompt_size(client_of):
    c, _ = client_of(64)
    r1, r2 = ask(c, 1), ask(c, 1)  # the second finds the demos and its own prompt cached
    assert r1.status_code == 200 and r2.status_code == 200
    u1, u2 = r1.json()["usage"], r2.json()["usage"]
    assert u1["prompt_tokens"] == u2["prompt_tokens"] > 0  # the prompt's size, however much was cached
    assert u2["prompt_tokens_details"]["cached_tokens"] > 0
    assert ask(c, 0, model="smollm2", user="u1", n=1, temperature=0, logprobs=False, echo=False).status_code == 200
    assert ask(c, 0, model="", top_k=0).status_code == 200  # (no model named; top_k restated at the server's)
    for extra, msg in (({"n": 2}, "n=1"), ({"stop": ["\n"]}, "stop"), ({"logprobs": 3}, "logprobs"),
                       ({"echo": True}, "echo"), ({"temperature": 0.7}, "temperature=0.0"), ({"top_k": 50}, "top_k=0"),
                       ({"presence_penalty": 0.5}, "presence_penalty"), ({"best_of": 2}, "best_of")):
        r = ask(c, 0, **extra)
        assert r.status_code == 422 and msg in r.json()["error"]["message"], (extra, r.text)
    r = c.post("/v1/completions", content=b'{"prompt": "who \\ud800 is it?"}',
               headers={"content-type": "application/json"})
    assert r.status_code == 422 and "lone surrogate" in r.json()["error"]["message"], r.text
    r = ask(c, 0, stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    metrics = c.get("/metrics").text
    assert "fastrag_submitted_total" in metrics and "_created" not in metrics


class Stalled:
    """An engine whose questions never finish, as one whose search hangs (no event at all) or one decoding faster
    than the server reads its events (a progress event put in the queue at each turn of the event loop, up to
    500,000: the next is always there); it counts the questions cancelled."""

    alive = True

    def __init__(self, progress: bool):
        self.progress = progress
        self.cancelled = 0

    async def submit(self, question, method, dataset, config):
        import asyncio

        from fastrag.serving.async_engine import Event, EventStream

        out = asyncio.Queue()

        async def decode():
            # made as they are read: 100,000 events queued beforehand took the test's 0.9 s margin on a loaded CPU
            # (then silent: a server that missed the deadline while events come would answer after them, too late)
            for _ in range(500_000):
                out.put_nowait(Event("token", {"text": "x"}))
                await asyncio.sleep(0)

        task = asyncio.ensure_future(decode()) if self.progress else None

        def cancel(_handle):
            self.cancelled += 1
            if task is not None:
                task.cancel()

        return EventStream(out, {}, cancel)

    def metrics(self):
        return {}

    def close(self):
        pass


@pytest.mark.parametrize("progress", [False, True], ids=["silent", "decoding"])
def test_a_question_past_the_timeout_gets_504_and_is_cancelled(progress):
    """create_app(timeout_s=T): a question still running T seconds after it came is answered 504 (streaming: an
    error event, then [DONE]) and cancelled, whether it sends progress events or none. The deadline is looked at
    every 0.25 s, so the answer comes between T and about T + 0.25 s; the message gives T as it was set."""
    import time

    from fastapi.testclient import TestClient

    from fastrag.serving.server import create_app

    eng = Stalled(progress)
    want = {"message": "the question did not finish within 0.5s"}
    with TestClient(create_app(eng, timeout_s=0.5)) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"prompt": "Who directed Jaws?"})
        took = time.perf_counter() - t0
        assert r.status_code == 504 and r.json()["error"] == {"type": "server_error"} | want, r.text
        assert 0.5 <= took < 1.4, took
        assert eng.cancelled == 1
        t0 = time.perf_counter()
        with c.stream("POST", "/v1/completions", json={"prompt": "Who directed Jaws?", "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        took = time.perf_counter() - t0
        assert s.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["object"] == "error" and last["error"] == want and 0.5 <= took < 1.4, (last, took)
        assert eng.cancelled == 2


def test_where_the_request_checks_draw_their_lines(client_of, tiny):
    """A seed under greedy decoding is accepted (no seed in play), under sampling only the server's; a top_p other
    than the server's is refused, lower as well as higher; a question of exactly max_question_chars characters
    (8192 by default) passes that check, one more does not; the question is the last user message, and only a
    user's; max_tokens and max_completion_tokens must agree either way round, and max_completion_tokens sets the
    round length over the method config's own. A retriever that fails is the server's error, not the request's."""
    from fastapi.testclient import TestClient

    from fastrag.engine import SamplingParams
    from fastrag.serving import AsyncEngine
    from fastrag.serving.server import create_app

    c, _ = client_of(64)

    def chat(messages, config=None, **extra):
        retrieval = {"method": "wo-rag", "dataset": "hotpotqa",
                     "config": {"generate_max_length": 6, "fewshot": 0, **(config or {})}}
        return c.post("/v1/chat/completions", json={"messages": messages, "retrieval": retrieval, **extra})

    def refused(r, msg):
        return r.status_code == 422 and msg in r.json()["error"]["message"]

    assert ask(c, 0, seed=123).status_code == 200
    assert refused(ask(c, 0, top_p=0.5), "top_p=1.0")
    assert refused(ask(c, 0, prompt="x" * 8193), "prompt has 8193 characters; at most 8192")
    assert "characters" not in ask(c, 0, prompt="x" * 8192).text  # (answered, or too long for the KV pool)
    q, blank = {"role": "user", "content": "Who directed Jaws?"}, {"role": "user", "content": "  "}
    assert chat([blank, q]).status_code == 200
    assert refused(chat([q, blank]), "non-empty user message")
    assert refused(chat([blank, {"role": "system", "content": "Who directed Jaws?"}]), "non-empty user message")
    assert refused(chat([{"role": "user", "content": "x" * 8193}]), "the user message has 8193 characters")
    assert refused(chat([q], max_tokens=16, max_completion_tokens=8), "disagree")
    assert refused(chat([q], {"generate_max_length": 0}), "generate_max_length")
    assert chat([q], {"generate_max_length": 0}, max_completion_tokens=6).status_code == 200
    broken, _ = client_of(64, retriever=Flaky("Jaws"))  # a failure of the server's own is a 500 of its own type
    r = ask(broken, 0, method="sr-rag")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    sampled = AsyncEngine(build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu",
                                       sampling=SamplingParams(temperature=0.7, seed=1)), Passages())
    try:
        with TestClient(create_app(sampled, timeout_s=60)) as sc:
            assert refused(ask(sc, 0, seed=2), "seed=1")
            assert ask(sc, 0, seed=1, temperature=0.7).status_code == 200
    finally:
        sampled.close()
