"""Device seconds of the engine's launches, and the step trace's hook on Triton compiles."""

from __future__ import annotations

import time

import torch


def compile_log():
    """fastrag.kernels.compiles.COMPILES where its hook is on (it names a step's Triton compiles in the step trace),
    else None."""
    try:
        from fastrag.kernels.compiles import COMPILES
    except ImportError:  # (no Triton here)
        return None
    return COMPILES if COMPILES.installed else None


class DeviceClock:
    """Device seconds of the engine's launches, so that a run can say how long the device was busy beside its wall
    time (the rest is the device waiting for the host).

    On a GPU a phase is timed by CUDA events on the launching stream: a mark recorded before its first kernel and
    one after its last (the timing-enabled event that marks the phase's host copy done, where it has one). One stream
    runs the phases one after another, so their spans do not overlap; a span includes the gaps where the device
    waited for the host to launch the phase's next kernel (a graphed decode step is one launch, an eager prefill a few
    thousand). A pair is read once its end has completed (`settle`, called after the waits the engine makes anyway:
    the clock adds no synchronisation). On a CPU the work runs as it is launched, so a phase's seconds are host
    seconds."""

    def __init__(self, device: torch.device, totals: dict):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.totals = totals  # key -> seconds (the engine's stats)
        self._pending: list[tuple[str, object, object, dict | None]] = []

    def mark(self):
        """A point on the device's timeline, now (in stream order on a GPU)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))  # (the engine's device, whichever is current)
        return ev

    def stop(self, key: str, start, end=None, row: dict | None = None) -> None:
        """Add the seconds from `start` (a mark) to `end` (a recorded timing event; None: a mark now) to totals[key],
        and to row[key] when a step's trace row is given: at once on a CPU, on a GPU when the end has completed."""
        end = self.mark() if end is None else end
        if self.cuda:
            self._pending.append((key, start, end, row))
            self.settle()
        else:
            self._add(key, end - start, row)

    def _add(self, key: str, seconds: float, row: dict | None) -> None:
        self.totals[key] += seconds
        if row is not None:
            row[key] = row.get(key, 0.0) + seconds

    def settle(self) -> None:
        """Count the timed phases the device has finished (no waiting)."""
        left = []
        for key, a, b, row in self._pending:
            if b.query():
                self._add(key, a.elapsed_time(b) / 1e3, row)
            else:
                left.append((key, a, b, row))
        self._pending = left

    @property
    def pending(self) -> int:
        """Timed phases not yet counted (the device had not finished them at the last settle)."""
        return len(self._pending)


def new_stats() -> dict:
    """An engine's counters (all zero), plus host seconds spent in step()'s prefill and decode parts (each ends in a
    host copy, so on a GPU they include the device's time: where a run's time goes, beside the scheduler's method
    time)."""
    # Attention reads (fastrag/perf.py's floor): decode_ctx_tokens / decode_prefix_tokens are the own and the
    # shared-prefix KV entries decode steps read (a prefix once per step for all its sequences);
    # prefill_ctx_tokens sums, over prefilled tokens (attention passes too), the entries each attends to.
    # KV pressure: kv_waits counts, step by step, admissions put off because the pool had too few free
    # blocks (the sequence waits for running ones to finish); evictions / evicted_tokens count idle sequences
    # whose own cache was freed to make room (each evicted token is prefilled again when it next runs)
    return {"prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0, "own_hit_tokens": 0,
            "decode_steps": 0, "prefill_calls": 0, "cached_hit_tokens": 0, "prefill_s": 0.0,
            "decode_s": 0.0, "kv_waits": 0, "evictions": 0, "evicted_tokens": 0,
            "decode_ctx_tokens": 0, "decode_prefix_tokens": 0, "prefill_ctx_tokens": 0,
            "prefix_prefill_s": 0.0,  # (set_prefix's prefills: outside the steps, inside prefill_tokens)
            "prefill_holds": 0,  # steps that left waiting prefills for a later step (prefill_hold)
            # the most KV blocks held at once, seen after a step's admissions (sequences' own blocks and
            # reservations, shared prefixes, the graphs' scratch block): against pool.num_blocks, how
            # close a run came to waiting for room
            "kv_peak_blocks": 0,
            # device seconds of the steps' prefills, decode steps and the attention passes (DeviceClock):
            # their sum against a run's wall time is how busy the device was
            "device_prefill_s": 0.0, "device_decode_s": 0.0, "device_passes_s": 0.0}


def step_row(trace: list) -> dict:
    """A step launch's new row of the step trace, appended to it. Its `step` is the launch's number (a passes_only
    row carries the number of the launch it follows); Triton compiles from here to the next launch are this step's
    ("compiles")."""
    row = {"step": trace[-1]["step"] + 1 if trace else 0, "prefill_seqs": 0, "prefill_tokens": 0, "decode_batch": 0}
    trace.append(row)
    compiles = compile_log()
    if compiles is not None:
        compiles.row = row
    return row
