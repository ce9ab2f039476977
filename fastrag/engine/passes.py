"""Cache-free attention passes: batched last-layer attention over token lists alone (DRAGIN's RIND and QFS
passes), eager or replayed from the pass graphs, launched beside the engine's steps and read back later."""

from __future__ import annotations

import torch

from fastrag.engine.runner import ModelRunner
from fastrag.engine.sequence import PendingPasses, check_token_ids


class AttentionPasses:
    """`pass_graphs`: the attention passes' graphs (None: eager)."""

    def __init__(self, runner: ModelRunner, max_context: int, pass_graphs=None):
        self.runner, self.max_context, self.pass_graphs = runner, max_context, pass_graphs

    def launch(self, seqs: list[list[int]], kind: str, max_tokens: int) -> PendingPasses:
        """`Engine.attention_passes`' first half: the forwards and signal kernels, and the non-blocking copies of their
        results to pinned host memory. On a GPU it returns before the device has run them (stream order puts them
        after any step already launched); `finish` waits for the copies. max_tokens: the
        padded tokens of one call (the engine's max_prefill_tokens)."""
        run = self.runner
        if kind not in ("colmax", "rows"):
            raise ValueError(f"attention pass kind must be 'colmax' or 'rows', got {kind!r}")
        for x in seqs:
            if not x:
                raise ValueError("an attention pass over an empty token sequence")
            if len(x) > self.max_context:
                raise ValueError(f"an attention pass over {len(x)} tokens exceeds the model context of "
                                 f"{self.max_context} tokens")
            check_token_ids(x, run.model.c.vocab_size, "an attention pass's sequence")
        pending = PendingPasses(kind, [len(x) for x in seqs])
        dev0 = run.clock.mark()
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        pg = self.pass_graphs if self.pass_graphs is not None and self.pass_graphs.applies() else None
        i = 0
        while i < len(order):
            if pg is not None and len(seqs[order[i]]) <= pg.buckets[-1]:
                # a graph's call: up to its lists and tokens, and (lengths ascending) within the padded budget of
                # the signal kernels after it
                j, n = i, 0
                while j < len(order) and j - i < pg.max_seqs and n + len(seqs[order[j]]) <= pg.buckets[-1] \
                        and (j - i + 1) * len(seqs[order[j]]) <= max_tokens:
                    n += len(seqs[order[j]])
                    j += 1
            else:  # group similar lengths so padding stays small
                j, T = i, 0
                while j < len(order) and (j - i + 1) * max(T, len(seqs[order[j]])) <= max_tokens:
                    T = max(T, len(seqs[order[j]]))
                    j += 1
            j = max(j, i + 1)
            idx = order[i:j]
            T = max(len(seqs[k]) for k in idx)
            lens_h = torch.tensor([len(seqs[k]) for k in idx])
            lens = run.h2d(lens_h)  # (a plain .to(device) from pageable memory would wait for the device)
            qk = pg.run([seqs[k] for k in idx]) if pg is not None else None
            graphed = qk is not None
            if qk is None:
                ids = torch.zeros(len(idx), T, dtype=torch.long)
                for b, k in enumerate(idx):
                    ids[b, : len(seqs[k])] = torch.tensor(seqs[k])
                # (the host lengths let the paged kernel's path compute only the real rows)
                qk = run.model.last_layer_qk(run.h2d(ids), lens, lens_h.tolist())
            n_tok = sum(len(seqs[k]) for k in idx)
            n_ctx = sum(len(seqs[k]) * (len(seqs[k]) + 1) // 2 for k in idx)
            row = run.trace_row
            if row is not None:  # the step launched last: its passes' forwards, tokens and attention entries
                for key, add in (("pass_calls", 1), ("pass_lists", len(idx)), ("pass_tokens", n_tok),
                                 ("pass_ctx_tokens", n_ctx), ("pass_graphed", int(graphed))):
                    row[key] = row.get(key, 0) + add
            q, k_ = qk
            q, k_ = q.float(), k_.float()
            if kind == "colmax":
                r = run.signals.causal_attn_colmax(q, k_, lens, run.model.scale)
            else:
                r = run.signals.causal_attn_mean_rows(q, k_, lens, run.model.scale)
            pending.groups.append((idx, run.d2h(r)))
            run.stats["prefill_tokens"] += n_tok
            run.stats["prefill_ctx_tokens"] += n_ctx
            i = j
        if run.device.type == "cuda" and pending.groups:
            pending.event = torch.cuda.Event(enable_timing=True)
            pending.event.record()
        run.clock.stop("device_passes_s", dev0, pending.event, run.trace_row)  # (the step launched last)
        return pending

    def finish(self, pending: PendingPasses) -> list:
        """Wait for launched attention passes; their results in the order of the lists given to the launch."""
        if pending.event is not None:
            pending.event.synchronize()
            self.runner.clock.settle()
        out = [None] * len(pending.lengths)
        for idx, r in pending.groups:
            for b, k in enumerate(idx):
                n = pending.lengths[k]
                out[k] = r[b, :n].tolist() if pending.kind == "colmax" else r[b, :n, :n].double()
        return out
