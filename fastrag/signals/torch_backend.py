"""Fast PyTorch implementation of the signals: float32 math, batched, no Python loop over tokens or heads.

Runs on any device torch supports. Inputs are assumed validated (fastrag.signals.checks); the `SignalBackend`
returned by `fastrag.signals.get_backend("torch")` validates before calling these.
"""

from __future__ import annotations

import torch


def token_signals(logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [B] f32, logprob [B] f32, argmax [B] i64) of p = softmax(logits [B, V] / temperature).

    entropy = -sum_v p_v ln p_v with masked (-inf) logits contributing 0; logprob = ln p_chosen (chosen [B]
    int64, the argmax when None); argmax = lowest index of the largest logit.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)  # [B, V]
    p = logp.exp()
    # 0 * ln 0 := 0; p * logp is 0 * -inf = NaN on masked entries.
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    argmax = logits.argmax(dim=-1)  # torch returns the first maximal index
    pick = argmax if chosen is None else chosen
    logprob = logp.gather(1, pick[:, None])[:, 0]
    return entropy, logprob, argmax


def causal_attn_probs(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """A [B, H, T, T] f32: A[b, h, j, i] = softmax_{i <= j}(q[b,h,j] . k[b,h//G,i] * scale) for i <= j < n_b, else 0.

    q: [B, H, T, D], k: [B, Hkv, T, D], G = H / Hkv. The GQA group is a broadcast dim, so k is never copied.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().reshape(B, Hkv, H // Hkv, T, D)  # head h = kv * G + g
    kg = k.float()[:, :, None]  # [B, Hkv, 1, T, D]
    s = torch.matmul(qg, kg.transpose(-1, -2)).reshape(B, H, T, T) * scale  # [B, H, T(j), T(i)]
    pos = torch.arange(T, device=q.device)
    valid_col = pos[None, :] < lengths[:, None]  # [B, T]: key i < n
    valid_row = pos[None, :] < lengths[:, None]  # [B, T]: query j < n
    causal = pos[None, :] <= pos[:, None]  # [T(j), T(i)]
    mask = causal[None] & valid_col[:, None, :]  # [B, T, T]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    A = torch.softmax(s, dim=-1)
    # Padded rows (j >= n) may be all -inf (n = 0) and so NaN: select, never multiply, to drop them.
    return torch.where(valid_row[:, None, :, None], A, 0.0)


def causal_attn_colmax(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """a [B, T] f32: a[b, i] = mean_h max_{i <= j < n} A[b, h, j, i] for i < n, 0 for i >= n (n = lengths[b])."""
    return causal_attn_probs(q, k, lengths, scale).amax(dim=2).mean(dim=1)


def causal_attn_mean_rows(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """M [B, T, T] f32: M[b, j, i] = mean_h A[b, h, j, i] (zeros outside i <= j < n): QFS attention rows."""
    return causal_attn_probs(q, k, lengths, scale).mean(dim=1)
