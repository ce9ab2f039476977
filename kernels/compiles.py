"""Triton compiles in this process, by kernel and by engine step.

A Triton kernel is compiled once per specialisation: per combination of its constexprs, of "equal to 1" and
"divisible by 16" over the integer arguments it does not mark `do_not_specialize`, and of its pointers' 16-byte
alignment. A compile inside a timed run stops the host for a large fraction of a second or more, several times a
step's usual length (benchmarks/results/README.md). The step trace showed the time but not its cause. `COMPILES`
hooks Triton's JIT cache misses (`triton.knobs.runtime.jit_cache_hook`: every compile, or load from Triton's disk
cache, of a specialisation this process has not run yet) and records each one's kernel name, so that

- `fastrag.eval` reports the compiles of a timed run in metrics.json (`triton_compiles`), and
- the engine's step trace ($FASTRAG_STEP_TRACE=1) names them in the row of the step they happened in (`compiles`).

The hook chains to any hook set before it and returns what that one returns (a true value tells Triton to skip the
compile). Under TRITON_INTERPRET=1 nothing is compiled and the hook never fires.
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class CompileLog:
    """Each Triton JIT cache miss of this process once `install()`ed: `events` [(perf_counter, kernel name)]."""

    def __init__(self):
        self.events: list[tuple[float, str]] = []
        self.installed = False
        self.why_not: str | None = None  # why install() could not hook this Triton
        self.row: dict | None = None  # the engine's current step-trace row (Engine.step_launch sets it)
        self._prev = None
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton's JIT cache misses (once per process); False, with `why_not`, where this Triton has no hook."""
        with self._lock:
            if self.installed:
                return True
            try:
                from triton import knobs
            except ImportError as e:
                self.why_not = f"no triton.knobs ({e})"
                return False
            if not hasattr(knobs.runtime, "jit_cache_hook"):
                self.why_not = "this Triton has no knobs.runtime.jit_cache_hook"
                return False
            self._prev = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
            self.installed, self.why_not = True, None
            return True

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        # (Triton names a kernel by its qualified name: one defined inside a function or a class is
        # "outer.<locals>.kernel" or "Class.kernel"; the log keeps the kernel's own name, as the module-level ones)
        name = name.rsplit(".", 1)[-1]
        self.events.append((time.perf_counter(), name))
        row = self.row
        if row is not None:
            row.setdefault("compiles", []).append(name)
        return self._prev(*args, **kwargs) if self._prev is not None else None

    def mark(self) -> int:
        """A point in the log: `since(mark)` counts what came after it."""
        return len(self.events)

    def since(self, mark: int) -> dict[str, int]:
        """Kernel name -> compiles after `mark`."""
        return dict(Counter(name for _, name in self.events[mark:]))

    def report(self, mark: int) -> dict:
        """metrics.json's `triton_compiles` for what came after `mark`: the count, by kernel, and whether the hook
        was on (off: the reason; the count then says nothing)."""
        kernels = self.since(mark)
        return {"hooked": self.installed, "why_not": self.why_not, "count": sum(kernels.values()),
                "kernels": kernels}


COMPILES = CompileLog()
