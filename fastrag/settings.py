"""Every FASTRAG_* environment variable the package reads, parsed in one place.

`VARIABLES` lists them with their rule (a switch, a choice, a count, seconds, a step window, a comma list, text or a
folder) and default; `setting(NAME)` reads one through that rule, `snapshot()` all of them (what a run's
metrics.json records under `environment.resolved`). The rest of the package never reads the environment for a
FASTRAG_* name itself (tests/test_layout.py holds it to that): a module asks `setting`, then decides what "auto"
means on its device. A bad value is a ValueError naming the variable and what it takes. docs/environment.md lists
the same variables with what each changes and when it is read (tests/test_layout.py compares the two lists).

Switches take 1/true/on/yes and 0/false/off/no, in any case; unset or blank is the default.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Variable:
    """One variable's rule. kind: "switch" (off unless on), "setting" (None unless set: on or off), "auto"
    ("auto" unless set: on or off), "choice" (one of `choices`), "count" (an integer >= least), "seconds" (in
    [lo, hi]), "window" (FIRST:COUNT engine steps), "sdpa" ("torch" or a comma list of `choices`), "text",
    "folder". default: the value when unset or blank."""

    name: str
    kind: str
    default: Any = None
    choices: tuple[str, ...] = ()
    least: int = 0
    lo: float = 0.0
    hi: float = 0.0
    what: str = ""  # what a bad value is told it should be, where the rule alone says too little


SDPA_CHOICES = ("flash", "efficient", "cudnn", "math")

VARIABLES: dict[str, Variable] = {v.name: v for v in (
    # retrieval and storage
    Variable("FASTRAG_CACHE", "folder", Path.home() / ".cache" / "fastrag"),
    Variable("FASTRAG_ES_URL", "text", "http://localhost:9200"),
    Variable("FASTRAG_ES_INDEX", "text", "wiki"),
    Variable("FASTRAG_INDEX_WORKERS", "count", None, least=1, what="a number of processes"),
    Variable("FASTRAG_BM25_NATIVE", "setting"),
    # kernels and attention (read when an Engine or a model is built)
    Variable("FASTRAG_SIGNALS_BACKEND", "text", None),
    Variable("FASTRAG_DECODE_ATTENTION", "choice", "native", ("native", "triton", "torch")),
    Variable("FASTRAG_PREFIX_FLASH", "switch", False),
    Variable("FASTRAG_FUSED_DECODE", "choice", "auto", ("auto", "1", "0")),
    Variable("FASTRAG_FUSED_PREFILL", "choice", "auto", ("auto", "0")),
    Variable("FASTRAG_PAGED_PREFILL", "auto", "auto"),
    Variable("FASTRAG_CASCADE_PREFILL", "choice", "auto", ("auto", "0")),
    Variable("FASTRAG_PREFILL_GQA", "choice", "auto", ("auto", "native", "expand")),
    Variable("FASTRAG_SDPA", "sdpa", ("flash", "efficient", "math"), SDPA_CHOICES),
    Variable("FASTRAG_CPU_GEMM", "choice", "onednn", ("onednn", "torch")),
    Variable("FASTRAG_CUDA_GRAPHS", "setting"),
    Variable("FASTRAG_PREFILL_GRAPHS", "setting"),
    Variable("FASTRAG_PASS_GRAPHS", "setting"),
    Variable("FASTRAG_PREFILL_GRAPH_TOKENS", "count", None, least=16,
             what="an integer (the smallest token bucket is 16)"),
    # scheduling
    Variable("FASTRAG_PREFILL_HOLD", "count", None),
    Variable("FASTRAG_MIX_PREFILL", "count", None, what="0 or 1"),
    Variable("FASTRAG_ASYNC_PREFILL", "count", None, what="0 or 1"),
    Variable("FASTRAG_TEXT_GROUPS", "setting"),
    Variable("FASTRAG_TEXT_LOCKSTEP", "switch", False),
    Variable("FASTRAG_SWITCH_INTERVAL", "seconds", None, lo=1e-6, hi=1.0),
    # diagnostics (fastrag.probe.Probe)
    Variable("FASTRAG_STEP_TRACE", "switch", False),
    Variable("FASTRAG_KERNEL_PROFILE", "window", None),
    Variable("FASTRAG_LAUNCH_PROFILE", "switch", False),
    Variable("FASTRAG_SYNC_WATCH", "switch", False),
)}
# the counts that are 0 or 1
_BINARY = ("FASTRAG_MIX_PREFILL", "FASTRAG_ASYNC_PREFILL")


def _switch(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _ON:
        return True
    if low in _OFF:
        return False
    raise ValueError(f"${name}={raw!r}: expected 1 or 0")


def parse(var: Variable, raw: str | None) -> Any:
    """`raw` (the variable's text, None when unset) read by `var`'s rule; unset or blank gives the default."""
    name = var.name
    text = "" if raw is None else raw.strip()
    if not text:
        return var.default
    kind = var.kind
    if kind in ("switch", "setting"):
        return _switch(name, text)
    if kind == "auto":
        if text.lower() == "auto":
            return "auto"
        try:
            return _switch(name, text)
        except ValueError:
            raise ValueError(f"${name}={raw!r}: expected auto, 1 or 0") from None
    if kind == "choice":
        if text not in var.choices:
            raise ValueError(f"${name}={raw!r}: expected {_or(var.choices)}")
        return text
    if kind == "count":
        hi = 1 if name in _BINARY else None
        if not text.isdigit() or int(text) < var.least or (hi is not None and int(text) > hi):
            raise ValueError(f"${name}={raw!r}: expected {var.what or 'an integer'} >= {var.least}"
                             if hi is None else f"${name}={raw!r}: expected 0 or 1")
        return int(text)
    if kind == "seconds":
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"${name}={raw!r}: expected seconds, e.g. 0.0005") from None
        if not (math.isfinite(v) and var.lo <= v <= var.hi):
            raise ValueError(f"${name}={raw!r}: expected seconds in [{var.lo:g}, {var.hi:g}]")
        return v
    if kind == "window":
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", text)
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"${name}={raw!r}: expected FIRST:COUNT, the first engine step to profile and how "
                             "many (COUNT >= 1), e.g. 200:40")
        return int(m.group(1)), int(m.group(2))
    if kind == "sdpa":
        if text == "torch":
            return "torch"
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names or any(n not in var.choices for n in names):
            raise ValueError(f"${name}={raw!r}: expected 'torch' or a comma list of {', '.join(var.choices)}")
        return names
    if kind == "folder":
        return Path(text).expanduser()
    return text  # "text"


def _or(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """$name read by its rule in VARIABLES (environ: os.environ unless given). A name not in VARIABLES is a
    KeyError: every variable the package reads is listed there."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a fastrag setting (fastrag.settings.VARIABLES)") from None
    return parse(var, (os.environ if environ is None else environ).get(name))


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every variable's value as a run reads it (defaults included), JSON-ready: what metrics.json records. A bad
    value is recorded as the error it raises, not raised: the run that reads it fails by itself."""
    out: dict[str, Any] = {}
    for name in VARIABLES:
        if name == "FASTRAG_CACHE":  # (a folder, not a setting of the run)
            continue
        try:
            v = setting(name, environ)
        except ValueError as e:
            v = f"error: {e}"
        out[name] = list(v) if isinstance(v, tuple) else v
    return out


def set_in_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The FASTRAG_* variables set, as written (FASTRAG_CACHE left out: a folder, not a setting of the run): two runs
    of one command differ by these. Names not in VARIABLES are kept too, so a misspelt switch shows in the record."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith("FASTRAG_") and k != "FASTRAG_CACHE"}


# the FASTRAG_SWITCH_INTERVAL seconds: the interpreter's switch interval while a QuestionLoop runs
# (sys.setswitchinterval; Python's default 0.005). Every torch call lets the GIL go while it runs; when another thread
# runs Python meanwhile (the search thread, the text workers' readers), the launching thread may wait up to this long
# to take it back, per call (benchmarks/bench_host.py, the launch beside another thread)
SWITCH_INTERVAL_ENV = "FASTRAG_SWITCH_INTERVAL"


def switch_interval_setting() -> float | None:
    """$FASTRAG_SWITCH_INTERVAL in seconds (1e-6 to 1), None when unset; a bad value is an error naming it."""
    return setting(SWITCH_INTERVAL_ENV)


@contextlib.contextmanager
def switch_interval():
    """Within: the interpreter's switch interval from $FASTRAG_SWITCH_INTERVAL (switch_interval_setting), the one
    before restored after; unset or blank: nothing changes. Yields the interval in force."""
    v = switch_interval_setting()
    old = sys.getswitchinterval()
    if v is None:
        yield old
        return
    sys.setswitchinterval(v)
    try:
        yield v
    finally:
        sys.setswitchinterval(old)
