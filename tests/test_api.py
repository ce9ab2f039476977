"""The public API (fastrag.api): RAG.run on the real embedded SmolLM2 and the bundled passages, in memory and into a
results folder; configs from a dict and from a file alike; clear errors for bad inputs; `import fastrag` stays
cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fastrag
from fastrag import BM25, RAG, EngineConfig, methods

QUESTIONS = ["Which magazine was started first, Arthur's Magazine or First for Women?",
             {"question": "Who was born first, Albert Einstein or Niels Bohr?", "answers": ["Niels Bohr"]}]
SMALL = {"generate_max_length": 16, "fewshot": 2}  # (short generations for CI)


@pytest.fixture(scope="module")
def rag():
    r = RAG(model="smollm2", retriever=BM25(), batch_size=4, kv_cache_gb=0.5)
    yield r
    r.close()


def test_import_is_cheap_and_names_are_public():
    code = ("import sys, fastrag; from fastrag import RAG, BM25, Dense, Elasticsearch, EngineConfig; "
            "print(sorted(m for m in ('torch', 'fastrag.engine', 'fastrag.eval') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert {"RAG", "BM25", "Dense", "Elasticsearch", "EngineConfig", "methods"} <= set(fastrag.__all__)


def test_methods_lists_the_registry():
    m = methods()
    assert {"dragin", "flare", "wo-rag", "beamsearchqa"} <= set(m) and all(isinstance(d, str) and d for d in
                                                                            m.values())
    assert fastrag.methods() == m  # (the package is the listing too)


def test_run_in_memory(rag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (nothing may be written: not here either)
    results = rag.run(QUESTIONS, method="dragin", dataset="hotpotqa", config=SMALL, progress=False)
    assert len(results) == 2 and list(tmp_path.iterdir()) == []
    a, b = results
    assert a.question == QUESTIONS[0] and b.question == QUESTIONS[1]["question"]
    assert a.error is None and b.error is None and isinstance(a.prediction, str) and isinstance(b.prediction, str)
    assert a.metrics == {} and a.gold == []  # (no gold answers: no EM/F1)
    assert set(b.metrics) >= {"em", "f1"} and b.gold == ["Niels Bohr"]
    m = results.metrics
    assert m["n"] == 2 and m["errors"] == 0 and m["em"] == b.metrics["em"] and m["f1"] == b.metrics["f1"]
    assert m["questions_per_s"] > 0 and m["tokens_per_s"] > 0 and m["computed_this_run"] == 2
    assert "engine" in m and "retrieval" in m and "all_runs" not in m
    assert results.predictions == [a.prediction, b.prediction]


def test_run_into_a_folder_matches_fastrag_run_files(rag, tmp_path):
    out = tmp_path / "o"
    first = rag.run(QUESTIONS, method="wo-rag", dataset="hotpotqa", config=SMALL, out=out, progress=False)
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    # (the file in the order the answers finished, the Results in the questions' order)
    assert sorted(r["question"] for r in recs) == sorted(r.question for r in first)
    assert [r.question for r in first] == [QUESTIONS[0], QUESTIONS[1]["question"]]
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["n"] == 2 and on_disk["em"] == first.metrics["em"] and on_disk["all_runs"]["runs"] == 1
    again = rag.run(QUESTIONS, method="wo-rag", dataset="hotpotqa", config=SMALL, out=out, progress=False)
    assert again.metrics["computed_this_run"] == 0  # (resumed: every answer was there)
    assert [r.prediction for r in again] == [r.prediction for r in first]


def test_config_from_dict_equals_config_from_file(tmp_path):
    from fastrag.methods.registry import make_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps(SMALL))
    for method in ("dragin", "flare", "wo-rag", "token-rag", "dragin-streaming"):
        assert make_config(method, "hotpotqa", SMALL) == make_config(method, "hotpotqa", path)
        assert make_config(method, "hotpotqa", SMALL) == make_config(method, "hotpotqa", str(path))
    with pytest.raises(ValueError, match="config: unknown config field 'nope'"):
        make_config("dragin", "hotpotqa", {"nope": 1})


def test_bad_inputs_say_what_is_wrong(rag):
    with pytest.raises(ValueError, match="unknown method 'dargin'; available: .*dragin"):
        rag.run(["q"], method="dargin")
    with pytest.raises(ValueError, match=r"questions\[1\]: unknown key 'answer'"):
        rag.run(["q", {"question": "p", "answer": ["x"]}], method="wo-rag")
    with pytest.raises(ValueError, match=r"questions\[0\]: 'question' must be a string"):
        rag.run([{"answers": ["x"]}], method="wo-rag")
    with pytest.raises(ValueError, match=r"questions\[1\]: id 'a' repeats questions\[0\]'s"):
        rag.run([{"question": "p", "id": "a"}, {"question": "q", "id": "a"}], method="wo-rag")
    with pytest.raises(ValueError, match="wrap one question in a list"):
        rag.run({"question": "p"}, method="wo-rag")
    with pytest.raises(ValueError, match="unknown dataset"):
        rag.run(["q"], method="wo-rag", dataset="no such set")
    with pytest.raises(TypeError, match="unknown engine setting 'batchsize'"):
        RAG(batchsize=3)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        EngineConfig(batch_size=0)


def test_qids_and_answer_aliases_on_questions_in_memory(rag, tmp_path):
    """qids picks questions by id (the "q<index>" given ids included) before anything is computed; answer_aliases
    adds the aliases of a question's answer_id to its gold answers without changing the caller's dicts."""
    aliases = tmp_path / "id_aliases.json"
    aliases.write_text(json.dumps({"Q7": ["Bohr"]}))
    qs = [QUESTIONS[0], {**QUESTIONS[1], "answer_id": "Q7"}]
    results = rag.run(qs, method="wo-rag", config=SMALL, progress=False, qids=["q1"], answer_aliases=aliases)
    assert [r.qid for r in results] == ["q1"] and results[0].gold == ["Niels Bohr", "Bohr"]
    assert qs[1]["answers"] == ["Niels Bohr"] and results.metrics["n"] == 1
    with pytest.raises(ValueError, match=r"^1 question id\(s\) of qids are not among the questions given: "
                                         r"\['nope'\]$"):
        rag.run(QUESTIONS, method="wo-rag", qids=["nope"], progress=False)
    with pytest.raises(ValueError, match="no question has an 'answer_id' field"):
        rag.run(QUESTIONS, method="wo-rag", answer_aliases=aliases, progress=False)


def test_stream_gives_the_answer_and_run_waits_for_close(rag):
    import asyncio

    async def one():
        kinds, answer = [], None
        async for ev in rag.stream(QUESTIONS[1]["question"], method="wo-rag", dataset="hotpotqa", config=SMALL):
            kinds.append(ev.kind)
            if ev.kind == "answer":
                answer = ev.data["result"]
        return kinds, answer

    kinds, answer = asyncio.run(one())
    assert kinds[-1] == "answer" and "token" in kinds and isinstance(answer["prediction"], str)
    with pytest.raises(RuntimeError, match="serving front is open"):
        rag.run(["q"], method="wo-rag")
    rag.close()
