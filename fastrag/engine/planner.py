"""The step planner: from the sequences waiting and running and the engine's budgets (batch size, prefill tokens,
prefill hold, KV room), what the next step prefills and which sequences join the decode batch. Its decisions are
a `StepPlan`, which the engine's model runner executes (the contract between planning and running)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastrag.cache.kv import KVPool, OutOfBlocks
from fastrag.engine.registry import PrefixRegistry
from fastrag.engine.sequence import SeqState


@dataclass(eq=False)
class StepPlan:
    """One step's decisions, made before any of its kernels runs."""

    # the prefill group: each sequence with the prompt tokens it prefills now (its blocks reserved)
    prefill: list[tuple[SeqState, list[int]]] = field(default_factory=list)
    # waiting sequences with nothing to prefill that joined the decode batch (their tokens are fed by decode steps)
    fed: list[SeqState] = field(default_factory=list)
    held: bool = False  # the waiting prefills were left for a later step (prefill_hold)
    # the decode batch, set when the step launches: the running sequences after the prefill (those whose first
    # token is still in flight excepted), at most max_batch
    decode: list[SeqState] = field(default_factory=list)

    @property
    def group(self) -> list[SeqState]:
        return [s for s, _ in self.prefill]


class StepPlanner:
    """The engine's queues (`waiting`: need a prefill; `running`: decoding) and the rules that move sequences from
    one to the other."""

    def __init__(self, pool: KVPool, registry: PrefixRegistry, stats: dict, *, max_batch: int,
                 max_prefill_tokens: int, prefill_hold: int, mix_prefill: bool, prefix_caching: bool):
        self.pool, self.registry, self.stats = pool, registry, stats
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.prefill_hold, self.mix_prefill, self.prefix_caching = prefill_hold, mix_prefill, prefix_caching
        self.waiting: list[SeqState] = []  # need prefill
        self.running: list[SeqState] = []  # decoding
        self.held = 0  # consecutive steps the waiting prefills were held

    def plan(self) -> StepPlan:
        """Admit what can decode without a prefill, then choose the prefill group: sequences of one shared prefix
        (any, with mix_prefill), shortest first, within the batch, the token budget and the KV pool (an admission
        that finds too few free blocks waits for running sequences to finish; with nothing running, idle sequences'
        caches are evicted first). A sequence whose next block another member of the group computes waits a step
        and then shares it."""
        plan = StepPlan()
        if self.waiting:
            plan.fed = self.admit_fed()
        if not self.waiting:
            return plan
        if self.hold_prefill():
            plan.held = True
            return plan
        if self.prefix_caching:  # blocks computed since a sequence started (by the last step's prefill)
            for s in self.waiting:
                if s.pending_prompt:
                    self.registry.adopt_cached(s)
        group, budget = [], self.max_prefill_tokens
        computing: set[bytes] = set()  # content keys of the blocks the group's prefill completes
        bs = self.pool.block_size
        # (sequences with nothing to prefill, left by admit_fed for lack of room, go last and wait)
        self.waiting.sort(key=lambda s: (not s.pending_prompt, s.prefix is None, len(s.pending_prompt)))
        i = 0
        while i < len(self.waiting) and self.waiting[i].pending_prompt \
                and len(self.running) + len(group) < self.max_batch:
            s = self.waiting[i]
            n = len(s.pending_prompt)
            nxt = s.table.num_tokens // bs
            if computing and nxt < s.adoptable and s.keys[nxt] in computing:
                i += 1  # its next block is being computed for another sequence: it shares it next step
                continue
            if group and s.prefix is not group[0].prefix and not self.mix_prefill:
                break
            # the token budget counts real tokens: a batch of very different lengths runs packed (no padding)
            if group and sum(len(x.pending_prompt) for x in group) + n > budget:
                break
            try:
                s.table.reserve(len(s.tokens) - s.computed + s.max_new)
            except OutOfBlocks:
                if group or self.running:
                    self.stats["kv_waits"] += 1
                    break  # wait for running sequences to finish and free blocks
                if not self.registry.evict_idle(s, self.running, self.waiting):
                    raise OutOfBlocks(f"the KV pool ({self.pool.num_blocks} blocks of {self.pool.block_size}) "
                                      f"cannot hold one sequence of {s.computed + n + s.max_new} tokens; "
                                      "raise --kv-cache-gb") from None
                continue
            group.append(self.waiting.pop(i))
            end = min(s.computed + n - s.base, len(s.keys) * bs) // bs
            computing.update(s.keys[nxt:end])
        plan.prefill = [(s, s.pending_prompt) for s in group]
        return plan

    def requeue(self, group: list[SeqState]) -> None:
        """A prefill group whose forward failed waits again as it was (its blocks reserved, nothing computed)."""
        self.waiting[:0] = group

    def decode_batch(self, joining: list[SeqState]) -> list[SeqState]:
        """This step's decode batch: the running sequences but those whose first token is still in flight
        (async_prefill: in `running` already, so nothing else takes their place, but decoding from the next step)."""
        decodable = self.running
        if joining:
            pending = {id(s) for s in joining}
            decodable = [s for s in self.running if id(s) not in pending]
        return decodable[: self.max_batch]

    def admit_fed(self) -> list[SeqState]:
        """Waiting sequences with nothing to prefill (their next tokens are fed by decode steps) join the decode
        batch directly, as far as the batch and the KV pool have room. Returns those that joined."""
        fed = []
        for s in [s for s in self.waiting if not s.pending_prompt]:
            if len(self.running) >= self.max_batch:
                break
            try:
                s.table.reserve(len(s.tokens) - s.computed + s.max_new)
            except OutOfBlocks:
                if self.running:
                    self.stats["kv_waits"] += 1
                    break  # wait for running sequences to finish and free blocks
                if not self.registry.evict_idle(s, self.running, self.waiting):
                    raise OutOfBlocks(f"the KV pool ({self.pool.num_blocks} blocks of {self.pool.block_size}) "
                                      f"cannot hold one sequence of {len(s.tokens) + s.max_new} tokens; "
                                      "raise --kv-cache-gb") from None
                return fed  # evicted sequences may need a prefill again: the next step sorts it out
            self.waiting.remove(s)
            self.running.append(s)
            fed.append(s)
        return fed

    def hold_prefill(self) -> bool:
        """Whether this step leaves the waiting prefills for a later one (prefill_hold): only while sequences decode
        (the step does work without them), while what waits is less than one prefill's token budget, and for at most
        prefill_hold steps in a row."""
        if not self.prefill_hold or not self.running or self.held >= self.prefill_hold \
                or sum(len(s.pending_prompt) for s in self.waiting) >= self.max_prefill_tokens:
            self.held = 0
            return False
        self.held += 1
        self.stats["prefill_holds"] += 1
        return True
