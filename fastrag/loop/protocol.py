"""What the question loop needs from an engine (`LoopEngine`), and the synchronous defaults for engines that only
step (`SyncEngineBase`: the tests' scripted engines).

fastrag.engine.Engine provides all of it. The loop calls these names and nothing else; it never probes an engine
for what it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from fastrag.engine import SamplingParams, SeqState


class LoopEngine(Protocol):
    """The engine side of fastrag.loop: sequences, generations, steps (whole, or launched and finished so the host
    works meanwhile), batched attention passes."""

    tok: Any  # the tokenizer: encode(text) -> ids, decode(ids, skip_special_tokens=True) -> text
    device: torch.device | None  # None: not on a device (a scripted engine); "cuda" turns the loop's overlap on
    sampling: SamplingParams | None  # None or temperature <= 0: greedy (identical one-shot generations are reused)
    max_context: int | None  # tokens an attention pass may cover (None: no limit)
    waiting: list  # sequences queued for their prefill
    running: list  # sequences decoding

    @property
    def has_work(self) -> bool: ...

    def new_sequence(self) -> SeqState: ...

    def start(self, s: SeqState, prompt_ids: list[int], max_new_tokens: int, **kw) -> None:
        """Queue a generation on s (kw: track_from, sample_key, passed only when the loop uses them)."""

    def release(self, s: SeqState) -> None: ...

    def step(self) -> list:
        """One engine step; returns the sequences whose generation finished."""

    def step_launch(self) -> Any:
        """step()'s first half: returns a pending step (the device may still run it)."""

    def step_done(self, pending: Any) -> bool: ...

    def step_finish(self, pending: Any) -> list:
        """step()'s second half: waits for the pending step; returns the sequences that finished."""

    def trace_passes_step(self) -> dict | None:
        """The step trace's row for a step that launches attention passes and no engine step (None: no trace)."""

    def attention_passes(self, seqs: list[list[int]], kind: str) -> list: ...

    def attention_passes_launch(self, seqs: list[list[int]], kind: str) -> Any:
        """Launch one batched pass of a kind ("colmax", "rows"); the pending passes have done()."""

    def attention_passes_finish(self, pending: Any) -> list: ...


@dataclass(slots=True)
class DoneStep:
    """A step that SyncEngineBase.step_launch already ran."""

    finished: list
    trace_row: dict | None = None


@dataclass(slots=True)
class DonePasses:
    """Attention passes that SyncEngineBase.attention_passes_launch already computed."""

    results: list = field(default_factory=list)

    def done(self) -> bool:
        return True


class SyncEngineBase:
    """Defaults for an engine with step() and attention_passes() alone: launching runs them at once. Such an
    engine cannot overlap the host's work with its steps (QuestionLoop refuses overlap for it)."""

    device = None
    sampling = None
    max_context = None

    def step_launch(self) -> DoneStep:
        return DoneStep(self.step())

    def step_done(self, pending: DoneStep) -> bool:
        return True

    def step_finish(self, pending: DoneStep) -> list:
        return pending.finished

    def trace_passes_step(self) -> dict | None:
        return None

    def attention_passes_launch(self, seqs: list[list[int]], kind: str) -> DonePasses:
        return DonePasses(self.attention_passes(seqs, kind))

    def attention_passes_finish(self, pending: DonePasses) -> list:
        return pending.results
