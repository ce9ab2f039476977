"""Settings read from the environment: on/off switches ($FASTRAG_* diagnosis and scheduling) and seconds."""

from __future__ import annotations

import contextlib
import math
import os
import sys

_ON = ("1", "true", "on", "yes")
_OFF = ("", "0", "false", "off", "no")


def env_switch(name: str) -> bool:
    """$name as a switch: 1/true/on/yes turn it on, 0/false/off/no or unset leave it off (any case, spaces
    ignored); anything else is an error naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    raise ValueError(f"${name}={os.environ[name]!r}: expected 1 or 0")


def env_setting(name: str) -> bool | None:
    """$name as a switch that may be left unset: None when unset or blank (the caller's default), else as
    env_switch reads it."""
    if not os.environ.get(name, "").strip():
        return None
    return env_switch(name)


# seconds: the interpreter's switch interval while a QuestionLoop runs (sys.setswitchinterval; Python's default 0.005).
# Every torch call lets the GIL go while it runs; when another thread runs Python meanwhile (the search thread, the
# text workers' readers), the launching thread may wait up to this long to take it back, per call
# (benchmarks/bench_host.py, the launch beside another thread; docs/performance.md).
SWITCH_INTERVAL_ENV = "FASTRAG_SWITCH_INTERVAL"


def env_int(name: str, least: int = 0, what: str = "an integer") -> int | None:
    """$name as a whole number >= least (digits only); None when unset or blank. Anything else is an error naming
    the variable and `what` it should be."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < least:
        raise ValueError(f"${name}={os.environ[name]!r}: expected {what} >= {least}")
    return int(raw)


def env_seconds(name: str, lo: float, hi: float) -> float | None:
    """$name as seconds in [lo, hi]; None when unset or blank. Anything else is an error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"${name}={os.environ[name]!r}: expected seconds, e.g. 0.0005") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"${name}={os.environ[name]!r}: expected seconds in [{lo:g}, {hi:g}]")
    return v


def switch_interval_setting() -> float | None:
    """$FASTRAG_SWITCH_INTERVAL in seconds (1e-6 to 1), None when unset; a bad value is an error naming it."""
    return env_seconds(SWITCH_INTERVAL_ENV, 1e-6, 1.0)


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
