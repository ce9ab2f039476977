"""The prefix / KV registry: the shared prefixes the engine holds, the live sequences that may hold blocks, and the
prefix cache's bookkeeping (adopting cached blocks, naming computed ones, evicting idle sequences' caches)."""

from __future__ import annotations

import itertools

from fastrag.cache.kv import BlockTable, KVPool, SharedPrefix, chain_keys
from fastrag.engine.sequence import SeqState


class PrefixRegistry:
    """Which blocks are whose: shared prefixes (one per method/dataset prompt family, several at once), each with its
    first slot when its slots are consecutive (else -1), and the engine's live sequences by id."""

    def __init__(self, pool: KVPool, stats: dict):
        self.pool, self.stats = pool, stats
        self.prefixes: list[SharedPrefix] = []  # shared prefixes, in the order they were set
        self.starts: dict[int, int] = {}  # id(prefix) -> first slot when its slots are consecutive, else -1
        self.live: dict[int, SeqState] = {}  # sequences that may hold blocks

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> SeqState:
        s = SeqState(table=BlockTable(self.pool))
        self.live[id(s)] = s
        return s

    def drop_cache(self, s: SeqState) -> None:
        """Free the sequence's own blocks and its share of its prefix; its tokens are forgotten."""
        s.table.free()
        if s.prefix is not None:
            self.pool.release(s.prefix.blocks)
            s.prefix = None
        s.tokens = []

    # ------------------------------------------------------------------ shared prefixes
    @property
    def latest(self) -> SharedPrefix | None:
        """The most recently set shared prefix."""
        return self.prefixes[-1] if self.prefixes else None

    def held(self, ids: list[int]) -> SharedPrefix | None:
        """The held prefix of exactly these tokens, if any."""
        for p in self.prefixes:
            if p.token_ids == ids:
                return p
        return None

    def add(self, pre: SharedPrefix) -> None:
        self.prefixes.append(pre)
        self.starts[id(pre)] = pre.start

    def start_of(self, prefix: SharedPrefix | None) -> int:
        """The prefix's first slot when its slots are consecutive, else -1 (and -1 for no prefix)."""
        return self.starts.get(id(prefix), -1) if prefix else -1

    def drop(self, p: SharedPrefix) -> None:
        """Give back the engine's hold on one shared prefix (sequences still using it keep its blocks alive);
        one not held: nothing."""
        if not any(x is p for x in self.prefixes):
            return
        self.pool.release(p.blocks)
        self.prefixes = [x for x in self.prefixes if x is not p]
        self.starts.pop(id(p), None)

    def idle(self, keep: SharedPrefix | None = None) -> list[SharedPrefix]:
        """The held prefixes no live sequence starts from (keep excepted)."""
        used = {id(s.prefix) for s in self.live.values() if s.prefix is not None}
        return [p for p in self.prefixes if id(p) not in used and p is not keep]

    def drop_idle(self, keep: SharedPrefix | None = None) -> int:
        """Free the blocks of the prefixes no live sequence uses (the last resort before a request is refused
        for lack of room: e.g. a server that has seen many prompt families). Returns the blocks freed."""
        idle = self.idle(keep)
        for p in idle:
            self.drop(p)
        return sum(len(p.blocks) for p in idle)

    def graph_sets(self) -> list[list[tuple]]:
        """The prefix sets whose decode graphs `Engine.capture_graphs` captures ahead, each (prefix, first slot) pairs:
        each prefix alone, every set of two or more when they are 2 or 3, all of them together when more; no prefix
        when none is held."""
        held = [(p, self.starts.get(id(p), -1)) for p in self.prefixes]
        sets = [[h] for h in held] or [[(None, -1)]]
        sizes = range(2, len(held) + 1) if len(held) <= 3 else [len(held)]
        for r in sizes:  # (each set in the order ModelRunner.decode_graphed gives its prefixes)
            sets += [sorted(c, key=lambda h: id(h[0])) for c in itertools.combinations(held, r)]
        return sets

    def pinned_blocks(self, scratch: int) -> int:
        """Blocks no sequence can ever get: the shared prefixes' and `scratch` more (the decode and prefill graphs'
        scratch blocks)."""
        return sum(len(p.blocks) for p in self.prefixes) + scratch

    # ------------------------------------------------------------------ a generation's cache
    def attach(self, s: SeqState, prompt_ids: list[int], max_new_tokens: int, track_from: int | None, pinned: int,
               prefix_caching: bool) -> None:
        """Set a new generation's prompt on s: the longest held prefix it starts with, the longest common prefix
        with its own computed tokens (kept), the prompt still to prefill and its blocks' content keys. A sequence
        that could not hold its blocks even alone in the pool is refused (a ValueError for its caller only)."""
        pre = max((p for p in self.prefixes if p.matches(prompt_ids)), key=lambda p: p.length, default=None)
        # a sequence that could not hold its blocks even alone in the pool would wait forever: refuse it here, so
        # the caller (the scheduler: this question only) gets the error, not the whole run at a later step
        own = len(prompt_ids) - (pre.length if pre is not None else 0) + max_new_tokens
        room = self.pool.num_blocks - pinned
        if -(-own // self.pool.block_size) > room:  # prefixes nobody uses give their blocks back first
            room += self.drop_idle(keep=pre)
        if -(-own // self.pool.block_size) > room:
            raise ValueError(f"a sequence of {own} tokens after its shared prefix ({len(prompt_ids)} prompt + "
                             f"{max_new_tokens} new) needs more than the {room} KV blocks of "
                             f"{self.pool.block_size} tokens the pool can ever give one sequence "
                             f"({self.pool.num_blocks} in all); raise --kv-cache-gb")
        if pre is not s.prefix:  # prefix changes: the own cache is relative to the old base, drop it
            self.drop_cache(s)
            if pre is not None:
                self.pool.share(pre.blocks)
            s.prefix = pre
        base = s.base
        if pre is not None:
            self.stats["prefix_hit_tokens"] += base
        # longest common prefix with the sequence's own computed tokens; keep >= 1 token to prefill (logits)
        own_prev = s.tokens[base: s.computed]
        own_new = prompt_ids[base:]
        lcp = 0
        limit = min(len(own_prev), len(own_new) - 1)
        while lcp < limit and own_prev[lcp] == own_new[lcp]:
            lcp += 1
        s.table.truncate(lcp)
        lcp = s.table.num_tokens  # one less block when the cut fell inside a block shared with another sequence
        self.stats["own_hit_tokens"] += lcp
        s.tokens = list(prompt_ids)
        s.pending_prompt = prompt_ids[base + lcp:]
        s.max_new = max_new_tokens
        bs = self.pool.block_size
        if prefix_caching:
            own = len(prompt_ids) - 1 if track_from is None else min(len(prompt_ids) - 1, track_from)
            s.adoptable = max(own - base, 0) // bs
            root = pre.key if pre is not None else b""
            s.keys = chain_keys(root, prompt_ids[base:], bs)
        else:
            s.keys, s.adoptable = [], 0

    def adopt_cached(self, s: SeqState) -> bool:
        """Replace the sequence's own cache by the cached blocks of its prompt when they hold more of it; the
        prompt still to prefill shrinks to match. Returns whether it did."""
        bs = self.pool.block_size
        have = s.table.num_tokens // bs
        if s.adoptable <= have:
            return False
        hit = self.pool.lookup(s.keys[: s.adoptable])
        if len(hit) <= have:
            return False
        self.pool.share(hit)  # before the own blocks go: they may be among the hits
        # (the own tokens kept so far, a partial last block's included, are already in own_hit_tokens)
        self.stats["cached_hit_tokens"] += len(hit) * bs - s.table.num_tokens
        s.table.free()
        s.table.blocks, s.table.num_tokens = hit, len(hit) * bs
        end = len(s.tokens) if s.track_from is None else max(s.track_from, s.computed)
        s.pending_prompt = s.tokens[s.computed: end]
        s.out.prefilled = len(s.tokens) - s.computed
        return True

    def register(self, s: SeqState, before: int) -> None:
        """Name the prompt blocks this prefill completed (own tokens `before` -> now) in the prefix cache."""
        bs = self.pool.block_size
        for j in range(before // bs, min(s.table.num_tokens // bs, len(s.keys))):
            self.pool.register(s.table.blocks[j], s.keys[j])

    def evict_idle(self, keep: SeqState, running: list[SeqState], waiting: list[SeqState]) -> bool:
        """Free the own caches of sequences that are not decoding (waiting for a prefill, or between two
        generations of their question); they prefill their whole prompt again when they next run. A sequence
        between two generations also lets go of its shared prefix (its next start shares a prefix still held):
        a prefix dropped by `Engine.drop_prefix`, or one no waiting or running sequence uses, can then give its
        blocks back, which the room a start() was promised counted on."""
        running = {id(s) for s in running}
        waiting = {id(s) for s in waiting}
        freed = False
        for s in self.live.values():
            if s is keep or id(s) in running:
                continue
            if id(s) not in waiting and s.prefix is not None:  # (its tokens stay: callers read them)
                self.pool.release(s.prefix.blocks)
                s.prefix = None
            if not s.table.blocks:  # a prefix share alone: no own block comes back, so no eviction counted
                continue
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += s.table.num_tokens
            s.table.free()
            if id(s) in waiting:
                s.pending_prompt = s.tokens[s.base: s.track_from]  # tracked tokens are fed by decode steps
                s.out.prefilled = len(s.tokens) - s.base
            freed = True
        # the last resort: the blocks of shared prefixes no live sequence starts from
        return freed or self.drop_idle(keep=keep.prefix) > 0
