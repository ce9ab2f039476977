"""A sequence's state between the generations of one question, the sampling settings, a generation's output, and
the handles of launched steps and attention passes."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from fastrag.cache.kv import BlockTable, SharedPrefix
from fastrag.engine.sizing import check_seed


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: off; else only the k most likely tokens (ties kept) before top-p, as transformers samples

    def __post_init__(self):
        from fastrag.signals.checks import MIN_TEMPERATURE

        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.top_k and self.temperature == 0:
            raise ValueError(f"top_k={self.top_k} applies only when sampling: give a temperature > 0 too (greedy "
                             "decoding takes the most likely token whatever k is)")
        self.seed = check_seed(self.seed, "seed")


@dataclass(slots=True)
class Generation:
    """The output of one generate call."""

    ids: list[int]  # generated tokens, a final EOS dropped
    entropy: list[float]  # entropy of the (warped) next-token distribution that produced each token of ids
    logprob: list[float]  # log-probability of each token of ids
    prompt_tokens: int = 0
    prefilled: int = 0  # prompt tokens actually computed (the rest came from the prefix / own cache)
    ended_by_eos: bool = False
    # the EOS that ended it, the entropy of the distribution it was drawn from and its log-probability (None unless
    # ended_by_eos): the
    # published DRAGIN code keeps that token in its text, words and signals (fastrag.methods.published)
    end_id: int | None = None
    end_entropy: float | None = None
    end_logprob: float | None = None
    # answered from an identical earlier one-shot greedy generation of the same question (QuestionLoop): nothing was
    # prefilled or decoded for it
    reused: bool = False
    # with attention tracking (Engine.start(track_from=...)): for every token of the tracked span (from track_from
    # to the last generated token), the mean over heads of the largest last-layer attention it has received from
    # any query so far, in context (DRAGIN's a_i, streaming semantics); 0 for a token no query has seen yet (the
    # last sampled token of a length-capped generation is never fed)
    attn: list[float] | None = None
    # set when the generation could not go on: the model's next-token distribution was NaN (non-finite logits from
    # broken weights or a dtype overflow); ids hold the tokens before it, and the caller fails its question
    error: str | None = None
    # with Engine.start(hidden_layer=L): the residual stream after layer L at the prompt's last token (the input of
    # the first sampled token's logits), [hidden] on the engine's device (fastrag.methods.seakr's eigen score)
    hidden: torch.Tensor | None = None


@dataclass(eq=False)  # identity semantics: the scheduler looks sequences up in lists
class SeqState:
    table: BlockTable
    prefix: SharedPrefix | None = None
    tokens: list[int] = field(default_factory=list)  # all tokens of the sequence (prefix included)
    # current generation
    max_new: int = 0
    out: Generation | None = None
    pending_prompt: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    on_token: object = None  # optional callable(token_id) run as each token of the current generation is kept
    # attention tracking: absolute position of the tracked span's first token, and the running per-head max
    # attention [H, cap] each span token received (column j: position track_from + j)
    track_from: int | None = None
    amax: torch.Tensor | None = None
    sample_key: int = 0  # sampling: the key of the current generation (token t draws with sampling_key(.., t))
    # the current generation's own sampling (None: the engine's), its stop tokens (a sampled token of this set is
    # kept and ends the generation) and the layer whose hidden state its prefill keeps (Generation.hidden)
    sampling: SamplingParams | None = None
    stop_ids: frozenset | None = None
    hidden_layer: int | None = None
    # prefix cache: content keys of the full blocks of the prompt's own tokens (kv.chain_keys), and how many of
    # them a lookup may adopt (a generation prefills at least one token; tracked tokens are fed by decode steps)
    keys: list = field(default_factory=list)
    adoptable: int = 0

    @property
    def base(self) -> int:
        return self.prefix.length if self.prefix else 0

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache (absolute count)."""
        return self.base + self.table.num_tokens

    def track_span(self, track_from: int, cap: int, num_heads: int, device) -> None:
        """Track the span from position track_from with maxima of `cap` columns: zeros, but where the same span
        continues (same track_from) the columns already cached keep their maxima."""
        amax = torch.zeros(num_heads, cap, dtype=torch.float32, device=device)
        if self.track_from == track_from and self.amax is not None:  # the same span continues: keep what is cached
            keep = min(max(self.computed - track_from, 0), self.amax.shape[1], cap)
            amax[:, :keep] = self.amax[:, :keep]
        self.track_from, self.amax = track_from, amax


@dataclass(eq=False)
class PendingStep:
    """A launched engine step (`Engine.step_launch`) whose decode results are not yet on the host."""

    finished: list  # sequences the step's prefill already finished (a generation of one token, or an EOS)
    batch: list = field(default_factory=list)  # the decode batch
    ready: list = field(default_factory=list)  # rows of batch that sample a token this step
    sampled: tuple | None = None  # (host tensor [3, len(ready)], CUDA event or None)
    joining: list = field(default_factory=list)  # async_prefill: prefilled sequences whose first token is in flight
    join_sampled: tuple | None = None  # their (host tensor, CUDA event or None), as `sampled`
    decode_s: float = 0.0  # host seconds of the launch's decode part
    trace_row: dict | None = None  # the step's row of Engine.trace (None: not tracing)


@dataclass(eq=False)
class PendingPasses:
    """Launched attention passes (`Engine.attention_passes_launch`) whose results may still be on their way."""

    kind: str
    lengths: list  # token count of each list, in the caller's order
    groups: list = field(default_factory=list)  # (indices into the lists, host tensor of their padded results)
    event: object = None  # CUDA event after the last copy (None: the results are already on the host)

    def done(self) -> bool:
        return self.event is None or self.event.query()


def check_token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """Token ids must be integers (Python's or numpy's) inside the model's vocabulary (an embedding lookup would
    fail a later step)."""
    V = vocab_size
    lo, hi = min(ids), max(ids)
    if not (isinstance(lo, numbers.Integral) and isinstance(hi, numbers.Integral)) or lo < 0 or hi >= V:
        bad = next(t for t in ids if not isinstance(t, numbers.Integral) or not 0 <= t < V)
        raise ValueError(f"{what} holds token id {bad!r}, outside the model's vocabulary [0, {V})")
