"""Pure DRAGIN decision rules of the oracle (docs/dragin-reference.md), free of any model or tokenizer.

Each function takes plain tensors / lists so that tests can hand-build their inputs. They are written for reading,
not speed: loops over words and sentences, float64 throughout. They deliberately share no code with the engine
(`fastrag/signals`, `fastrag/methods`): the oracle is what the engine is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Span = tuple[int, int]  # half-open [l, r)


def token_entropy(scores: torch.Tensor) -> torch.Tensor:
    """`H_t = -sum_v p_tv log p_tv`, `p_t = softmax(scores_t)`, natural log, float64.

    scores: [N, V] logits of the steps that produced the N tokens -> [N]. `entr(0) = 0`, so logits a processor set
    to -inf contribute nothing (instead of 0 * -inf = NaN).
    """
    p = torch.softmax(scores.to(torch.float64), dim=-1)
    return torch.special.entr(p).sum(dim=-1)


def token_attention(attn: torch.Tensor) -> torch.Tensor:
    """RIND token attention `a_t = mean_h max_{j >= t} A[h, j, t]` (diagonal included).

    attn: [H, N, N] last-layer attention probabilities (row = query j, column = key t) -> [N], float64.
    Causal softmax rows are already zero above the diagonal; the mask makes `j >= t` explicit anyway.
    """
    a = attn.to(torch.float64)
    n = a.shape[-1]
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool))  # lower[j, t] = j >= t
    a = a.masked_fill(~lower, float("-inf"))
    return a.max(dim=1).values.mean(dim=0)


def word_values(a: torch.Tensor, h: torch.Tensor, spans: list[Span]) -> tuple[list[float], list[float]]:
    """Word attention `a_w = sum_{t in w} a_t` and word entropy `H_w = mean_{t in w} H_t`. a, h: [N]."""
    aw = [float(a[l:r].sum()) for l, r in spans]
    hw = [float(h[l:r].mean()) for l, r in spans]
    return aw, hw


@dataclass(slots=True)
class Trigger:
    """The first sentence whose RIND score crossed the threshold."""

    sentence: int  # index into the sentences of the new text
    words: Span  # its word range [l, r)
    raw_hits: list[bool]  # score_w > threshold, one per word of the range
    hits: list[bool] = field(default_factory=list)  # after the real-word filter (== raw_hits without it)


def rind_trigger(aw: list[float], hw: list[float], ranges: list[Span], threshold: float) -> Trigger | None:
    """First sentence with a hit, or None.

    For sentence words [l, r): `score_w = a_w / sum_{[l, r)} a * H_w * (r - l)`; `hit_w = score_w > threshold`.
    Sentences without words are skipped.
    """
    for sid, (l, r) in enumerate(ranges):
        if r <= l:
            continue
        total = sum(aw[l:r])  # (all zero: no word stands out, as NaN > threshold is false in the published code)
        scores = [(aw[w] / total if total > 0 else 0.0) * hw[w] * (r - l) for w in range(l, r)]
        hits = [s > threshold for s in scores]
        if any(hits):
            return Trigger(sentence=sid, words=(l, r), raw_hits=hits, hits=list(hits))
    return None


def clear_unreal_hits(words: list[str], hits: list[bool], is_real) -> list[bool]:
    """`check_real_words`: a hit survives only on a word that matches a real word (`is_real(word) -> bool`)."""
    return [h and bool(is_real(w)) for w, h in zip(words, hits)]


def qfs_word_rows(m: torch.Tensor, spans: list[Span], skip_first: bool) -> torch.Tensor:
    """Per-word attention rows of the QFS pass.

    m: [T, T] last-layer attention averaged over heads. `att_w = mean_{t in w} m[t, :]`, then divided by
    `sum(att_w[1:])` (skip_first, the published code's BOS assumption) or `sum(att_w)`. Returns [W, T], float64.
    As in the published code, a one-column matrix is left unnormalised. A word whose row has nothing past column 0
    (the first word under skip_first) gets inf/NaN entries; it is never a hit word, so they are never read.
    """
    m = m.to(torch.float64)
    rows = torch.stack([m[l:r].mean(dim=0) for l, r in spans])
    if m.shape[-1] > 1:
        norm = rows[:, 1:].sum(dim=1, keepdim=True) if skip_first else rows.sum(dim=1, keepdim=True)
        rows = rows / norm
    return rows


def qfs_scores(rows: torch.Tensor, spans: list[Span], hit_words: list[int]) -> list[float] | None:
    """Word scores: `fwd = mean_{w in hits} rows[w]`, `score_v = sum_{t in v} fwd[t]`; None when no hit word.

    rows: [W, T] from qfs_word_rows; hit_words: indices of the hit words. With no hit word the published code
    divides a zero vector by zero (all NaN), so the caller falls back to text order.
    """
    if not hit_words:
        return None
    fwd = rows[hit_words].mean(dim=0)
    return [float(fwd[l:r].sum()) for l, r in spans]


def select_query_words(words: list[str], candidate: list[bool], scores: list[float] | None, k: int) -> list[str]:
    """Keep the k best candidates by score (ties: earlier first), in text order; no scores: first k candidates."""
    idx = [i for i, c in enumerate(candidate) if c]
    if scores is not None:
        idx = sorted(sorted(idx, key=lambda i: (-scores[i], i))[:k])
    else:
        idx = idx[:k]
    return [words[i] for i in idx]
