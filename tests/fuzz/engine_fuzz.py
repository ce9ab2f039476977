"""Randomised differential fuzzing of the engine core (Engine / KVPool / prefix cache / eviction / graphs).

One seed -> one workload: shared prefixes (nested, block-aligned or not), questions of several rounds (fresh
prompts, continuations of the generated ids with or without attention tracking, truncate-and-splice rebuilds as
DRAGIN/FLARE do after a retrieval, one-shot sequences, identical prompts across questions), releases after the
k-th token of a round, batched attention passes, prefix drops mid-run.

The workload is run on
  A. a tight KV pool (forcing kv_waits and evictions), random batch size, random options,
  B. a large pool at batch 1,
and every generation is compared with C, a full-recompute HF transformers forward (eager attention, fp32, no cache).
Invariants are checked after every step: per-block refcount == number of holders, free lists disjoint from held
blocks, no duplicate/lost sequences, stats consistent.

    python tests/fuzz/engine_fuzz.py --seeds 0-20 [--signals torch|cpp|triton] [--decode-attn native|torch|triton]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

TOL = 1e-4


class IdTok:
    """Token ids written as decimal words: encode("3 17 5") == [3, 17, 5]."""

    def __init__(self, V, eos):
        self.V, self.eos_token_id = V, eos

    def __len__(self):
        return self.V

    def encode(self, s):
        return [int(x) for x in s.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# ------------------------------------------------------------------------------------------------ models
_MODELS = {}


def models(V=96, eos_boost=1.0, seed=1234):
    """(HF reference model, fastrag LlamaModel) with identical fp32 weights."""
    key = (V, eos_boost, seed)
    if key in _MODELS:
        return _MODELS[key]
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=V - 1, bos_token_id=None,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():  # std 0.02 init gives near-uniform logits; make the model opinionated
            if p.dim() == 2:
                p.normal_(0, 0.15)
        hf.lm_head.weight.mul_(6.0)
        hf.lm_head.weight[V - 1].mul_(eos_boost)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    m = LlamaModel.from_hf_config(cfg, dtype=torch.float32, device="meta")
    m._load_hf_state_dict(sd, torch.float32, "cpu")
    m.eval()
    _MODELS[key] = (hf, m, cfg)
    return _MODELS[key]


# ------------------------------------------------------------------------------------------------ reference
_REF_CACHE = {}


@torch.no_grad()
def ref_forward(hf, ids):
    """Full recompute: (logits [T, V] float64, last-layer attention [H, T, T] float64)."""
    key = tuple(ids)
    if key not in _REF_CACHE:
        out = hf(torch.tensor([ids]), output_attentions=True)
        _REF_CACHE[key] = (out.logits[0].double(), out.attentions[-1][0].double())
    return _REF_CACHE[key]


def ref_generation(hf, prompt, max_new, eos):
    """Greedy generation by full recompute; returns (ids, entropies, logprobs, ended_by_eos, margins)."""
    ids = []
    ent, lp, margins = [], [], []
    cur = list(prompt)
    # teacher forcing is equivalent to recompute per step (causal), but we must know the tokens: do it step by
    # step in chunks, re-running the whole sequence (no cache) each time a token is appended
    while len(ids) < max_new:
        logits, _ = ref_forward(hf, cur)
        row = logits[-1]
        top2 = torch.topk(row, 2).values
        margins.append(float(top2[0] - top2[1]))
        t = int(row.argmax())
        if t == eos:
            return ids, ent, lp, True, margins
        logp = torch.log_softmax(row, -1)
        ent.append(float(-(logp.exp() * logp).sum()))
        lp.append(float(logp[t]))
        ids.append(t)
        cur.append(t)
    return ids, ent, lp, False, margins


def ref_attn(hf, tokens, track_from, fed_upto):
    """Generation.attn reference: for span tokens i >= track_from of `tokens`, mean over heads of the max
    attention A[h, j, i] over fed queries j in [max(track_from, i), fed_upto] (0 if none)."""
    _, A = ref_forward(hf, tokens)  # [H, T, T]
    H, T, _ = A.shape
    out = []
    for i in range(track_from, len(tokens)):
        j0 = max(track_from, i)
        if j0 > fed_upto:
            out.append(0.0)
            continue
        out.append(float(A[:, j0: fed_upto + 1, i].amax(1).mean()))
    return out


def ref_colmax(hf, ids):
    _, A = ref_forward(hf, ids)
    return [float(A[:, i:, i].amax(1).mean()) for i in range(len(ids))]


def ref_rows(hf, ids):
    _, A = ref_forward(hf, ids)
    return A.mean(0)


# ------------------------------------------------------------------------------------------------ workload
@dataclass
class Workload:
    seed: int
    V: int
    eos: int
    block_size: int
    prefixes: list  # token lists set at the start
    late_prefix: list | None  # set mid-run
    drop_at: int | None  # step at which the first prefix is dropped
    questions: list  # per question a dict
    passes_every: int


SCALE = 1
BLOCK_SIZES = [int(x) for x in os.environ.get("FUZZ_BLOCK_SIZES", "2,4,4,8,16").split(",")]


def make_workload(seed, V=96):
    r = random.Random(seed)
    bs = r.choice(BLOCK_SIZES)
    eos = V - 1
    tok = lambda n: [r.randrange(0, V - 1) for _ in range(n)]  # noqa: E731  (never EOS inside prompts)
    p0 = tok(r.randint(bs, 5 * bs + 3))
    prefixes = [p0]
    if r.random() < 0.6:
        prefixes.append(p0 + tok(r.randint(1, 3 * bs)))  # nested: the longer one must win
    if r.random() < 0.5:
        prefixes.append(tok(r.randint(bs, 4 * bs)))
    late = tok(r.randint(bs, 3 * bs)) if r.random() < 0.4 else None
    stems = [tok(r.randint(1, 3 * bs + 2)) for _ in range(3)]
    qs = []
    for qi in range(r.randint(3, 9) * SCALE):
        pre_choice = r.choice([None] + list(range(len(prefixes))) + ([-1] if late else []))
        stem = r.choice(stems) if r.random() < 0.4 else []
        qtok = stem + tok(r.randint(1, 3 * bs + 3))
        rounds = []
        for _ in range(r.randint(1, 4)):
            kind = r.choice(["continue", "continue", "rebuild", "fresh", "oneshot", "track_new", "track_cont"])
            rounds.append(dict(kind=kind, max_new=r.randint(1, 14), docs=tok(r.randint(0, 2 * bs + 3)),
                               cut=r.random(), splice=r.random() if r.random() < 0.5 else 0.0))
        release = None
        if r.random() < 0.25:
            release = (r.randrange(len(rounds)), r.randint(1, 5))  # (round, after k tokens)
        qs.append(dict(pre=pre_choice, q=qtok, rounds=rounds, release=release, duplicate_of=None,
                       start_delay=r.randint(0, 6) if r.random() < 0.4 else 0))
    # some questions identical to an earlier one (prefix-cache hits, identical prompts run together)
    for qi in range(1, len(qs)):
        if r.random() < 0.2:
            src = r.randrange(qi)
            qs[qi] = dict(qs[src], start_delay=r.randint(0, 3))
            if r.random() < 0.5:  # the same first prompt, then its own rounds (divergence inside shared blocks)
                qs[qi]["rounds"] = [dict(rd, kind=r.choice(["continue", "rebuild", "track_new", "fresh"]),
                                         max_new=r.randint(1, 14), cut=r.random(), splice=r.random())
                                    for rd in qs[src]["rounds"]]
                qs[qi]["rounds"][0]["kind"] = qs[src]["rounds"][0]["kind"]
    return Workload(seed, V, eos, bs, prefixes, late, r.randint(3, 30) if r.random() < 0.3 else None, qs,
                    r.choice([0, 3, 5]))


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class Rec:
    qi: int
    rnd: int
    prompt: list
    max_new: int
    track_from: int | None
    ids: list
    entropy: list
    logprob: list
    ended_by_eos: bool
    attn: list | None
    released: bool
    prefilled: int
    carried: bool = False  # tracking continued from the previous round (same span)


class Q:
    def __init__(self, qi, spec, wl):
        self.qi, self.spec, self.wl = qi, spec, wl
        self.rnd = 0
        self.text = []  # accumulated answer tokens
        self.seq = None
        self.oneshot = None
        self.last_prompt = None
        self.last_ids = []
        self.track_from = None
        self.done = False
        self.cur = None  # (seq, prompt, max_new, track_from, carried)


class InvariantError(AssertionError):
    pass


def check_invariants(eng, where=""):
    pool = eng.pool
    hold = [0] * pool.num_blocks
    live = list(eng.live.values())
    for s in live:
        if len(set(s.table.blocks)) != len(s.table.blocks):
            raise InvariantError(f"{where}: a table holds a block twice: {s.table.blocks}")
        for b in s.table.blocks:
            hold[b] += 1
        if s.prefix is not None:
            for b in s.prefix.blocks:
                hold[b] += 1
        bs = pool.block_size
        if s.table.num_tokens > len(s.table.blocks) * bs:
            raise InvariantError(f"{where}: table num_tokens {s.table.num_tokens} > capacity")
    for p in eng.prefixes:
        for b in p.blocks:
            hold[b] += 1
    if eng.graphs is not None:
        hold[eng.graphs.scratch_block] += 1
    for b in range(pool.num_blocks):
        if pool.refcount[b] < 0:
            raise InvariantError(f"{where}: refcount[{b}] = {pool.refcount[b]} < 0")
        if pool.refcount[b] != hold[b]:
            raise InvariantError(f"{where}: refcount[{b}] = {pool.refcount[b]} but {hold[b]} holders")
    free = list(pool._free)
    idle = list(pool._idle)
    if len(set(free)) != len(free):
        raise InvariantError(f"{where}: duplicate in free list")
    if set(free) & set(idle):
        raise InvariantError(f"{where}: block both free and idle-cached")
    for b in free + idle:
        if pool.refcount[b] != 0:
            raise InvariantError(f"{where}: block {b} in free/idle with refcount {pool.refcount[b]}")
    nheld = sum(1 for b in range(pool.num_blocks) if pool.refcount[b] > 0)
    if nheld + len(free) + len(idle) != pool.num_blocks:
        raise InvariantError(f"{where}: held {nheld} + free {len(free)} + idle {len(idle)} != {pool.num_blocks} "
                             "(a block is lost)")
    for b in idle:
        if b not in pool._key_of:
            raise InvariantError(f"{where}: idle block {b} has no key")
    for k, b in pool._by_key.items():
        if pool._key_of.get(b) != k:
            raise InvariantError(f"{where}: key maps inconsistent for block {b}")
    ids_w = [id(s) for s in eng.waiting]
    ids_r = [id(s) for s in eng.running]
    if len(set(ids_w)) != len(ids_w) or len(set(ids_r)) != len(ids_r) or set(ids_w) & set(ids_r):
        raise InvariantError(f"{where}: duplicated sequence in waiting/running")
    for s in eng.waiting + eng.running:
        if id(s) not in eng.live:
            raise InvariantError(f"{where}: a released sequence is still queued")


@dataclass
class EngineCfg:
    name: str
    blocks: int | None  # None: large
    max_batch: int
    signals: str = "torch"
    cuda_graphs: bool = False
    mix_prefill: bool = False
    prefix_caching: bool = True
    max_prefill_tokens: int = 4096
    overlap: bool = False
    sampling: object = None
    prefill_hold: int = 0
    async_prefill: bool = False  # first tokens of a prefill read in step_finish (Engine(async_prefill=...))
    cascade: bool = True  # the shared prefix attended as a cascade in prefills (LlamaModel.cascade_prefill)
    paged: bool = False  # prefills attend through the paged prefill kernel (kernels/paged_prefill.py; interpreted
    #                      on a CPU), where that kernel can run here


def paged_prefill_module():
    """kernels/paged_prefill.py as the model holds it, or None where it cannot run (no Triton, or its kernels were
    imported compiled on a machine without a GPU)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (only matters if fastrag.kernels is not imported yet)
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import paged_prefill
    except ImportError:
        return None
    if not (torch.cuda.is_available() or INTERPRETED):
        return None
    from fastrag.model.llama import ModuleRef

    return ModuleRef(paged_prefill)


def build(wl, ec):
    from fastrag.engine import Engine

    hf, m, cfg = models(wl.V)
    m.cascade_prefill = ec.cascade  # (the model is shared between configurations: each engine sets its own)
    m.paged_prefill = paged_prefill_module() if ec.paged else None
    m._paged_prefill_on_cpu = m.paged_prefill is not None
    ec.paged = m.paged_prefill is not None  # (what ran: the summary line says it)
    c = m.c
    per_block = 2 * c.num_layers * wl.block_size * c.num_kv_heads * c.head_dim * 4
    blocks = ec.blocks if ec.blocks is not None else 4000
    eng = Engine(m, IdTok(wl.V, wl.eos), block_size=wl.block_size, kv_cache_gb=(blocks + 0.5) * per_block / 2**30,
                 max_batch=ec.max_batch, signals=ec.signals, mix_prefill=ec.mix_prefill,
                 cuda_graphs=ec.cuda_graphs, prefix_caching=ec.prefix_caching,
                 max_prefill_tokens=ec.max_prefill_tokens, sampling=ec.sampling, prefill_hold=ec.prefill_hold,
                 async_prefill=ec.async_prefill)
    assert eng.pool.num_blocks == max(8, blocks), (eng.pool.num_blocks, blocks)
    return eng


def next_request(q: Q, wl: Workload, prefix_tokens):
    """The next generation of question q: (prompt, max_new, track_from, carried, oneshot) or None when done."""
    if q.rnd >= len(q.spec["rounds"]):
        return None
    rd = q.spec["rounds"][q.rnd]
    pre = prefix_tokens(q.spec["pre"])
    base = pre + q.spec["q"]
    kind = rd["kind"]
    track, carried, oneshot = None, False, False
    if q.last_prompt is None:
        kind = "fresh" if kind in ("continue", "track_cont") else kind
    if kind == "fresh":
        prompt = base + q.text
    elif kind == "continue":  # a chunk resumed exactly where it stopped (suffix_ids)
        prompt = q.last_prompt + q.last_ids
    elif kind == "track_cont":  # continue the same tracked span (DRAGIN streaming in-context attention)
        prompt = q.last_prompt + q.last_ids
        if q.track_from is not None:
            track, carried = q.track_from, True
        else:
            track = len(prompt)
    elif kind == "track_new":  # a new tracked span starting at the prompt's end
        prompt = base + q.text
        track = len(prompt)
    elif kind == "rebuild":  # retrieval: docs spliced after the prefix, text cut at a sentence start
        cut = int(len(q.text) * rd["cut"])
        k = int(len(q.spec["q"]) * rd["splice"])  # docs spliced inside the question (cut inside shared blocks)
        prompt = pre + q.spec["q"][:k] + rd["docs"] + q.spec["q"][k:] + q.text[:cut]
        q.text = q.text[:cut]
    elif kind == "oneshot":
        prompt = pre + rd["docs"] + q.spec["q"] + q.text
        oneshot = True
    return prompt, rd["max_new"], track, carried, oneshot


def run_workload(wl: Workload, ec: EngineCfg, check_every_step=True, verbose=False):
    eng = build(wl, ec)
    # count the prompt tokens each generation really computes (prefill rows, and prompt tokens fed by decode steps)
    computed_prompt = {}
    notes = []
    real_prefill = eng.runner.prefill

    def counting_prefill(items, want_logits, decode=False):
        for s, ids in items:
            if s.out is None:
                continue
            if not decode:
                computed_prompt[id(s)] = computed_prompt.get(id(s), 0) + len(ids)
            elif s.computed < s.out.prompt_tokens:
                computed_prompt[id(s)] = computed_prompt.get(id(s), 0) + 1
        return real_prefill(items, want_logits, decode)

    eng.runner.prefill = counting_prefill
    real_graphed = eng.runner.decode_graphed

    def counting_graphed(seqs, heads):
        before = [(s, s.computed) for s in seqs]
        out = real_graphed(seqs, heads)
        if out is not None:
            for s, c in before:
                if s.out is not None and c < s.out.prompt_tokens:
                    computed_prompt[id(s)] = computed_prompt.get(id(s), 0) + 1
        return out

    eng.runner.decode_graphed = counting_graphed
    pre_objs = []
    for p in wl.prefixes:
        pre_objs.append(eng.set_prefix(" ".join(map(str, p))))
    late_obj = [None]

    def prefix_tokens(choice):
        if choice is None:
            return []
        if choice == -1:
            return list(wl.late_prefix)
        return list(wl.prefixes[choice])

    check_invariants(eng, "after set_prefix")
    free0 = eng.pool.num_free
    qs = [Q(i, s, wl) for i, s in enumerate(wl.questions)]
    recs: list[Rec] = []
    passes = []  # (kind, ids, result)
    step = 0
    active = {}  # id(seq) -> q
    pr = random.Random(wl.seed * 7 + 1)  # attention-pass contents: same in every config

    def start_next(q: Q):
        req = next_request(q, wl, prefix_tokens)
        if req is None:
            q.done = True
            return
        prompt, max_new, track, carried, oneshot = req
        if oneshot:
            s = eng.new_sequence()
            q.oneshot = s
        else:
            if q.seq is None:
                q.seq = eng.new_sequence()
            s = q.seq
        kw = {} if track is None else {"track_from": track}
        if ec.sampling is not None:
            kw["sample_key"] = q.qi * 1000 + q.rnd
        st0 = dict(eng.stats)
        eng.start(s, prompt, max_new, **kw)
        computed_prompt[id(s)] = 0
        hit = {k: eng.stats[k] - st0[k] for k in ("prefix_hit_tokens", "own_hit_tokens", "cached_hit_tokens")}
        if hit["prefix_hit_tokens"] != s.base:
            notes.append(f"prefix_hit_tokens grew by {hit['prefix_hit_tokens']} for a prefix of {s.base}")
        want = max((p.length for p in eng.prefixes if p.matches(prompt)), default=0)
        if s.base != want:
            notes.append(f"start picked a prefix of {s.base} tokens, the longest held match is {want}")
        if s.prefix is not None and prompt[: s.base] != s.prefix.token_ids:
            notes.append("sequence prefix does not match its prompt")
        acc = s.base + hit["own_hit_tokens"] + hit["cached_hit_tokens"] + s.out.prefilled
        if acc != len(prompt):
            notes.append(f"start: prefix {s.base} + own {hit['own_hit_tokens']} + cached {hit['cached_hit_tokens']} "
                         f"+ prefilled {s.out.prefilled} != prompt {len(prompt)}")
        q.cur = (s, prompt, max_new, track, carried)
        active[id(s)] = q

    def finish_gen(q: Q, s, released=False):
        _, prompt, max_new, track, carried = q.cur
        out = s.out
        attn = out.attn
        if not released and computed_prompt.get(id(s)) != out.prefilled:
            notes.append(f"q{q.qi} r{q.rnd}: Generation.prefilled = {out.prefilled} but {computed_prompt.get(id(s))} "
                         f"prompt tokens were computed (prompt {len(prompt)}, track {track})")
        if released and s.amax is not None:
            attn = None
        recs.append(Rec(q.qi, q.rnd, list(prompt), max_new, track, list(out.ids), list(out.entropy),
                        list(out.logprob), out.ended_by_eos, None if attn is None else list(attn), released,
                        out.prefilled, carried))
        active.pop(id(s), None)
        if released:
            eng.release(s)
            if q.seq is not None and q.seq is not s:
                eng.release(q.seq)
            q.done = True
            return
        if q.oneshot is s:
            eng.release(s)
            q.oneshot = None
        else:
            q.last_prompt, q.last_ids = list(prompt), list(out.ids)
            q.track_from = track
        q.text = q.text + list(out.ids)
        q.rnd += 1
        start_next(q)
        if q.done and q.seq is not None:
            eng.release(q.seq)

    pending = [q for q in qs]
    released_ids = set()
    while True:
        # admit questions whose delay has passed
        for q in list(pending):
            if q.spec["start_delay"] <= step:
                pending.remove(q)
                if q.spec["pre"] == -1 and late_obj[0] is None:
                    from fastrag.cache.kv import OutOfBlocks
                    try:
                        late_obj[0] = eng.set_prefix(" ".join(map(str, wl.late_prefix)))
                    except OutOfBlocks:  # no room now: its questions run without it (as the server does)
                        late_obj[0] = "none"
                start_next(q)
                if q.done and q.seq is not None:
                    eng.release(q.seq)
        if wl.drop_at is not None and step == wl.drop_at and pre_objs and pre_objs[0] is not None:
            eng.drop_prefix(pre_objs[0])
        if not eng.has_work and not pending:
            break
        if step > 5000:
            raise AssertionError("engine did not finish (5000 steps)")
        def do_releases(skip=()):  # releases after the k-th token of a round
            for q in qs:
                rel = q.spec["release"]
                if rel is None or q.done or q.cur is None or q.rnd != rel[0]:
                    continue
                s = q.cur[0]
                if id(s) in active and s.out is not None and len(s.out.ids) >= rel[1] and \
                        not any(s is x for x in skip):
                    released_ids.add(id(s))
                    finish_gen(q, s, released=True)

        if ec.overlap and eng.has_work:
            st = eng.step_launch()
            # the caller may release sequences between launch and finish (here not those the launch's prefill
            # finished, as a caller stepping without overlap gets them first; test_engine_fuzz.py checks that
            # step_finish drops such a released one)
            do_releases(skip=st.finished)
            finished = eng.step_finish(st)
        else:
            finished = eng.step() if eng.has_work else []
        step += 1
        fin_ids = [id(s) for s in finished]
        if len(set(fin_ids)) != len(fin_ids):
            raise InvariantError(f"step {step}: a sequence finished twice in one step")
        for s in finished:
            q = active.get(id(s))
            if q is None:
                if id(s) in released_ids:
                    notes.append(f"step {step}: step_finish returned a sequence released after step_launch")
                    continue
                raise InvariantError(f"step {step}: a finished sequence no question waits for")
            if s in eng.waiting or s in eng.running:
                raise InvariantError(f"step {step}: a finished sequence is still queued")
            finish_gen(q, s)
        do_releases()
        if wl.passes_every and step % wl.passes_every == 0:
            lists = [[pr.randrange(0, wl.V) for _ in range(pr.randint(1, 20))] for _ in range(pr.randint(1, 3))]
            kind = pr.choice(["colmax", "rows"])
            passes.append((kind, lists, eng.attention_passes(lists, kind)))
        if check_every_step:
            check_invariants(eng, f"{ec.name} step {step}")
    # every question done
    for q in qs:
        if not q.done:
            raise InvariantError(f"question {q.qi} lost (round {q.rnd})")
    if eng.live:
        raise InvariantError(f"{len(eng.live)} sequences still live after every question ended")
    check_invariants(eng, f"{ec.name} end")
    # the pool is back to where it was, less the prefixes still held (and set later)
    pinned_now = sum(len(p.blocks) for p in eng.prefixes)
    pinned_0 = sum(len(p.blocks) for p in {id(p): p for p in pre_objs if p is not None}.values())
    if eng.pool.num_free != free0 + pinned_0 - pinned_now:
        raise InvariantError(f"{ec.name}: free blocks {eng.pool.num_free} != start {free0} + {pinned_0} - {pinned_now}")
    eng.clear_prefixes()
    expect = eng.pool.num_blocks - (1 if eng.graphs is not None else 0)
    if eng.pool.num_free != expect:
        raise InvariantError(f"{ec.name}: after clear_prefixes {eng.pool.num_free} free != {expect}")
    return recs, passes, dict(eng.stats), step, notes


def key_of(r: Rec):
    return (r.qi, r.rnd)


def compare_runs(a, b, name_a, name_b, problems):
    ra = {key_of(r): r for r in a}
    rb = {key_of(r): r for r in b}
    # a question released mid-generation ends at a point that depends on the stepping mode (with overlap the release
    # comes between launch and finish, before the launch's decode token is appended): compare its common rounds
    cut = {r.qi for r in a + b if r.released}
    if {k for k in ra if k[0] not in cut} != {k for k in rb if k[0] not in cut}:
        problems.append(f"{name_a} vs {name_b}: different generations {sorted(set(ra) ^ set(rb))[:5]}")
    for k in sorted(set(ra) & set(rb)):
        x, y = ra[k], rb[k]
        if x.prompt != y.prompt:
            problems.append(f"{name_a} vs {name_b} q{k}: prompts differ")
            continue
        if x.released or y.released:  # the release point (tokens so far) depends on the stepping mode
            n = min(len(x.ids), len(y.ids))
            if x.ids[:n] != y.ids[:n]:
                problems.append(f"{name_a} vs {name_b} q{k}: released tokens {x.ids} vs {y.ids}")
            continue
        if x.ids != y.ids or x.ended_by_eos != y.ended_by_eos:
            problems.append(f"{name_a} vs {name_b} q{k}: tokens {x.ids} vs {y.ids}")
            continue
        for what in ("entropy", "logprob"):
            u, v = getattr(x, what), getattr(y, what)
            d = max((abs(p - q) for p, q in zip(u, v)), default=0.0)
            if d > TOL:
                problems.append(f"{name_a} vs {name_b} q{k}: {what} differs by {d:.2e}")
        if (x.attn is None) != (y.attn is None):
            problems.append(f"{name_a} vs {name_b} q{k}: attn None in one")
        elif x.attn is not None:
            d = max((abs(p - q) for p, q in zip(x.attn, y.attn)), default=0.0)
            if len(x.attn) != len(y.attn) or d > TOL:
                problems.append(f"{name_a} vs {name_b} q{k}: attn differs ({len(x.attn)} vs {len(y.attn)}, {d:.2e})")


def compare_ref(recs, wl, name, problems, hf):
    for r in recs:
        ids, ent, lp, eos, margins = ref_generation(hf, r.prompt, r.max_new, wl.eos)
        n = len(r.ids)
        if r.released:
            ok = r.ids == ids[:n]
        else:
            ok = r.ids == ids and r.ended_by_eos == eos
        if not ok:
            div = next((i for i, (p, q) in enumerate(zip(r.ids, ids)) if p != q), min(len(r.ids), len(ids)))
            if div < len(margins) and margins[div] < 1e-4:
                continue  # a near-tie (top-2 logits within 1e-4) flipped by float rounding: expected
            mn = min(margins[: n + 1]) if margins else None
            problems.append(f"{name} q{key_of(r)}: tokens {r.ids} (eos={r.ended_by_eos}) vs ref {ids} (eos={eos}); "
                            f"min top-2 margin {mn:.2e}; prompt len {len(r.prompt)} track {r.track_from}")
            continue
        for what, ref in (("entropy", ent), ("logprob", lp)):
            d = max((abs(p - q) for p, q in zip(getattr(r, what), ref)), default=0.0)
            if d > TOL:
                problems.append(f"{name} q{key_of(r)}: {what} differs from ref by {d:.2e}")
        if r.track_from is not None and r.attn is not None and not r.released:
            tokens = r.prompt + r.ids
            # fed queries: every token of the span except a length-capped generation's last sampled token
            fed_upto = len(tokens) - 1 if r.ended_by_eos else len(tokens) - 2
            want = ref_attn(hf, tokens, r.track_from, fed_upto)
            if len(want) != len(r.attn):
                problems.append(f"{name} q{key_of(r)}: attn length {len(r.attn)} vs ref {len(want)}")
            else:
                d = max((abs(p - q) for p, q in zip(r.attn, want)), default=0.0)
                if d > TOL:
                    i = max(range(len(want)), key=lambda i: abs(r.attn[i] - want[i]))
                    problems.append(f"{name} q{key_of(r)}: attn differs from ref by {d:.2e} at span index {i} "
                                    f"(got {r.attn[i]:.5f} want {want[i]:.5f}; track_from {r.track_from}, "
                                    f"prompt {len(r.prompt)}, carried {r.carried})")


def compare_passes(passes, name, problems, hf):
    for kind, lists, res in passes:
        for ids, got in zip(lists, res):
            if kind == "colmax":
                want = ref_colmax(hf, ids)
                d = max(abs(p - q) for p, q in zip(got, want))
            else:
                want = ref_rows(hf, ids)
                d = float((got - want).abs().max())
            if d > TOL:
                problems.append(f"{name}: attention pass {kind} over {len(ids)} tokens differs by {d:.2e}")


def stats_checks(stats, recs, name, problems, tight):
    for k, v in stats.items():
        if isinstance(v, int) and v < 0:
            problems.append(f"{name}: stats[{k}] = {v} < 0")
    if stats["evicted_tokens"] and not stats["evictions"]:
        problems.append(f"{name}: evicted_tokens without evictions")


def min_blocks(wl: Workload):
    """Fewest blocks the tight pool may have so that every start() is accepted: the longest own part of any
    generation, plus the pinned prefixes, plus the graph's scratch block."""
    hf, m, cfg = models(wl.V)
    bs = wl.block_size
    pinned = sum(len(p) // bs for p in wl.prefixes) + (len(wl.late_prefix) // bs if wl.late_prefix else 0)
    longest = 0
    for q in wl.questions:
        pre = 0 if q["pre"] is None else len(wl.late_prefix if q["pre"] == -1 else wl.prefixes[q["pre"]]) // bs * bs
        # a rough upper bound of the prompt: everything the question can accumulate
        tot = sum(rd["max_new"] for rd in q["rounds"])
        docs = max(len(rd["docs"]) for rd in q["rounds"])
        own = len(q["q"]) + docs + 2 * tot + max(rd["max_new"] for rd in q["rounds"]) + \
            (len(wl.late_prefix if q["pre"] == -1 else wl.prefixes[q["pre"]]) - pre if q["pre"] is not None else 0)
        longest = max(longest, -(-own // bs))
    return pinned + longest + 1


def exact_min_blocks(wl: Workload, recs):
    """From a run's generations: pinned prefix blocks + the largest own need of one generation + scratch."""
    bs = wl.block_size
    pres = [p[: len(p) // bs * bs] for p in wl.prefixes] + ([wl.late_prefix[: len(wl.late_prefix) // bs * bs]]
                                                           if wl.late_prefix else [])
    pinned = sum(len(p) // bs for p in pres)
    need = 0
    for r in recs:
        base = max((len(p) for p in pres if len(p) and len(r.prompt) > len(p) and r.prompt[: len(p)] == p),
                   default=0)
        need = max(need, -(-(len(r.prompt) - base + r.max_new) // bs))
    return pinned + need + 1


def run_seed(seed, signals="torch", verbose=False, tight_extra=None, do_ref=True, tight_over=None, no_drop=False,
             sampling=None):
    wl = make_workload(seed)
    if no_drop:
        wl.drop_at = None
    r = random.Random(seed + 99991)
    hf, _, _ = models(wl.V)
    big = EngineCfg("big-b1", None, 1, signals=signals, sampling=sampling)
    problems = []
    t0 = time.time()
    res = {}
    try:
        res[big.name] = run_workload(wl, big, verbose=verbose)
    except Exception as e:  # noqa: BLE001
        problems.append(f"{big.name}: {type(e).__name__}: {e}")
        return problems, {}, None, time.time() - t0
    lo = exact_min_blocks(wl, res[big.name][0])
    extra = r.choice([0, 0, 1, 2, 4]) if tight_extra is None else tight_extra
    tight = EngineCfg("tight", max(lo + extra, 8), r.choice([2, 3, 4, 8]), signals=signals,
                      cuda_graphs=r.random() < 0.4, mix_prefill=r.random() < 0.3,
                      prefix_caching=r.random() < 0.8, max_prefill_tokens=r.choice([16, 64, 4096]),
                      overlap=r.random() < 0.5, sampling=sampling, prefill_hold=r.choice([0, 0, 1, 3]),
                      cascade=r.random() < 0.5, async_prefill=r.random() < 0.5, paged=r.random() < 0.3)
    if tight_over:
        for k, v in tight_over.items():
            setattr(tight, k, v)
    try:
        res[tight.name] = run_workload(wl, tight, verbose=verbose)
    except Exception as e:  # noqa: BLE001
        import traceback

        problems.append(f"{tight.name}: {type(e).__name__}: {e}")
        if verbose:
            traceback.print_exc()
    if "tight" in res and "big-b1" in res:
        compare_runs(res["tight"][0], res["big-b1"][0], "tight", "big-b1", problems)
    ntok = 0
    for name, (recs, passes, stats, steps, notes) in res.items():
        seen_kinds = {}
        for n in notes:
            seen_kinds.setdefault(n.split(":")[0].split(" = ")[0][:40], n)
        problems += [f"{name}: {n}" for n in seen_kinds.values()]
        if do_ref:
            compare_ref(recs, wl, name, problems, hf)
            compare_passes(passes, name, problems, hf)
        stats_checks(stats, recs, name, problems, name == "tight")
        ntok += sum(len(x.ids) for x in recs)
    info = {name: dict(steps=v[3], gens=len(v[0]), kv_waits=v[2]["kv_waits"], evictions=v[2]["evictions"],
                       evicted_tokens=v[2]["evicted_tokens"], cached_hit=v[2]["cached_hit_tokens"],
                       prefix_hit=v[2]["prefix_hit_tokens"], eos=sum(x.ended_by_eos for x in v[0]),
                       tracked=sum(x.track_from is not None for x in v[0]), passes=len(v[1]))
            for name, v in res.items()}
    info["tokens"] = ntok
    return problems, info, tight, time.time() - t0


def parse_seeds(s):
    out = []
    for part in s.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--signals", default="torch")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--no-drop", action="store_true", help="no explicit drop_prefix mid-run")
    ap.add_argument("--sample", action="store_true", help="temperature 0.8 / top-p 0.9 with per-generation keys: "
                    "tight vs big only (no greedy reference)")
    ap.add_argument("--scale", type=int, default=1, help="questions per workload x this")
    args = ap.parse_args()
    global SCALE
    SCALE = args.scale
    torch.set_num_threads(1)
    bad = 0
    tot = dict(gens=0, kv_waits=0, evictions=0, cached_hit=0, eos=0, tracked=0, passes=0)
    for seed in parse_seeds(args.seeds):
        sampling = None
        if args.sample:
            from fastrag.engine import SamplingParams
            sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
        problems, info, tight, dt = run_seed(seed, args.signals, args.verbose,
                                             do_ref=not args.no_ref and not args.sample, no_drop=args.no_drop,
                                             sampling=sampling)
        t = info.get("tight", {})
        for k in tot:
            tot[k] += t.get(k, 0)
        if tight is None:
            print(f"seed {seed}: FAIL {problems}")
            bad += 1
            continue
        print(f"seed {seed}: {'OK' if not problems else 'FAIL'} {dt:.1f}s tight(blocks={tight.blocks}, "
              f"batch={tight.max_batch}, graphs={tight.cuda_graphs}, mix={tight.mix_prefill}, "
              f"pc={tight.prefix_caching}, mpt={tight.max_prefill_tokens}, ov={tight.overlap}, "
              f"hold={tight.prefill_hold}, async={tight.async_prefill}, cascade={tight.cascade}, "
              f"paged={tight.paged}) {info}", flush=True)
        for p in problems[:12]:
            print("   ", p)
        bad += bool(problems)
    print(f"{bad} failing seeds; totals (tight runs): {tot}")


if __name__ == "__main__":
    main()
