"""Which host calls made the device wait while the scheduler's overlap window was open.

With overlap (fastrag.loop), the engine launches a decode step and the methods' own logic runs on the host until
`step_finish` waits for that step. Any call in between that synchronises with the device (a `.item()`, `.tolist()` or
`.cpu()` of a device tensor, `nonzero`, a blocking copy between host and device, a stream's synchronize) makes the host
wait for the step, and the window hides nothing after it. `SyncWatch` turns torch's synchronisation debug mode to
"warn" for the window only, counts the warnings it raises there by call site in the project's code (the innermost
frame under `fastrag/`, else the innermost frame), and lets every other warning through when the window closes (once
a text and place). torch's debug mode reports the calls that go through its copy-and-synchronise and
stream-synchronise paths; `torch.cuda.synchronize()` and an event's `synchronize()` are not reported (the window's
one intended wait, for the attention passes, is an event's). The launch itself is covered by
tests/test_host_sync.py; this covers everything else the window runs, in a real run.

Off unless asked ($FASTRAG_SYNC_WATCH=1, or `QuestionLoop(sync_watch=True)`), and only on CUDA devices: the debug mode
costs host time on every CUDA call. A run's metrics.json has the counts under `overlap_syncs`.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from fastrag.settings import setting

SYNC_WATCH_ENV = "FASTRAG_SYNC_WATCH"
# torch's warning in sync debug mode "warn" (c10/cuda/CUDAFunctions.cpp: warn_or_error_on_sync)
SYNC_MESSAGE = "called a synchronizing CUDA operation"
_PKG = str(Path(__file__).resolve().parent)


def sync_watch_requested() -> bool:
    """$FASTRAG_SYNC_WATCH, a switch."""
    return setting(SYNC_WATCH_ENV)


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The call site a warning is counted under: the innermost frame in the project's code outside this module,
    else the innermost frame outside this module and the warnings machinery."""
    frames = [f for f in stack if f.filename != __file__ and f.filename != warnings.__file__]
    own = [f for f in frames if f.filename.startswith(_PKG)]
    f = own[-1] if own else frames[-1]
    name = f.filename[len(_PKG) - len("fastrag"):] if f.filename.startswith(_PKG) else f.filename
    return f"{name}:{f.lineno} ({f.name})"


class SyncWatch:
    """`start()` when the window opens, `stop()` before the wait that closes it; `summary()` for metrics.json.

    set_mode: torch.cuda.set_sync_debug_mode (a parameter so that the CPU tests can watch without a GPU)."""

    def __init__(self, set_mode=None):
        self._set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.sites: Counter[str] = Counter()
        self.windows = 0  # windows watched
        self.windows_with_syncs = 0
        self._ctx = None
        self._seen = 0
        self._others: list = []
        self._shown: set = set()  # the other warnings of the windows shown so far (text, category, place)

    @property
    def active(self) -> bool:
        return self._ctx is not None

    def start(self) -> None:
        if self._ctx is not None:
            return
        # (the mode is set outside the hook: torch warns that the debug mode is a prototype, once, as usual)
        self._set_mode("warn")
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("always", message=SYNC_MESSAGE)  # (every occurrence, not once per site)
        others = self._others = []

        def hook(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.sites[_site(traceback.extract_stack()[:-1])] += 1
                self._seen += 1
            else:  # (shown again when the window closes, through the warnings setup outside it)
                others.append((message, category, filename, lineno))

        warnings.showwarning = hook
        self._seen = 0
        self.windows += 1

    def stop(self) -> None:
        if self._ctx is None:
            return
        ctx, self._ctx = self._ctx, None
        try:
            ctx.__exit__(None, None, None)  # (restores showwarning and the filters)
            self.windows_with_syncs += self._seen > 0
            others, self._others = self._others, []
            for message, category, filename, lineno in others:
                key = (str(message), category, filename, lineno)
                if key not in self._shown:  # (once a text and place: the window's filters change every step, so
                    self._shown.add(key)  # Python's own once-a-place record starts afresh in each window)
                    warnings.warn_explicit(message, category, filename, lineno)
        finally:
            self._set_mode("default")

    def summary(self, top: int = 20) -> dict:
        """Windows watched, how many had a synchronising call, the calls in all, and the most frequent sites."""
        return {"windows": self.windows, "windows_with_syncs": self.windows_with_syncs,
                "syncs": sum(self.sites.values()), "sites": dict(self.sites.most_common(top))}
