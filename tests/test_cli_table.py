"""The summary table `fastrag run` / `parity` print: nested blocks (environment, engine counters) as dotted rows."""

from __future__ import annotations

import json

from fastrag.cli import _flat_rows, _print_table


def test_nested_blocks_become_dotted_rows_and_values_keep_their_meaning():
    m = {"em": 0.123456, "n": 8, "environment": {"device": "AMD EPYC, 2 cores", "git": {"commit": "ab" * 20,
                                                                                          "dirty": False}},
         "engine": {}, "queries": ["a b", "c"]}
    rows = dict(_flat_rows(m))
    assert list(rows) == ["em", "n", "environment.device", "environment.git.commit", "environment.git.dirty",
                          "engine", "queries"]
    assert rows["em"] == "0.1235"
    assert rows["n"] == "8"
    assert rows["environment.device"] == "AMD EPYC, 2 cores"
    assert rows["environment.git.commit"] == "ab" * 20
    assert rows["environment.git.dirty"] == "False"
    assert rows["engine"] == "{}"
    assert json.loads(rows["queries"]) == ["a b", "c"]


def test_printed_table_shows_each_nested_field_on_its_own_line(capsys):
    _print_table("fastrag run", {"f1": 0.5, "environment": {"python": "3.11.7", "torch": "2.13.0+cpu"}})
    lines = capsys.readouterr().out.splitlines()
    assert any("environment.python" in ln and "3.11.7" in ln for ln in lines)
    assert any("environment.torch" in ln and "2.13.0+cpu" in ln for ln in lines)
    assert not any("{" in ln for ln in lines)  # no JSON cell
