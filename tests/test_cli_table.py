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


def test_run_summary_line_names_the_headline_figures_and_where_the_rest_is():
    from fastrag.cli import _parity_summary, _run_summary

    line = _run_summary({"method": "dragin", "dataset": "hotpotqa", "n": 8, "errors": 1, "em": 0.125, "f1": 0.15625,
                         "accuracy": None, "questions_per_s": 0.1027, "tokens_per_s": 152.7,
                         "retrievals_per_question": 2.25}, "runs/q")
    assert line.startswith("dragin on hotpotqa: 8 questions, 1 failed (scores over the others);")
    for part in ("EM 0.125", "F1 0.156", "0.103 questions/s", "152.7 tokens/s", "2.25 retrievals/question",
                 "runs/q/metrics.json"):
        assert part in line, part
    assert "accuracy" not in line
    sq = _run_summary({"method": "flare", "dataset": "strategyqa", "n": 0, "errors": 3, "em": None, "f1": None,
                       "accuracy": 0.5, "questions_per_s": None}, "o")
    assert "EM n/a, F1 n/a, accuracy 0.500" in sq and "3 failed" in sq
    p = _parity_summary({"method": "flare", "dataset": "2wikimultihopqa", "n": 25, "agreement": 0.96,
                         "disagreements": [{"id": "x"}], "engine_em": 0.0, "oracle_em": 0.04}, "runs/p")
    assert "agreement 0.96 over 25 questions, 1 disagreements" in p and "runs/p/parity.json" in p
    assert "oracle 0.040" in p


def test_num_workers_without_ray_is_refused(tmp_path, capsys):
    from fastrag.cli import main

    assert main(["run", "--method", "wo-rag", "--dataset", "hotpotqa", "--num-workers", "3",
                 "--output", str(tmp_path / "o")]) == 2
    assert "--num-workers shards the questions over Ray workers: add --ray" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_the_table_leaves_out_the_resolved_settings_but_keeps_the_ones_set(capsys):
    from fastrag.settings import snapshot

    m = {"f1": 0.5, "environment": {"python": "3.11.7", "settings": {"FASTRAG_SDPA": "math"},
                                    "resolved": snapshot({"FASTRAG_SDPA": "math"})}}
    _print_table("fastrag run", m)
    out = capsys.readouterr().out
    assert "environment.settings.FASTRAG_SDPA" in out and "environment.resolved" not in out
    assert "resolved" in m["environment"]  # (the caller's dict, metrics.json's record, is left whole)
