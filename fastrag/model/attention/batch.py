"""What a forward's attention reads: where a batch of new tokens reads and writes its KV (`AttnBatch`), the shared
prefixes it starts with (`PrefixGroup`), a cascade prefill's masks (`CascadeMask`), and the helpers every attention
path uses to build masks and to read or write the paged pool."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastrag.transfer import tensor_on


@dataclass(slots=True)
class AttnBatch:
    """Where a padded batch of new tokens reads and writes its KV.

    write_slots: [N]        pool slot of each valid new token (row-major over the batch, padding skipped)
    valid:       [B, T]     bool, which new-token positions are real
    positions:   [B, T]     absolute position of each new token (0 for padding)
    prefix_len:  int        length P of the shared prefix every sequence starts with (0: none)
    prefix_slots:[P]        pool slots of that prefix
    prefix_start:int        first slot when those slots are consecutive (then the prefix is read as a view), else -1
    ctx_blocks:  [B, NB]    pool blocks of each sequence's context after the prefix (new tokens included), padded;
                            context entry i lives in slot ctx_blocks[b, i // block_size] * block_size + i % block_size
    ctx_lens:    [B]        number of real context entries
    prefix_groups:          decode only (one new token per sequence), for sequences of different prefixes in one
                            batch: a list of PrefixGroup, each a shared prefix and the batch rows that start with
                            it (prefix_len is then 0: ctx_* describe each sequence's own tokens after its prefix).
                            None: every sequence starts with the one prefix above.
    last_layer:             decode only: a dict the forward fills with the last layer's queries "q" [B, H, D]
                            (rotated) and the row log-sum-exp "lse" [B, H] of their attention over prefix and
                            context (the input of the attention-statistics kernels); None: not wanted.
    lens:                   optional host list, per row the number of real new tokens (valid's row sums): with it
                            the forward lays out a packed prefill without reading valid back from the device
    valid_index:            [N] flat positions of the real tokens (row-major), set by a padded prefill from `lens`
                            so that writing the KV needs no boolean indexing (a host synchronisation per layer)
    ctx_lens_host:          optional host list of ctx_lens (what the paged prefill kernel's layout reads without a
                            copy back from the device)
    hidden_layer:           keep the residual stream after these layers (0-based) at the rows whose logits are
                            wanted, in `hidden` {layer: [M, hidden]} (a hidden-state uncertainty signal,
                            fastrag.methods.seakr); such a forward takes the unfused paths (dense, or packed without
                            the fused small operations), whose layer loop is written out. None: not wanted.
    """

    write_slots: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    prefix_len: int
    prefix_slots: torch.Tensor
    ctx_blocks: torch.Tensor
    ctx_lens: torch.Tensor
    block_size: int
    prefix_start: int = -1
    prefix_groups: list["PrefixGroup"] | None = None
    last_layer: dict | None = None
    lens: list[int] | None = None
    valid_index: torch.Tensor | None = None
    ctx_lens_host: list[int] | None = None
    hidden_layer: frozenset | None = None
    hidden: dict | None = None
    prefix_rows: torch.Tensor | None = None  # decode: [B] int32 each row's prefix group (-1: none), set by the
    # forward for the flash prefix kernel (attention/fused_decode.py flash_prefix_rows); None: that kernel is unused


@dataclass(slots=True)
class PrefixGroup:
    rows: torch.Tensor | None  # [n] int64 batch rows of the sequences starting with this prefix (None: all)
    length: int
    slots: torch.Tensor  # [P] pool slots
    start: int = -1  # first slot when consecutive, else -1
    # with rows None: [B] bool, which rows start with this prefix (the others are left as they are). The shape
    # does not depend on how many rows a prefix has, so a decode step of several prefixes can be a CUDA graph
    # (fastrag/cuda_graphs/): the prefix's GEMM runs over every row and only its rows merge the result.
    member: torch.Tensor | None = None
    host_rows: list[int] | None = None  # rows as a host list (what the packed prefill's layout reads)


@dataclass(slots=True)
class CascadeMask:
    """A prefill bucket's masks when its prefix is attended as a cascade: `bias` from `cascade_bias` (the own
    context), `groups` query heads per kv head."""
    bias: torch.Tensor
    groups: int


def real_positions(lens: list[int], T: int, device) -> torch.Tensor:
    """[N] int64 flat positions (row-major over [B, T]) of each row's first lens[b] tokens, built on the host."""
    return tensor_on(np.concatenate([np.arange(n) + b * T for b, n in enumerate(lens)]), device)


def prefix_groups(b: AttnBatch) -> list:
    """The batch's shared prefixes as PrefixGroups (one for all rows when the batch has a single prefix)."""
    if b.prefix_groups is not None:
        return b.prefix_groups
    return [PrefixGroup(None, b.prefix_len, b.prefix_slots, b.prefix_start)] if b.prefix_len else []


def prefix_kv(b: AttnBatch, kp, vp):
    """The shared prefix's keys and values [Hkv, P, D] from a layer's pool: a view when its slots are
    consecutive, else gathered."""
    if b.prefix_start >= 0:
        end = b.prefix_start + b.prefix_len
        return kp[:, b.prefix_start: end], vp[:, b.prefix_start: end]
    return kp.index_select(1, b.prefix_slots), vp.index_select(1, b.prefix_slots)


def ctx_mask(b: AttnBatch):
    """[B, 1, T, S] causal + padding mask of new tokens over the per-sequence context part."""
    B, S = b.ctx_blocks.shape[0], b.ctx_blocks.shape[1] * b.block_size
    kpos = torch.arange(S, device=b.ctx_blocks.device) + b.prefix_len  # absolute position of context entry
    m = (kpos.view(1, 1, S) <= b.positions.unsqueeze(-1)) \
        & (kpos.view(1, 1, S) < (b.ctx_lens + b.prefix_len).view(B, 1, 1))
    return m.unsqueeze(1)


def write_kv(k, v, b: AttnBatch, kp, vp):
    """k, v: [B, Hkv, T, D] -> pool slots (pool layout [Hkv, num_slots, D])."""
    Hkv, D = k.shape[1], k.shape[3]
    k, v = k.transpose(0, 1).reshape(Hkv, -1, D), v.transpose(0, 1).reshape(Hkv, -1, D)
    if k.shape[1] != b.write_slots.numel():
        # padding to skip (a prefill batch). A decode step (T = 1) has one real token per row: no boolean
        # mask, whose indexing waits for the GPU (a host synchronisation per layer) and cannot be graph-captured;
        # a prefill laid out from host lengths has the real positions as an index (no synchronisation either)
        if b.valid_index is not None:
            k, v = k.index_select(1, b.valid_index), v.index_select(1, b.valid_index)
        else:
            flat = b.valid.reshape(-1)
            k, v = k[:, flat], v[:, flat]
    kp.index_copy_(1, b.write_slots, k)
    vp.index_copy_(1, b.write_slots, v)
