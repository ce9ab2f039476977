"""Paged KV cache: a pool of fixed-size blocks per layer, reference-counted, with per-sequence block tables.

k/v pools: per layer `[H_kv, num_blocks * block_size, D]` (per kv head, so a gathered context is contiguous);
slot `s = block * block_size + offset`.
A shared prefix (the few-shot demos) owns whole blocks only, so no sequence ever writes into a shared block
and no copy-on-write is needed; the tail of the prefix that does not fill a block is each sequence's own.

Prefix caching: a full block of a sequence's own tokens can be registered under a key naming its content (the
tokens before it and its own, `chain_keys`). When its last holder releases it, the block keeps that content and
stays findable until the pool needs it for something else (free blocks holding nothing are handed out first,
then cached ones, least recently released first). A later sequence whose tokens start the same way shares the
registered blocks (`lookup`, `share`) and prefills only the rest: one-shot prompts of one question that repeat a
stem or a retrieved passage, two sequences started together. Shared blocks are full and never written: a
sequence writes only past its last full shared block, and `BlockTable.truncate` drops a shared block it would
cut into instead of overwriting it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from fastrag.transfer import tensor_on


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs (the scheduler waits or preempts)."""


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu", zero_at_start: bool | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        if zero_at_start is not None and not isinstance(zero_at_start, bool):
            raise ValueError(f"zero_at_start must be a bool or None, got {zero_at_start!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        n = num_blocks * block_size
        # Every block is zero before its first use (attention reads the unwritten tail of a sequence's last block
        # with weight 0, and 0 * NaN from never-written memory would poison the output); later it only holds finite
        # stale values. On a CPU the pool starts uninitialised, costing no memory until its blocks are used, and
        # each block is zeroed when it is first handed out. On a GPU the memory is held from the start anyway, so
        # the whole pool is zeroed now, one fill a tensor (a one-off at the device's copy bandwidth). Zeroing at
        # first use cost each allocation of fresh blocks an upload and two fills a layer, 65 launches for a
        # 32-layer model in the middle of a step's launch, and with prefix caching most of a run's allocations are
        # fresh blocks.
        self.zero_at_start = torch.device(device).type == "cuda" if zero_at_start is None else zero_at_start
        self.k = [torch.empty(num_kv_heads, n, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(num_kv_heads, n, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        if self.zero_at_start:
            for t in self.k + self.v:
                t.zero_()
        self._zeroed = [self.zero_at_start] * num_blocks
        self._zero_fresh([0])  # block 0 also pads short rows of a batch's block table
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # stack of blocks holding nothing: low block ids first
        # prefix cache: content key -> block, block -> its key, and the unheld cached blocks in release order
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (those holding nothing, and cached blocks no sequence holds)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or not) that a lookup can find."""
        return len(self._by_key)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.pop())
            else:  # reuse the least recently released cached block: its content is forgotten
                b, _ = self._idle.popitem(last=False)
                self.unregister(b)
                out.append(b)
        for b in out:
            self.refcount[b] = 1
        self._zero_fresh(out)
        return out

    # ------------------------------------------------------------------ prefix cache
    def register(self, block: int, key: bytes) -> None:
        """Name a held, full block's content. A key another block already holds keeps that block (the first copy
        stays the one lookups find); a block re-registered under a new key forgets the old one."""
        assert self.refcount[block] > 0, f"registering free block {block}"
        if self._key_of.get(block) == key or key in self._by_key:
            return
        self.unregister(block)
        self._by_key[key] = block
        self._key_of[block] = key

    def unregister(self, block: int) -> None:
        """Forget a block's content (it is about to be overwritten)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._by_key[key]
        if self._idle.pop(block, 0) is None:  # an unheld cached block now holds nothing findable
            self._free.append(block)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run keys[0], keys[1], ... that the cache holds (not yet shared: pass them to
        `share` to hold them)."""
        out = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def _zero_fresh(self, blocks: list[int]) -> None:
        fresh = [b for b in blocks if not self._zeroed[b]]
        if fresh:
            idx = tensor_on(fresh, self.k[0].device)  # (a plain torch.tensor(..., device=) would wait for the GPU)
            for t in self.k + self.v:
                t.view(t.shape[0], self.num_blocks, self.block_size, t.shape[-1]).index_fill_(1, idx, 0)
            for b in fresh:
                self._zeroed[b] = True

    def share(self, blocks: list[int]) -> None:
        """Hold blocks once more: blocks in use, or cached blocks no sequence holds (found by `lookup`)."""
        for b in blocks:
            if self.refcount[b] == 0:
                assert b in self._idle, f"sharing free block {b}"
                del self._idle[b]
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refcount[b] > 0, f"double free of block {b}"
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if b in self._key_of:  # keeps its content for later lookups until the pool needs the block
                    self._idle[b] = None
                else:
                    self._free.append(b)


def chain_keys(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """Content keys of the full blocks of `tokens` (positions after what `root` names): key j hashes key j-1 (root
    for j = 0) with block j's token ids, so equal keys mean equal tokens from the root through that block."""
    out, prev = [], root
    for j in range(len(tokens) // block_size):
        blk = array("q", tokens[j * block_size: (j + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + blk, digest_size=16).digest()
        out.append(prev)
    return out


def blocks_needed(ctx: list[tuple[list[int], int]], block_size: int) -> int:
    """The most blocks any of ctx's (blocks, entries) sequences uses."""
    return max(-(-n // block_size) for _, n in ctx)


def block_table_tensor(ctx: list[tuple[list[int], int]], block_size: int, rows: int, cols: int,
                       fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors of a batch's block tables: ([rows, cols] block ids, [rows] entries), one row per (blocks,
    entries) of ctx, each row's unused columns and the rows past len(ctx) holding `fill` (entries 1 there)."""
    # built in numpy (a row slice takes the list as it is) and shared with torch without a copy: on a graphed
    # decode step this is most of the launch's host work, about 10x less than a torch.tensor per row
    tab = np.full((rows, cols), fill, dtype=np.int64)
    lens = np.ones(rows, dtype=np.int64)
    for b, (blocks, n) in enumerate(ctx):
        nb = -(-n // block_size)
        tab[b, :nb] = blocks[:nb]
        lens[b] = n
    return torch.from_numpy(tab), torch.from_numpy(lens)


@dataclass(eq=False)
class BlockTable:
    """The blocks one sequence owns, holding its tokens after the shared prefix (positions base, base+1, ...)."""

    pool: KVPool
    base: int = 0  # absolute position of the first token held here (= shared prefix length)
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV is written

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slots of the held tokens [start, end) (indices relative to base)."""
        bs = self.pool.block_size
        return [self.blocks[i // bs] * bs + i % bs for i in range(start, end)]

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more tokens (allocates whole blocks)."""
        bs = self.pool.block_size
        need = -(-(self.num_tokens + n_new) // bs) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.allocate(need)

    def truncate(self, n: int) -> None:
        """Keep the first n held tokens; free the blocks past them.

        The block the cut falls inside is written again by what follows: when another sequence holds it too, it
        is given up as well (the kept tokens end at the block before: check `num_tokens`); when it is cached,
        its content key is forgotten."""
        bs = self.pool.block_size
        n = min(n, self.num_tokens)
        if n % bs and n // bs < len(self.blocks):
            b = self.blocks[n // bs]
            if self.pool.refcount[b] > 1:
                n -= n % bs
            else:
                self.pool.unregister(b)
        keep = -(-n // bs)
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
        self.num_tokens = n

    def free(self) -> None:
        self.truncate(0)


@dataclass
class SharedPrefix:
    """A prefix computed once and shared (by reference count) by every sequence that starts with its tokens."""

    token_ids: list[int]  # exactly the block-aligned tokens whose KV is held
    blocks: list[int]
    slots: torch.Tensor  # [P] pool slots, P = len(token_ids)
    key: bytes = b""  # names the prefix's tokens: the root of the content keys of the blocks that follow it

    def __post_init__(self):
        if not self.key:
            self.key = hashlib.blake2b(array("q", self.token_ids).tobytes(), digest_size=16).digest()

    @property
    def start(self) -> int:
        """First slot if the prefix occupies consecutive slots (read as a view, no gather), else -1."""
        s = self.slots
        if len(s) and int(s[-1]) - int(s[0]) == len(s) - 1 and bool((s.diff() == 1).all()):
            return int(s[0])
        return -1

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def matches(self, ids: list[int]) -> bool:
        return len(ids) > self.length and ids[: self.length] == self.token_ids
