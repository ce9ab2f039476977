"""On/off settings read from the environment ($FASTRAG_* diagnosis and scheduling switches)."""

from __future__ import annotations

import os

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
