"""The one slow, exact reference for every retrieval signal (float64 inside). Tests and benchmarks import it.

Written for clarity, not speed: explicit loops over sequences and heads, slicing to each valid length.
Definitions (DESIGN.md "Signals", docs/dragin-reference.md "RIND"/"QFS"):

- token signals of a decode step: p = softmax(logits / temperature) over the full vocabulary,
  entropy = -sum_v p_v ln p_v (masked -inf logits contribute 0 * ln 0 = 0), logprob = ln p_chosen,
  argmax = lowest index of the largest logit.
- causal attention of one sequence of length n: A[h, j, i] = softmax_{i <= j}(q[h, j] . k[h // G, i] * scale)
  for 0 <= i <= j < n, G = H / Hkv (grouped-query attention).
"""

from __future__ import annotations

import torch

from fastrag.signals.vocab import is_word_text


def token_signals_ref(logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [B] f64, logprob [B] f64, argmax [B] i64) of softmax(logits [B, V] / temperature).

    `chosen` [B] int64 selects the token whose log-probability is returned (the argmax when None).
    A row needs at least one finite logit.
    """
    x = logits.to(torch.float64) / temperature  # [B, V]
    B, V = x.shape
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    p = logp.exp()
    # 0 * ln 0 := 0 for masked (-inf) entries; p * logp would be 0 * -inf = NaN there.
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    # Lowest index among the maxima, written out rather than trusting argmax's tie rule.
    mx = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(V).expand(B, V)
    argmax = torch.where(x == mx, idx, V).min(dim=-1).values
    pick = argmax if chosen is None else chosen.to(torch.int64)
    logprob = logp.gather(1, pick[:, None])[:, 0]
    return entropy, logprob, argmax


def _causal_probs(q: torch.Tensor, k: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """A [H, n, n] f64 of one sequence: q [H, T, D], k [Hkv, T, D]; rows j (queries), cols i (keys)."""
    H, Hkv = q.shape[0], k.shape[0]
    group = H // Hkv
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.zeros(H, n, n, dtype=torch.float64)
    for h in range(H):
        qh = q[h, :n].to(torch.float64)
        kh = k[h // group, :n].to(torch.float64)
        s = (qh @ kh.T) * scale
        s = s.masked_fill(~causal, float("-inf"))
        out[h] = torch.softmax(s, dim=-1)
    return out


def causal_attn_colmax_ref(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """a [B, T] f64: a[b, i] = mean_h max_{i <= j < n} A[h, j, i] for i < n = lengths[b], 0 for i >= n.

    q: [B, H, T, D], k: [B, Hkv, T, D]. The diagonal j = i is included (DRAGIN reference mode).
    """
    B, _, T, _ = q.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        A = _causal_probs(q[b].cpu(), k[b].cpu(), n, scale)  # [H, n, n]
        out[b, :n] = A.max(dim=1).values.mean(dim=0)  # A[h, j, i] = 0 for j < i, so the max is over j >= i
    return out


def causal_attn_mean_rows_ref(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float
                              ) -> torch.Tensor:
    """M [B, T, T] f64: M[b, j, i] = mean_h A[h, j, i] for i <= j < n, 0 elsewhere (the QFS attention rows)."""
    B, _, T, _ = q.shape
    out = torch.zeros(B, T, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n:
            out[b, :n, :n] = _causal_probs(q[b].cpu(), k[b].cpu(), n, scale).mean(dim=0)
    return out


def nonstop_table_ref(tokenizer, stopwords: set[str] | None = None) -> torch.Tensor:
    """s [len(tokenizer)] bool: True where a vocabulary piece is a content (non-stop) word piece.

    A piece's text is `convert_tokens_to_string([piece])` with "Ġ"/"▁" removed, stripped and lowercased; it is
    True when that text is non-empty, has a letter or digit (not all punctuation/symbols) and is not a stopword.
    Special tokens are False. Default stopwords: spaCy's English STOP_WORDS.
    """
    if stopwords is None:
        from spacy.lang.en.stop_words import STOP_WORDS

        stopwords = set(STOP_WORDS)
    special = set(tokenizer.all_special_ids)
    V = len(tokenizer)
    out = torch.zeros(V, dtype=torch.bool)
    for i in range(V):
        if i in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        text = tokenizer.convert_tokens_to_string([piece]).replace("Ġ", "").replace("▁", "").strip().lower()
        out[i] = is_word_text(text) and text not in stopwords
    return out
