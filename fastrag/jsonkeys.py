"""JSON objects that give a key twice: `json.loads` keeps the last value silently, so an edit to the first changes
nothing and a record can carry a value no one meant. `unique_keys` is the object_pairs_hook every reader of this
package's JSON inputs (method configs, data files, corpora) passes to refuse them by name."""

from __future__ import annotations

from typing import Any


class RepeatedKey(ValueError):
    """A JSON object gave `key` twice (raised from inside json.loads; the reader names its file and line)."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} is given twice in one object (JSON keeps the last silently)")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: the object as a dict, or RepeatedKey for its first key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise RepeatedKey(k)
            seen.add(k)
    return out
