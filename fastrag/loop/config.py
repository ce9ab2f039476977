"""The question loop's settings, one dataclass: what `QuestionLoop` is built from (fastrag.specs.EngineConfig holds the
engine's and gives these with `loop_config`).

None leaves a setting to the loop's rule at build time: overlap on for a CUDA engine; sync_watch, text_lockstep and
text_groups from the environment (fastrag.settings); search_concurrency from the retriever.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoopConfig:
    """max_inflight: questions live at once (each may hold sequences in the engine); twice the decode batch keeps
    the batch full while some questions wait on passes or retrieval. overlap: the methods' host work while the
    device decodes. text_workers: spaCy worker processes (0: on the loop's thread) or a started TextPool.
    wait_for_search: when only retrievals are left, step() waits for one (a batch run) or returns at once (a server
    that must stay responsive). search_concurrency: retrieval batches in flight. sync_watch / text_lockstep /
    text_groups: see fastrag.sync_watch and fastrag.loop.text_service."""

    max_inflight: int = 64
    overlap: bool | None = None
    text_workers: Any = None
    wait_for_search: bool = True
    search_concurrency: int | None = None
    sync_watch: bool | None = None
    text_lockstep: bool | None = None
    text_groups: bool | None = None

    def __post_init__(self):
        if isinstance(self.max_inflight, bool) or not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {self.max_inflight!r}")
        for name in ("overlap", "sync_watch", "text_lockstep", "text_groups"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool or None, got {v!r}")
        if not isinstance(self.wait_for_search, bool):
            raise ValueError(f"wait_for_search must be a bool, got {self.wait_for_search!r}")

    def replace(self, **changes) -> LoopConfig:
        """A copy with `changes` (unknown names are a TypeError naming them)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown question-loop setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)
