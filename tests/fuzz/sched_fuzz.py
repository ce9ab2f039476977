"""QuestionLoop-level differential fuzz: random policies (plain / continued / tracked / one-shot / Parallel generations,
identical one-shot prompts (the greedy memo), attention passes, searches, cancellations) served by a QuestionLoop over
a tight engine (small pool, random batch, overlap on or off, random max_inflight) and over a large engine at batch 1
with one question in flight. Every question's trace (tokens, entropies, logprobs, attention) must agree, and match
the full-recompute reference for greedy generations.

    python tests/fuzz/sched_fuzz.py --seeds 0-30
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_fuzz as F  # noqa: E402

from fastrag.loop import AttnColmax, AttnRows, Generate, Parallel, QuestionLoop, Search  # noqa: E402
from fastrag.retrieval.base import Doc  # noqa: E402
from fastrag.trace import QuestionResult  # noqa: E402


@dataclass
class Ex:
    qid: str
    question: str
    answers: tuple
    seed: int


class FakeRetriever:
    """Deterministic docs from the query text: doc ids are token ids of the query mixed."""

    def __init__(self, V, delay_s=0.0):
        self.V, self.delay_s = V, delay_s

    def search(self, queries, k):
        if self.delay_s:  # (a round trip: concurrent batches then overlap and finish out of order)
            time.sleep(self.delay_s * (1 + len(queries) % 3))
        out = []
        for q in queries:
            ids = [int(x) for x in q.split()] or [1]
            out.append([Doc(id=str(i), title="", text=" ".join(str((t * (i + 3) + i) % (self.V - 1))
                                                                for t in ids[:4])) for i in range(k)])
        return out


def s(ids):
    return " ".join(map(str, ids))


def make_policy(V, prefixes, traces):
    def policy(ex: Ex):
        r = random.Random(ex.seed)
        tok = lambda n: [r.randrange(0, V - 1) for _ in range(n)]  # noqa: E731
        pre = r.choice([[]] + prefixes)
        q = tok(r.randint(1, 12))
        text = []
        last = None  # (prompt ids, generated ids) of branch 0
        tracked = False
        tr = traces.setdefault(ex.qid, [])
        for rnd in range(r.randint(1, 5)):
            kind = r.choice(["plain", "cont", "track", "track_cont", "oneshot", "parallel", "attn", "search"])
            n = r.randint(1, 10)
            if kind in ("cont", "track_cont") and last is None:
                kind = "plain"
            if kind == "track_cont" and not tracked:  # (a span continues only after a tracked chunk of it)
                kind = "track"
            if kind == "cont" and tracked:
                kind = "track_cont"
            tracked = kind in ("track", "track_cont") or (tracked and kind not in ("plain",))
            if kind == "plain":
                p = pre + q + text
                g = yield Generate(s(p), n, 0)
                last = (p, list(g.ids))
                tr.append(("gen", p, n, None, g))
            elif kind == "cont":  # a chunk resumed where it stopped (suffix_ids)
                p, ids = last
                g = yield Generate(s(p), n, 0, suffix_ids=tuple(ids))
                last = (p, ids + list(g.ids))
                tr.append(("gen", p + ids, n, None, g))
            elif kind == "track":
                p = pre + q + text
                g = yield Generate(s(p), n, 0, track_attn=True)
                last = (p, list(g.ids))
                tr.append(("gen", p, n, len(p), g))
            elif kind == "track_cont":  # DRAGIN streaming: the round's prompt + its tokens, the span continued
                p, ids = last
                g = yield Generate(s(p), n, 0, suffix_ids=tuple(ids), track_attn=True)
                last = (p, ids + list(g.ids))
                tr.append(("gen", p + ids, n, len(p), g))
            elif kind == "oneshot":
                p = pre + tok(r.randint(0, 6)) + q + text
                g = yield Generate(s(p), n, None)
                tr.append(("gen", p, n, None, g))
            elif kind == "parallel":  # BeamSearchQA-like: identical one-shots (memo), another branch, a search
                p = pre + tok(r.randint(1, 6)) + q
                p2 = pre + q + tok(2)
                parts = [Generate(s(p), n, None), Generate(s(p), n, None), Generate(s(p2), n, 1),
                         Search(s(q), 2)]
                gs = yield Parallel(parts)
                for part, g in zip(parts[:3], gs[:3]):
                    tr.append(("gen", part.prompt and [int(x) for x in part.prompt.split()], n, None, g))
                tr.append(("search", [d.id for d in gs[3]]))
            elif kind == "attn":
                ids = (q + text)[-r.randint(1, 20):] or q
                if r.random() < 0.5:
                    a = yield AttnColmax(ids)
                    tr.append(("colmax", ids, a))
                else:
                    a = yield AttnRows(ids)
                    tr.append(("rows", ids, a))
            elif kind == "search":
                docs = yield Search(s(q + text[-3:]), 3)
                tr.append(("search", [d.id for d in docs]))
                text = text[: r.randint(0, len(text))] + [int(x) for x in docs[0].text.split()][:3]
                last = None
                tracked = False
                continue
            if kind in ("plain", "cont", "track", "track_cont"):
                text = text + list(g.ids)
        return QuestionResult(qid=ex.qid, question=ex.question, gold=[], prediction=s(text))

    return policy


def run(wl_seed, ec: F.EngineCfg, n_q, inflight, overlap, cancel, V=96, search_concurrency=1):
    r = random.Random(wl_seed)
    bs = r.choice([2, 4, 8])
    prefixes = [[r.randrange(0, V - 1) for _ in range(r.randint(bs, 4 * bs))] for _ in range(r.randint(0, 2))]
    wl = F.Workload(wl_seed, V, V - 1, bs, prefixes, None, None, [], 0)
    eng = F.build(wl, ec)
    for p in prefixes:
        eng.set_prefix(s(p))
    free0 = eng.pool.num_free
    traces, results = {}, {}
    sched = QuestionLoop(eng, FakeRetriever(V, 0.001 if search_concurrency > 1 else 0.0),
                      make_policy(V, prefixes, traces), max_inflight=inflight, overlap=overlap, text_workers=0,
                      search_concurrency=search_concurrency)
    exs = [Ex(f"q{i}", f"question {i}", (), wl_seed * 1000 + i) for i in range(n_q)]
    tickets = [sched.submit(ex, lambda res, ex=ex: results.__setitem__(ex.qid, res)) for ex in exs]
    steps = 0
    while sched.busy:
        sched.step()
        steps += 1
        for t, k in cancel:
            if steps == k:
                sched.cancel(tickets[t])
        F.check_invariants(eng, f"{ec.name} sched step {steps}")
        if steps > 5000:
            raise AssertionError("scheduler did not finish")
    sched.close()
    F.check_invariants(eng, "end")
    if eng.live or eng.waiting or eng.running:
        raise F.InvariantError(f"{len(eng.live)} sequences live after the run")
    if eng.pool.num_free != free0:
        raise F.InvariantError(f"free blocks {eng.pool.num_free} != {free0} at the start")
    return traces, results, dict(eng.stats), sched.reused_generations


def compare(ta, tb, ra, rb, cancelled, problems, hf, eos):
    for qid in sorted(set(ta) | set(tb)):
        if qid in cancelled:
            continue
        a, b = ta.get(qid, []), tb.get(qid, [])
        if qid not in ra or qid not in rb:
            problems.append(f"{qid}: no result in one run")
            continue
        if ra[qid].error or rb[qid].error:
            problems.append(f"{qid}: error {ra[qid].error!r} / {rb[qid].error!r}")
            continue
        if len(a) != len(b):
            problems.append(f"{qid}: {len(a)} vs {len(b)} trace entries")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if x[0] != y[0]:
                problems.append(f"{qid}[{i}]: kinds {x[0]} vs {y[0]}")
                break
            if x[0] == "gen":
                gx, gy = x[4], y[4]
                if x[1] != y[1] or gx.ids != gy.ids or gx.ended_by_eos != gy.ended_by_eos:
                    problems.append(f"{qid}[{i}]: tokens {gx.ids} vs {gy.ids}")
                    break
                d = max([abs(p - q) for p, q in zip(gx.entropy + gx.logprob, gy.entropy + gy.logprob)] + [0])
                if d > F.TOL:
                    problems.append(f"{qid}[{i}]: entropy/logprob differ by {d:.2e}")
                if (gx.attn is None) != (gy.attn is None) or (gx.attn is not None and (
                        len(gx.attn) != len(gy.attn)
                        or max([abs(p - q) for p, q in zip(gx.attn, gy.attn)] + [0]) > F.TOL)):
                    problems.append(f"{qid}[{i}]: attn differs {gx.attn} vs {gy.attn}")
                # reference
                ids, ent, lp, e, margins = F.ref_generation(hf, x[1], x[2], eos)
                if gx.ids != ids or gx.ended_by_eos != e:
                    div = next((j for j, (p, q) in enumerate(zip(gx.ids, ids)) if p != q), min(len(ids), len(gx.ids)))
                    if not (div < len(margins) and margins[div] < 1e-4):
                        problems.append(f"{qid}[{i}]: tokens {gx.ids} vs reference {ids}")
                    break
                d = max([abs(p - q) for p, q in zip(gx.entropy + gx.logprob, ent + lp)] + [0])
                if d > F.TOL:
                    problems.append(f"{qid}[{i}]: entropy/logprob differ from reference by {d:.2e}")
                if x[3] is not None and gx.attn is not None:
                    toks = x[1] + gx.ids
                    fed = len(toks) - 1 if gx.ended_by_eos else len(toks) - 2
                    # the span of a continued generation began at x[3] of the same branch: every query since
                    want = F.ref_attn(hf, toks, x[3], fed)
                    if len(want) != len(gx.attn) or max([abs(p - q) for p, q in zip(want, gx.attn)] + [0]) > F.TOL:
                        problems.append(f"{qid}[{i}]: attn differs from reference")
            elif x[0] in ("colmax", "rows"):
                if x[0] == "colmax":
                    d = max(abs(p - q) for p, q in zip(x[2], y[2]))
                else:
                    d = float((x[2] - y[2]).abs().max())
                if d > F.TOL:
                    problems.append(f"{qid}[{i}]: {x[0]} pass differs by {d:.2e}")
            elif x != y:
                problems.append(f"{qid}[{i}]: {x} vs {y}")


def run_seed(seed):
    r = random.Random(seed + 5)
    hf, _, _ = F.models(96)
    n_q = r.randint(3, 10)
    cancel = [(r.randrange(n_q), r.randint(1, 30))] if r.random() < 0.3 else []
    big = F.EngineCfg("big", None, 1)
    problems = []
    try:
        tb, rb, sb, _ = run(seed, big, n_q, 1, False, cancel=[])
    except Exception as e:  # noqa: BLE001
        return [f"big: {type(e).__name__}: {e}"], None
    tight = F.EngineCfg("tight", r.randint(18, 40), r.choice([2, 4, 8]), cuda_graphs=r.random() < 0.4,
                        mix_prefill=r.random() < 0.3, prefix_caching=r.random() < 0.8,
                        max_prefill_tokens=r.choice([16, 64, 4096]))
    ov = r.random() < 0.5
    inflight = r.randint(2, 10)
    sc = r.choice([1, 1, 2, 4])  # retrieval batches in flight (drawn last: the earlier draws stay each seed's)
    tight.async_prefill = r.random() < 0.5  # (after it, for the same reason)
    try:
        ta, ra, sa, reused = run(seed, tight, n_q, inflight, ov, cancel, search_concurrency=sc)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return [f"tight: {type(e).__name__}: {e}"], (tight, ov, inflight, sc)
    cancelled = {f"q{t}" for t, _ in cancel}
    compare(ta, tb, ra, rb, cancelled, problems, hf, 95)
    return problems, (tight, ov, inflight, sc, sa["kv_waits"], sa["evictions"], reused)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-9")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bad = 0
    for seed in F.parse_seeds(args.seeds):
        t0 = time.time()
        problems, info = run_seed(seed)
        cfg = "" if info is None else (
            f"blocks={info[0].blocks} batch={info[0].max_batch} graphs={info[0].cuda_graphs} "
            f"pc={info[0].prefix_caching} ov={info[1]} inflight={info[2]} searches={info[3]} "
            + (f"kv_waits={info[4]} evictions={info[5]} reused={info[6]}" if len(info) > 4 else ""))
        print(f"seed {seed}: {'OK' if not problems else 'FAIL'} {time.time() - t0:.1f}s {cfg}", flush=True)
        for p in problems[:8]:
            print("   ", p)
        bad += bool(problems)
    print(f"{bad} failing seeds")


if __name__ == "__main__":
    main()
