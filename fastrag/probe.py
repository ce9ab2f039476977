"""A run's optional diagnostics behind one object: the step trace, the kernel-profile window, the launch profile and
the sync watch.

`Probe.from_settings()` reads their four switches (fastrag.settings: $FASTRAG_STEP_TRACE, $FASTRAG_KERNEL_PROFILE,
$FASTRAG_LAUNCH_PROFILE, $FASTRAG_SYNC_WATCH); `attach(engine)` hands the engine the recorders that are on,
`collect(engine, folders)` takes them back, writes their files into each output folder and returns their summaries
for metrics.json. Off, nothing is attached: the engine's step then tests three attributes that are None and records
nothing, and the question loop starts no sync watch, so a run without diagnostics computes and times exactly what it
would without this module. The device clock (fastrag/engine/clock.py) is not a diagnostic: its seconds are the
engine's own figures in every run.

    probe = Probe.from_settings()
    probe.attach(engine)
    try:
        QuestionLoop(engine, retriever, policy, sync_watch=probe.sync_watch).run(questions, on_result)
    finally:
        blocks = probe.collect(engine, [out])  # {"step_trace": ..., "kernel_profile": ..., "launch_profile": ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fastrag.settings import setting


@dataclass
class Probe:
    """step_trace: a row per engine step (step_trace.jsonl) and the device's idle time. kernel_window: (first step,
    steps) under torch.profiler, device time by kernel part (kernel_profile.json). launch_profile: cProfile over every
    step launch, by kind of step (launch_profile/*.pstats). sync_watch: count host calls that wait for the device
    inside the overlap window (a GPU run's QuestionLoop)."""

    step_trace: bool = False
    kernel_window: tuple[int, int] | None = None
    launch_profile: bool = False
    sync_watch: bool = False

    @classmethod
    def from_settings(cls) -> Probe:
        """The diagnostics the environment asks for (a bad value is an error naming its variable)."""
        return cls(step_trace=setting("FASTRAG_STEP_TRACE"), kernel_window=setting("FASTRAG_KERNEL_PROFILE"),
                   launch_profile=setting("FASTRAG_LAUNCH_PROFILE"), sync_watch=setting("FASTRAG_SYNC_WATCH"))

    @property
    def on(self) -> bool:
        return bool(self.step_trace or self.kernel_window or self.launch_profile or self.sync_watch)

    def attach(self, engine) -> None:
        """Give `engine` the recorders that are on (an engine without step_launch takes no launch profile)."""
        if self.step_trace:
            engine.trace = []
        if self.launch_profile and hasattr(engine, "step_launch"):
            from fastrag.launch_profile import LaunchProfile

            engine.launch_profile = LaunchProfile()
        if self.kernel_window is not None:
            from fastrag.kernel_parts import StepWindow

            engine.kernel_window = StepWindow(*self.kernel_window, getattr(engine, "device", "cpu"))

    def collect(self, engine, folders: list[Path]) -> dict:
        """Take the recorders back from `engine` (it records nothing after), write their files into every folder of
        `folders` (one engine ran all of their questions: each gets the whole record) and return their summaries
        under metrics.json's names; nothing for what was off."""
        from fastrag.eval.store import write_json

        blocks: dict = {}
        window = getattr(engine, "kernel_window", None)
        if self.kernel_window is not None and window is not None:
            engine.kernel_window = None
            blocks["kernel_profile"] = window.finish(engine.stats)
            for out in folders:
                write_json(out / "kernel_profile.json", {"window": list(self.kernel_window),
                                                         "profile": blocks["kernel_profile"]})
        lp = getattr(engine, "launch_profile", None)
        if self.launch_profile and lp is not None:
            engine.launch_profile = None
            blocks["launch_profile"] = lp.summary() | {"folder": "launch_profile"}
            for out in folders:  # (each kind's full statistics: python -m pstats FILE)
                lp.dump(out / "launch_profile")
        if self.step_trace:
            from fastrag.perf import trace_summary

            rows, engine.trace = getattr(engine, "trace", None) or [], None
            for out in folders:
                with open(out / "step_trace.jsonl", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
            blocks["step_trace"] = trace_summary(rows) | {"file": "step_trace.jsonl"}
        return blocks

