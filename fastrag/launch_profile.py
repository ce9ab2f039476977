"""Where the host's launch of the engine steps spends its time, function by function (cProfile).

The step trace times each `Engine.step_launch` as a whole (`launch_s`, and its thread CPU time `launch_cpu_s`), and
fastrag.perf.launch_fit splits it into a fixed part and parts per decode sequence, prefilled sequence and prefilled
token. This says which calls those seconds are in: `$FASTRAG_LAUNCH_PROFILE=1` makes fastrag.eval run cProfile over
every step launch of the run (the launching thread only) and keep the results apart by kind of step: steps with a
prefill, and plain decode steps by batch size (fastrag.perf.DECODE_BATCH_RANGES, the launch table's). cProfile's clock is the wall: a call that waits
(for the GIL, in a blocking CUDA call, for a pinned buffer) is charged its wait, and torch's C functions show as
their own entries (`<method 'copy_' ...>`). Comparing the smallest and the largest decode buckets gives each
function's cost per decode sequence (`per_sequence`), the part of the launch that grows with the batch.

The profiler costs host time on every Python call, so a profiled run's throughput is not the engine's: run it as a
variant (benchmarks/gpu/device.sh `variants`), not as the headline run. fastrag.eval writes the summary into
metrics.json `launch_profile` and each kind's full statistics into the run folder as
`launch_profile/<kind>.pstats` (read them with `python -m pstats`).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import re
import time
from pathlib import Path

from fastrag.perf import DECODE_BATCH_RANGES

LAUNCH_PROFILE_ENV = "FASTRAG_LAUNCH_PROFILE"
PREFILL_KIND = "with a prefill"
IDLE_KIND = "no decode, no prefill"

_PKG_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


def step_kind(prefilled: bool, decode_batch: int) -> str:
    """The kind a launch is counted under: PREFILL_KIND when it ran a prefill, else its decode bucket
    in DECODE_BATCH_RANGES ("decode 16-63", "decode 192+"), else IDLE_KIND."""
    if prefilled:
        return PREFILL_KIND
    if decode_batch <= 0:
        return IDLE_KIND
    for lo, hi in DECODE_BATCH_RANGES:
        if decode_batch >= lo and (hi is None or decode_batch <= hi):
            return f"decode {lo}+" if hi is None else f"decode {lo}-{hi}"
    raise ValueError(f"DECODE_BATCH_RANGES do not cover a decode batch of {decode_batch}")


def function_label(func: tuple[str, int, str]) -> str:
    """A pstats function key as a table cell: `fastrag/engine/core.py:120(step_launch)` for the project's code (and
    site-packages' paths from the package on), torch's C functions as cProfile names them."""
    filename, line, name = func
    if filename == "~" and line == 0:
        return name
    if filename.startswith(_PKG_ROOT):
        filename = filename[len(_PKG_ROOT):]
    else:
        m = re.search(r"[/\\](?:site|dist)-packages[/\\](.*)$", filename)
        if m:
            filename = m.group(1)
    return f"{filename}:{line}({name})"


def _safe(kind: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_") or "kind"


class LaunchProfile:
    """cProfile over the engine's step launches: `start()` before a launch, `stop(prefilled, decode_batch)` after
    it (Engine.step_launch calls both when its `launch_profile` is set); `summary()` for metrics.json, `dump()` for
    the full statistics."""

    def __init__(self):
        self.kinds: dict[str, dict] = {}
        self._prof: cProfile.Profile | None = None
        self._t0 = 0.0

    def start(self) -> None:
        if self._prof is not None:  # (a launch that raised before its stop: its partial profile is dropped)
            self._prof.disable()
        self._prof = cProfile.Profile()
        self._t0 = time.perf_counter()
        self._prof.enable()

    def stop(self, prefilled: bool, decode_batch: int) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            raise RuntimeError("LaunchProfile.stop() without start()")
        prof.disable()
        wall = time.perf_counter() - self._t0
        kind = step_kind(prefilled, decode_batch)
        k = self.kinds.get(kind)
        if k is None:
            k = self.kinds[kind] = {"steps": 0, "decode_seqs": 0, "wall_s": 0.0, "stats": pstats.Stats(prof)}
        else:
            k["stats"].add(prof)
        k["steps"] += 1
        k["decode_seqs"] += decode_batch
        k["wall_s"] += wall

    def _rows(self, kind: str) -> dict:
        """function label -> (calls, own seconds, cumulative seconds) over the kind's steps."""
        out = {}
        for func, (_cc, nc, tt, ct, _callers) in self.kinds[kind]["stats"].stats.items():
            label = function_label(func)
            c, t, cu = out.get(label, (0, 0.0, 0.0))
            out[label] = (c + nc, t + tt, cu + ct)
        return out

    def summary(self, top: int = 20) -> dict:
        """Per kind: steps, mean decode batch, profiled wall a step, and its `top` functions by own time a step
        (calls, own and cumulative microseconds a step, share of the kind's own time). `per_sequence`, when two
        decode buckets ran: each function's change in own time and calls a step from the smallest bucket to the
        largest, over the change in mean batch size (microseconds and calls a decode sequence), the `top` largest."""
        kinds, by_kind = {}, {}
        for kind, k in sorted(self.kinds.items()):
            n = k["steps"]
            rows = by_kind[kind] = self._rows(kind)
            own_total = sum(t for _, t, _ in rows.values()) or 1.0
            best = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
            funcs = [{"function": f, "calls_per_step": c / n, "own_us_per_step": 1e6 * t / n,
                      "cum_us_per_step": 1e6 * cu / n, "own_share": t / own_total} for f, (c, t, cu) in best]
            kinds[kind] = {"steps": n, "mean_decode_batch": k["decode_seqs"] / n,
                           "wall_us_per_step": 1e6 * k["wall_s"] / n, "functions": funcs}
        out: dict = {"kinds": kinds}
        decode = [kind for kind in kinds if kind.startswith("decode ")]
        if len(decode) >= 2:
            small = min(decode, key=lambda kd: kinds[kd]["mean_decode_batch"])
            large = max(decode, key=lambda kd: kinds[kd]["mean_decode_batch"])
            db = kinds[large]["mean_decode_batch"] - kinds[small]["mean_decode_batch"]
            if db > 0:
                rs, rl = by_kind[small], by_kind[large]
                ns, nl = self.kinds[small]["steps"], self.kinds[large]["steps"]
                per = []
                for f in set(rs) | set(rl):
                    cs, ts, _ = rs.get(f, (0, 0.0, 0.0))
                    cl, tl, _ = rl.get(f, (0, 0.0, 0.0))
                    per.append({"function": f, "us_per_seq": 1e6 * (tl / nl - ts / ns) / db,
                                "calls_per_seq": (cl / nl - cs / ns) / db})
                per.sort(key=lambda r: -r["us_per_seq"])
                wall_slope = (kinds[large]["wall_us_per_step"] - kinds[small]["wall_us_per_step"]) / db
                out["per_sequence"] = {"from": small, "to": large, "wall_us_per_seq": wall_slope,
                                       "functions": per[:top]}
        return out

    def dump(self, folder: Path | str) -> list[Path]:
        """Each kind's statistics as `folder/<kind>.pstats` (`python -m pstats FILE`); the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for kind, k in sorted(self.kinds.items()):
            p = folder / f"{_safe(kind)}.pstats"
            k["stats"].dump_stats(str(p))
            paths.append(p)
        return paths
