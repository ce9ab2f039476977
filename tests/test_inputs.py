"""Input files and output folders that are not the bundled ones: a results folder keeps the answers of one run
(method, config, model, retriever, corpus, decoding) and of one data file; reruns recompute failed questions and
count each question once; data, config and corpus files with a byte-order mark, raw line separators inside JSON
strings, no titles, typos in a config, or no usable question get a clear outcome. A tiny random model and an
in-memory retriever keep it fast (test_e2e runs the real ones)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from fastrag.config import ConfigError, load_dragin_config
from fastrag.data.datasets import DataError, load_examples
from fastrag.eval import BUNDLED, RunOptions, build_engine, check_manifest, run
from fastrag.retrieval.base import Doc, Retriever

CORPUS = BUNDLED / "wiki_passages.jsonl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    return make("tiny", tmp_path_factory.mktemp("tiny"), dtype=torch.float32, device="cpu")


class Passages(Retriever):
    def __init__(self, down: bool = False):
        self.down = down

    def search(self, queries, k):
        if self.down:
            raise ConnectionError("search backend unreachable")
        return [[Doc(f"d{j}", f"T{j}", f"passage {j} on {q[:16]}") for j in range(k)] for q in queries]


def nq_file(path, questions):
    """An NQ-open file (no ids: a question's id is its position)."""
    path.write_text("".join(json.dumps({"question": q, "answer": [f"a{i}"]}) + "\n" for i, q in enumerate(questions)))
    return path


QUESTIONS = [f"who wrote book number {i}?" for i in range(6)]


@pytest.fixture
def setup(tiny, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 0}))
    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)

    def go(out="o", retriever=None, **kw):
        opts = dict(method="sr-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / out),
                    model=tiny, config=str(cfg), batch_size=4, progress=False)
        opts.update(kw)
        return run(RunOptions(**opts), engine=build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu"),
                   retriever=retriever or Passages())

    return go, tmp_path, cfg, data


def records(path):
    return [json.loads(x) for x in path.read_text().split("\n") if x]


# ------------------------------------------------------------------------------------------ output folders
def test_a_rerun_of_another_run_into_the_folder_is_refused(setup):
    go, tmp, cfg, _ = setup
    go(limit=2)
    go(limit=3, batch_size=2)  # the same run (other batch size, more questions): resumes
    assert len(records(tmp / "o" / "results.jsonl")) == 3
    with pytest.raises(ValueError, match=r"another run \(method: 'sr-rag' there, 'wo-rag' now"):
        go(method="wo-rag", limit=3)
    other = tmp / "c2.json"
    other.write_text(json.dumps({"generate_max_length": 5, "fewshot": 0}))
    with pytest.raises(ValueError, match=r"config\.generate_max_length: 4 there, 5 now"):
        go(config=str(other), limit=3)
    with pytest.raises(ValueError, match="seed: 0 there, 3 now"):
        go(temperature=0.5, seed=3, limit=3)
    assert len(records(tmp / "o" / "results.jsonl")) == 3  # nothing written by the refused runs
    # greedy decoding draws no random number: another --seed is the same run (it was refused as another one)
    assert go(seed=3, limit=4)["computed_this_run"] == 1


def test_the_refusal_names_what_the_run_is_before_config_fields(tmp_path):
    """Another method with many config differences: the message leads with the method (not cut off behind four
    config fields) and says how many differences it left out."""
    out = tmp_path / "o"
    out.mkdir()
    cfg = {f"f{i}": i for i in range(6)}
    check_manifest(out, {"method": "dragin", "model": "m", "config": cfg})
    (out / "results.jsonl").write_text(json.dumps({"qid": "q0"}) + "\n")
    with pytest.raises(ValueError) as e:
        check_manifest(out, {"method": "flare", "model": "m", "config": {k: v + 1 for k, v in cfg.items()}})
    assert re.search(r"another run \(method: 'dragin' there, 'flare' now; config\.f0: 0 there, 1 now; .*; and 3 "
                     r"more\)", str(e.value)), str(e.value)


def test_a_run_that_failed_before_computing_does_not_hold_the_folder(setup):
    """A run that wrote run.json and then stopped before its first record (a model path that does not exist, a
    corpus line without text) computed nothing: the corrected run into the same folder goes on; once a record is
    there, another run is refused again."""
    go, tmp, cfg, _ = setup
    out = tmp / "o"
    out.mkdir()
    check_manifest(out, {"method": "sr-rag", "model": "/no/such/model", "config": {"fewshot": 0}})
    assert go(limit=2)["computed_this_run"] == 2  # the fixed run goes on, and the folder is now its
    assert json.loads((out / "run.json").read_text())["model"] != "/no/such/model"
    with pytest.raises(ValueError, match=r"another run \(method: 'sr-rag' there, 'wo-rag' now"):
        go(method="wo-rag", limit=2)
    (out / "results.jsonl").write_text("")  # an empty results file holds nothing either
    assert go(method="wo-rag", limit=2)["computed_this_run"] == 2


def test_more_demos_than_the_dataset_has_is_a_config_error(setup):
    go, tmp, _, _ = setup
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"generate_max_length": 4, "fewshot": 500}))
    with pytest.raises(ConfigError, match=r"bad\.json: fewshot is 500 but nq has only \d+ exemplars"):
        go(config=str(bad), limit=2)
    assert not (tmp / "o" / "run.json").exists()  # refused before the folder is claimed


def test_a_refused_run_leaves_no_folder_it_made(setup):
    """A run that fails before its first record removes the folders it created (the output and its missing
    parents); a folder that was there before stays, with what an earlier run put in it."""
    go, tmp, cfg, data = setup
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"generate_max_length": 4, "fewshot": 500}))
    with pytest.raises(ConfigError):  # refused while the config is read
        go(output=str(tmp / "new" / "deeper" / "o"), config=str(bad), limit=2)
    assert not (tmp / "new").exists() and tmp.exists()
    with pytest.raises(FileNotFoundError):  # failed after claiming the folder (run.json), before a record
        run(RunOptions(method="sr-rag", dataset="nq", data=str(data), corpus=str(CORPUS), config=str(cfg),
                       output=str(tmp / "p" / "o"), model=str(tmp / "no-such-model"), limit=2, progress=False))
    assert not (tmp / "p").exists()
    (tmp / "o").mkdir()
    check_manifest(tmp / "o", {"method": "sr-rag", "model": "/no/such/model", "config": {"fewshot": 0}})
    with pytest.raises(ConfigError):
        go(config=str(bad), limit=2)
    assert (tmp / "o" / "run.json").exists()  # not made by the refused run: it stays


def test_records_of_other_data_are_refused(setup):
    go, tmp, _, data = setup
    go(limit=3)
    nq_file(data, ["an inserted question?"] + QUESTIONS)  # every later position-derived id shifts
    with pytest.raises(ValueError, match=r"results\.jsonl: line 1: question 'nq-0' reads .* other data"):
        go(limit=3)
    long = "in which year did the author of the very long series of novels about the sea " + "x" * 60
    nq_file(data, [long + "?"] + QUESTIONS)
    go(output=str(tmp / "o2"), limit=1)
    nq_file(data, [long + " Please?"] + QUESTIONS)  # the same first 130 characters: the message shows the end
    with pytest.raises(ValueError, match=r"reads '\.\.\.x+\?' there but '\.\.\.x+ Please\?' in the data"):
        go(output=str(tmp / "o2"), limit=1)


def test_metrics_count_each_selected_question_once(setup):
    """A question with two records (two runs into one folder, by older versions) counts once, by its last record,
    and the resume leaves the file with that record alone."""
    go, tmp, _, _ = setup
    go(limit=4)
    res = tmp / "o" / "results.jsonl"
    lines = res.read_text().split("\n")
    older = json.loads(lines[0]) | {"text": "an older answer"}
    res.write_text("\n".join([json.dumps(older)] + lines))
    m = go(limit=2)
    assert m["n"] == 2 and m["computed_this_run"] == 0
    recs = records(res)
    assert [r["qid"] for r in recs] == [f"nq-{i}" for i in range(4)]
    assert recs[0]["text"] == json.loads(lines[0])["text"] != older["text"]
    m = go(limit=4)
    assert m["n"] == 4 and m["computed_this_run"] == 0


def test_a_last_record_without_its_newline_is_kept_apart(setup):
    go, tmp, _, _ = setup
    go(limit=2)
    res = tmp / "o" / "results.jsonl"
    res.write_bytes(res.read_bytes().rstrip(b"\n"))  # e.g. an editor that strips the final newline
    assert go(limit=4)["computed_this_run"] == 2  # (the record without its newline is kept, not computed again)
    recs = records(res)  # every line one record
    assert [r["qid"] for r in recs] == [f"nq-{i}" for i in range(4)]
    assert go(limit=4)["computed_this_run"] == 0


def test_a_broken_line_inside_the_results_is_named_and_nothing_is_cut(setup):
    """Only a last line can be a record torn by a kill: a line that is no record before others is named, and the
    file is left as it is (cutting there would lose every record after it)."""
    go, tmp, _, _ = setup
    go(limit=3)
    res = tmp / "o" / "results.jsonl"
    lines = res.read_text().split("\n")
    for bad in ('{"qid": "nq-1", "quest', "", "[1, 2]"):
        body = "\n".join(lines[:1] + [bad] + lines[1:])
        res.write_text(body)
        with pytest.raises(ValueError, match=r"results\.jsonl: line 2 is not a result record"):
            go(limit=3)
        assert res.read_text() == body


def test_failed_questions_are_computed_again_on_a_rerun(setup):
    go, tmp, _, _ = setup
    with pytest.warns(RuntimeWarning, match="retrieval failed"):
        m = go(limit=3, retriever=Passages(down=True))
    assert m["errors"] == 3
    assert m["questions_per_s"] == 0 and m["questions_measured"] == 0  # failed questions are no throughput
    m = go(limit=3)
    assert m["errors"] == 0 and m["computed_this_run"] == 3 and m["n"] == 3
    assert m["questions_per_s"] > 0 and m["questions_measured"] == 3
    recs = records(tmp / "o" / "results.jsonl")  # (the rerun replaced the error records: one per question)
    assert len(recs) == 3 and not any(r["error"] for r in recs)
    assert go(limit=3)["computed_this_run"] == 0


def test_the_joint_rate_of_runs_whose_questions_all_failed_is_zero(setup, tiny):
    """run_many's joint questions/s counts answered questions, as each run's questions_per_s does: questions whose
    retrieval failed were computed (computed_this_run) but are no throughput."""
    from fastrag.eval import run_many

    _, tmp, cfg, data = setup
    opts = [RunOptions(method="sr-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp / out),
                       model=tiny, config=str(cfg), batch_size=4, progress=False, limit=2) for out in ("j1", "j2")]
    with pytest.warns(RuntimeWarning, match="retrieval failed"):
        ms = run_many(opts, engine=build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu"),
                      retriever=Passages(down=True))
    for m in ms:
        assert m["errors"] == 2 and m["questions_per_s"] == 0 and m["questions_measured"] == 0
        assert m["joint"]["computed_this_run"] == 4 and m["joint"]["wall_s"] > 0
        assert m["joint"]["questions_per_s"] == 0


def test_an_empty_question_fails_alone_and_is_computed_once_filled_in(setup):
    """A question left empty in the data is an error record that each rerun computes again (replacing the record,
    not adding one); once the data file fills it in, the rerun computes it and keeps the other answers (its error
    record, which holds no answer, is not taken for results of other data)."""
    go, tmp, _, data = setup
    questions = QUESTIONS[:3]
    questions[1] = ""
    nq_file(data, questions)
    m = go(limit=3)
    assert m["errors"] == 1 and m["computed_this_run"] == 3
    res = tmp / "o" / "results.jsonl"
    for _ in range(2):
        m = go(limit=3)
        assert m["errors"] == 1 and m["computed_this_run"] == 1
        recs = records(res)
        assert [r["qid"] for r in recs] == ["nq-0", "nq-2", "nq-1"] and "empty question" in recs[2]["error"]
    nq_file(data, QUESTIONS)
    m = go(limit=3)
    assert m["errors"] == 0 and m["computed_this_run"] == 1 and m["n"] == 3
    recs = records(res)
    assert [(r["qid"], r["question"], r["error"]) for r in recs] == \
        [("nq-0", QUESTIONS[0], None), ("nq-2", QUESTIONS[2], None), ("nq-1", QUESTIONS[1], None)]
    nq_file(data, QUESTIONS[:1] + ["another question?"] + QUESTIONS[2:])  # an answer of other data: refused
    with pytest.raises(ValueError, match=r"results\.jsonl: line 3: question 'nq-1' reads .* other data"):
        go(limit=3)


def test_a_folder_another_process_writes_is_refused(setup):
    go, tmp, _, _ = setup
    out = tmp / "o"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"f = open({str(out / '.lock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another process is writing to"):
            go(limit=2)
    finally:
        holder.kill()
        holder.wait()
    assert go(limit=2)["computed_this_run"] == 2  # free again


def test_a_rerun_that_computes_nothing_keeps_the_measured_figures(setup):
    go, tmp, _, _ = setup
    first = go(limit=2)
    assert first["computed_this_run"] == 2 and "engine" in first and first["searches_per_question"] == 1
    for _ in range(2):  # (twice: a kept figure is kept again)
        again = go(limit=2)
        assert again["computed_this_run"] == 0 and again["measured_in_an_earlier_run"]
        for k in ("questions_per_s", "questions_measured", "engine", "model_costs", "step_seconds", "retrieval",
                  "environment"):
            assert again[k] == first[k], k
    assert again["em"] == first["em"] and again["n"] == 2
    # no metrics.json to carry the figures over (deleted, or torn by a kill in an older version): no rate was
    # measured, so none is reported (not 0 questions/s); the rate over all runs still comes from runs.jsonl
    (tmp / "o" / "metrics.json").unlink()
    bare = go(limit=2)
    assert bare["computed_this_run"] == 0 and bare["questions_per_s"] is None and bare["tokens_per_s"] is None
    assert "measured_in_an_earlier_run" not in bare and bare["all_runs"]["questions_per_s"] > 0
    assert not list((tmp / "o").glob("*.tmp"))  # metrics.json is written through a temporary file
    # fastrag.perf on a folder whose metrics lack its fields: an error line, not a traceback
    (tmp / "bare").mkdir()
    (tmp / "bare" / "metrics.json").write_text(json.dumps({"n": 1}))
    p = subprocess.run([sys.executable, "-m", "fastrag.perf", str(tmp / "bare")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode != 0 and "fastrag.perf: error:" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_what_a_rerun_carries_over_from_the_metrics_file(tmp_path):
    """measured_fields: the measured figures of a metrics.json whose run computed something (or carried them from one
    that did), marked as such; nothing from a file that is missing, torn, not UTF-8 or no JSON object, or whose run
    computed nothing and carried nothing. Never the derived fields: those are recomputed from the records."""
    from fastrag.eval import measured_fields

    p = tmp_path / "metrics.json"
    assert measured_fields(p) == {}
    for bad in (b'{"computed_this_run": 3, "questions_per_s": 1', b"[1, 2]", b'"x"', b"\xff\xfe{}"):
        p.write_bytes(bad)
        assert measured_fields(p) == {}, bad
    fig = {"questions_per_s": 2.0, "wall_s": 1.5, "engine": {"decode_steps": 7}}
    p.write_text(json.dumps({"computed_this_run": 3, "em": 0.5, "n": 3} | fig))
    assert measured_fields(p) == fig | {"measured_in_an_earlier_run": True}
    assert measured_fields(p, extra=("em",)) == fig | {"em": 0.5, "measured_in_an_earlier_run": True}
    p.write_text(json.dumps({"computed_this_run": 0, "measured_in_an_earlier_run": True} | fig))
    assert measured_fields(p) == fig | {"measured_in_an_earlier_run": True}
    p.write_text(json.dumps({"computed_this_run": 0} | fig))
    assert measured_fields(p) == {}


def test_reading_results_never_changes_the_file(tmp_path):
    """A progress count reads files that a worker is appending to: it must not cut or extend them (a record half
    written when the reader passed would be lost). Only a resume, under the folder's lock, repairs."""
    from fastrag.eval import read_results
    from fastrag.trace import QuestionResult

    rec = [json.dumps(QuestionResult(qid=f"q{i}", question="x?", gold=["a"]).to_json()) for i in range(3)]
    path = tmp_path / "results.jsonl"
    for tail in (rec[2], rec[2][:20]):  # a whole record still without its newline; a record half written
        body = (rec[0] + "\n" + rec[1] + "\n" + tail).encode()
        path.write_bytes(body)
        assert [r.qid for r in read_results(path)] == ["q0", "q1"]
        assert path.read_bytes() == body
    assert [r.qid for r in read_results(path, repair=True)] == ["q0", "q1"]  # under the lock: the torn tail goes
    assert path.read_bytes() == (rec[0] + "\n" + rec[1] + "\n").encode()


def test_resumed_answers_are_scored_against_the_current_gold(setup):
    go, tmp, _, data = setup
    assert go(limit=2)["em"] == 0.0
    preds = {r["qid"]: r["metrics"]["answer"] for r in records(tmp / "o" / "results.jsonl")}
    assert all(p.strip() for p in preds.values()), preds
    # the data file's gold answers corrected (here: to the answers the model gave)
    data.write_text("".join(json.dumps({"question": q, "answer": [preds.get(f"nq-{i}", f"a{i}")]}) + "\n"
                            for i, q in enumerate(QUESTIONS)))
    m = go(limit=2)
    assert m["computed_this_run"] == 0 and m["em"] == 1.0
    # results.jsonl agrees with metrics.json: each question's last record carries the new gold and its score
    recs = records(tmp / "o" / "results.jsonl")
    assert len(recs) == 2 and all(r["metrics"]["em"] == 1.0 and r["gold"] == [preds[r["qid"]]] for r in recs)


def test_answer_aliases_rescore_a_finished_run_without_computing_again(setup):
    """--answer-aliases (2Wiki's id_aliases.json) is scoring only: a rerun into the finished folder with it keeps
    every answer and scores it against the aliases too."""
    go, tmp, _, _ = setup
    data = tmp / "wiki.jsonl"
    data.write_text("".join(json.dumps({"_id": f"w{i}", "question": q, "answer": f"gold {i}", "answer_id": f"Q{i}"})
                            + "\n" for i, q in enumerate(QUESTIONS[:3])))
    m = go(dataset="2wikimultihopqa", data=str(data))
    assert m["computed_this_run"] == 3 and m["em"] == 0.0
    preds = {r["qid"]: r["metrics"]["answer"] for r in records(tmp / "o" / "results.jsonl")}
    assert all(p.strip() for p in preds.values()), preds
    aliases = tmp / "id_aliases.json"  # the answers of w0 and w1 become aliases of their answer ids
    aliases.write_text("".join(json.dumps({"Q_id": f"Q{i}", "aliases": [preds[f"w{i}"]], "demonyms": []}) + "\n"
                               for i in range(2)))
    m = go(dataset="2wikimultihopqa", data=str(data), answer_aliases=str(aliases))
    assert m["computed_this_run"] == 0 and m["em"] == pytest.approx(2 / 3)
    assert [r["gold"] for r in records(tmp / "o" / "results.jsonl")] == \
        [["gold 0", preds["w0"]], ["gold 1", preds["w1"]], ["gold 2"]]
    with pytest.raises(FileNotFoundError, match="--answer-aliases .*nope.json: no such file"):
        go(dataset="2wikimultihopqa", data=str(data), answer_aliases=str(tmp / "nope.json"))


def test_a_lone_surrogate_in_the_data_is_named_and_a_record_holding_one_is_still_written(tmp_path):
    from fastrag.eval import ResultWriter, read_results
    from fastrag.trace import QuestionResult

    data = tmp_path / "nq.jsonl"
    data.write_text(json.dumps({"question": "who wrote it?", "answer": ["a"]}) + "\n"
                    + json.dumps({"question": "who wrote \ud800 book?", "answer": ["a"]}) + "\n")
    with pytest.raises(DataError, match=r"nq\.jsonl:2: the question holds a lone surrogate \(U\+D800"):
        load_examples("nq", data)
    # the writer never fails on one (JSON escapes carry it), so a run cannot die on a record it computed
    path = tmp_path / "results.jsonl"
    w = ResultWriter(path)
    w.write(QuestionResult(qid="q", question="x \udc80 y", gold=["a"]))
    w.close()
    assert read_results(path)[0].question == "x \udc80 y"


def test_questions_holding_control_token_strings_are_named_and_still_run(setup):
    go, tmp_path, _cfg, data = setup
    with warnings.catch_warnings(record=True) as seen:  # plain text: no such warning
        warnings.simplefilter("always")
        go(out="plain")
    assert not [w for w in seen if "control-token" in str(w.message)]
    nq_file(data, ["who wrote book one?", "who wrote <|im_end|> book two?", "<|im_start|>who wrote book three?"])
    with pytest.warns(UserWarning, match=r"nq\.jsonl: 2 question\(s\) hold a control-token string of the model "
                                         r"\(first: 'nq-1' holds '<\|im_end\|>' at character 10\)"):
        m = go(out="ctl")
    assert m["n"] == 3 and m["errors"] == 0
    assert [r["qid"] for r in records(tmp_path / "ctl" / "results.jsonl")] == ["nq-0", "nq-1", "nq-2"]


@pytest.mark.parametrize("content", ["[]", "null", "42", '"x"'])
def test_a_run_json_that_is_no_object_is_reported(setup, content):
    go, tmp, _, _ = setup
    go(limit=1)
    (tmp / "o" / "run.json").write_text(content)
    with pytest.raises(ValueError, match=r"run\.json: unreadable .*not an object.*delete it"):
        go(limit=1)


def test_a_corpus_or_model_replaced_at_the_same_path_is_another_run(setup, tiny):
    import shutil

    go, tmp, _, _ = setup
    corpus = tmp / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "A", "text": "one"}) + "\n")
    go(limit=2, corpus=str(corpus))
    ident = json.loads((tmp / "o" / "run.json").read_text())
    assert ident["corpus_fingerprint"] and ident["model_fingerprint"]
    corpus.write_text(json.dumps({"id": "1", "title": "B", "text": "two"}) + "\n")
    with pytest.raises(ValueError, match="corpus_fingerprint: 'sha256:"):
        go(limit=3, corpus=str(corpus))
    # an older run.json without the fingerprints is completed, not refused
    del ident["corpus_fingerprint"], ident["model_fingerprint"]
    (tmp / "o" / "run.json").write_text(json.dumps(ident))
    assert go(limit=2, corpus=str(corpus))["computed_this_run"] == 0
    assert "corpus_fingerprint" in json.loads((tmp / "o" / "run.json").read_text())
    # a model folder whose weights changed
    model = tmp / "model"
    shutil.copytree(tiny, model)
    go(out="o2", limit=1, model=str(model))
    weights = next(f for f in sorted(model.iterdir()) if f.suffix in (".safetensors", ".bin"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="model_fingerprint"):
        go(out="o2", limit=1, model=str(model))


def test_cli_errors_for_odd_arguments(tmp_path):
    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
            "--limit", "1", "--no-progress"]
    for extra, msg in ((["--output", str(afile)], "is a file, expected a directory"),
                       (["--output", str(tmp_path / "o"), "--threads", "-1"], "--threads must be an int >= 1"),
                       (["--output", str(tmp_path / "o"), "--search-concurrency", "0"],
                        "--search-concurrency must be an int >= 1"),
                       (["--output", str(tmp_path / "o"), "--top-p", "0.5"], "applies only when sampling"),
                       (["--output", str(tmp_path / "o"), "--top-k", "5"], "applies only when sampling"),
                       (["--output", str(tmp_path / "o"), "--top-k", "-2", "--temperature", "0.5"],
                        "--top-k must be an int >= 0"),
                       (["--output", str(tmp_path / "o"), "--temperature", "0.5", "--seed", str(2**64)],
                        "--seed must be an int of 64 bits")):
        p = subprocess.run([sys.executable, "-m", "fastrag", *base, *extra], capture_output=True, text=True)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "fastrag", "parity", "--method", "dragin", *base[3:], "--output",
                        str(afile)], capture_output=True, text=True)
    assert p.returncode == 2 and "is a file, expected a directory" in p.stderr and "Traceback" not in p.stderr, \
        p.stderr
    with pytest.raises(ValueError, match="is a directory"):
        RunOptions(method="wo-rag", dataset="nq", data=str(tmp_path), corpus=str(CORPUS), output=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="finite"):
        RunOptions(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "x"),
                   temperature=float("inf"))
    kw = dict(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "x"))
    for field, flag in (("batch_size", "--batch-size"), ("limit", "--limit")):
        for bad in ("2", 1.5, 2.0, True, 0, -1):  # (a float batch used to reach the engine's slicing)
            with pytest.raises(ValueError, match=f"{flag} must be a positive int, got {re.escape(repr(bad))}"):
                RunOptions(**{**kw, field: bad})
        import numpy as np

        o = RunOptions(**{**kw, field: np.int64(3)})
        assert type(getattr(o, field)) is int and getattr(o, field) == 3
    for bad in ("", "  ", None):  # (Path("") is the current directory)
        with pytest.raises(ValueError, match="--output must name a folder"):
            RunOptions(**{**kw, "output": bad})
    p = subprocess.run([sys.executable, "-m", "fastrag", *base, "--output", ""],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "--output must name a folder" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "results.jsonl").exists()
    with pytest.raises(ValueError, match="--data /dev/null: not a regular file"):
        RunOptions(**{**kw, "data": "/dev/null"})
    for bad in ("nq-1", [1, 2], 5, ["ok", None]):  # (a string was read as the set of its characters)
        with pytest.raises(ValueError, match="qids must be a list or tuple of question ids"):
            RunOptions(**{**kw, "qids": bad})
    assert RunOptions(**{**kw, "qids": ["a", "b"]}).qids == ("a", "b")
    with pytest.raises(ValueError, match=r"1 question id\(s\) of qids are not among the first 1 questions of "
                                         r".*nq\.jsonl: \['nope'\]"):  # (ended as a success with nothing computed)
        run(RunOptions(**{**kw, "qids": ("nope",), "limit": 1}))
    assert not (tmp_path / "x" / "results.jsonl").exists()


def test_a_qids_selection_keeps_the_file_order_and_each_question_once():
    """qids picks questions out of the loaded file: each once however often it is named (a question named twice
    computed twice would be written twice), in the file's order; missing ids are counted and the first three,
    sorted, named, with what was searched (the first LIMIT questions or all) and the word the caller chose."""
    from types import SimpleNamespace

    from fastrag.eval import select_qids

    ex = [SimpleNamespace(qid=q) for q in ("d", "a", "c", "b")]
    opts = SimpleNamespace(qids=None, limit=None, data="q.jsonl")
    assert select_qids(ex, opts) is ex
    picked = select_qids(ex, SimpleNamespace(**{**vars(opts), "qids": ("b", "d", "b")}))
    assert picked == [ex[0], ex[3]]
    for limit, among in ((None, "the questions"), (4, "the first 4 questions")):
        with pytest.raises(ValueError, match=rf"^4 oracle question id\(s\) of qids are not among {among} of q\.jsonl: "
                                             r"\['w', 'x', 'y'\]$"):
            select_qids(ex, SimpleNamespace(qids=("z", "a", "y", "x", "w"), limit=limit, data="q.jsonl"),
                        "oracle question")


def test_a_numpy_integer_seed_is_taken_as_an_int(tmp_path):
    """Python callers often hold a seed as a numpy integer: RunOptions and SamplingParams take any integer type
    (it was refused as 'not an int') and keep a Python int (run.json, the sampling keys); floats, bools and strings
    are still refused by name."""
    import numpy as np

    from fastrag.engine import SamplingParams

    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)
    kw = dict(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "x"))
    for seed in (np.int64(-5), np.uint64(2**64 - 1), np.int32(7)):
        o = RunOptions(**kw, temperature=0.5, seed=seed)
        assert type(o.seed) is int and o.seed == int(seed)
        s = SamplingParams(temperature=0.5, seed=seed)
        assert type(s.seed) is int and s.seed == int(seed)
    for bad in (np.float64(3.0), True, "3", 2.0):
        with pytest.raises(ValueError, match="--seed must be an int of 64 bits"):
            RunOptions(**kw, temperature=0.5, seed=bad)
        with pytest.raises(ValueError, match="seed must be an int of 64 bits"):
            SamplingParams(temperature=0.5, seed=bad)


def test_a_run_whose_every_question_failed_exits_1(tiny, tmp_path):
    """Every question computed in the run failed (here: all empty): the summary is printed and the exit status is
    1 with a line saying so, so that a script does not take the folder for results; one answer makes it 0."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 2, "fewshot": 0}))
    data = nq_file(tmp_path / "nq.jsonl", ["", " "])
    args = [sys.executable, "-m", "fastrag", "run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data),
            "--corpus", str(CORPUS), "--model", str(tiny), "--config", str(cfg), "--kv-cache-gb", "0.05",
            "--no-progress", "--output", str(tmp_path / "o")]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "all 2 questions computed in this run failed" in p.stderr, p.stderr[-2000:]
    assert "2 questions, 2 failed" in p.stdout and "Traceback" not in p.stderr, p.stdout[-2000:]
    nq_file(data, ["", "who wrote book number 1?"])
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "2 questions, 1 failed" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])


@pytest.mark.parametrize("sig,rc,says", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")])
def test_ctrl_c_or_sigterm_says_how_to_go_on_and_the_rerun_resumes(tiny, tmp_path, sig, rc, says):
    """Ctrl-C mid-run, and SIGTERM (a scheduler's stop, `kill`: it ended the run at once with exit status 143 and
    no message), keep the answers written so far, say so, and the rerun goes on from there."""
    import signal
    import time

    total = 40
    data = nq_file(tmp_path / "nq.jsonl", [f"who wrote book number {i}?" for i in range(total)])
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 24, "fewshot": 0}))
    out = tmp_path / "o"
    args = [sys.executable, "-m", "fastrag", "run", "--method", "sr-rag", "--dataset", "nq", "--data", str(data),
            "--corpus", str(CORPUS), "--model", tiny, "--config", str(cfg), "--batch-size", "1", "--kv-cache-gb",
            "0.05", "--threads", "1", "--no-progress", "--output", str(out)]
    # the run starts with SIGINT's default action whatever this process inherited: a test suite started in the
    # background by a shell without job control ignores SIGINT, children inherit that, and Python then installs
    # no KeyboardInterrupt handler (the run went on to the end and exited 0)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    res, deadline = out / "results.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (res.exists() and res.read_text().count("\n") >= 1):
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, (proc.returncode, err[-2000:])
    assert f"fastrag: {says}; the answers written so far are in {out}: rerun the same command" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    n_before = len(records(res))
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert 0 < n_before < total and m["n"] == total and m["computed_this_run"] == total - n_before


def test_ctrl_c_before_the_first_answer_does_not_point_to_answers(tmp_path, monkeypatch, capsys):
    """Interrupted before its first record, a run removes the folder it made; the message said "the answers written
    so far are in DIR", a folder that was not there."""
    from fastrag.api import RAG
    from fastrag.cli import main

    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)
    out = tmp_path / "o"

    def interrupted(rag, *a, **k):  # (Ctrl-C before anything was written; `fastrag run` runs through RAG.run)
        raise KeyboardInterrupt

    monkeypatch.setattr(RAG, "run", interrupted)
    args = ["run", "--method", "wo-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
            "--no-progress", "--output", str(out)]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted before any answer was written" in err and "rerun the same command" in err, err
    assert "answers written so far" not in err
    out.mkdir()
    (out / "results.jsonl").write_text(json.dumps({"qid": "nq-0"}) + "\n")
    assert main(args) == 130
    err = capsys.readouterr().err
    assert f"the answers written so far are in {out}: rerun the same command" in err, err


# --------------------------------------------------------------------------------------------- data files
def test_data_files_with_a_bom_or_raw_line_separators(tmp_path):
    q = "who is\u2028the author\u0085 of \u2029 it?"
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"question": q, "answer": ["x"]}, ensure_ascii=False) + "\n"
                                     + json.dumps({"question": "second?", "answer": ["y"]}) + "\n").encode())
    ex = load_examples("nq", p)
    assert [e.question for e in ex] == [q, "second?"]
    arr = tmp_path / "d.json"
    arr.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"question": "third?", "answer": ["z"]}]).encode())
    assert [e.question for e in load_examples("nq", arr)] == ["third?"]


def test_unreadable_data_files_say_why(tmp_path):
    zst = tmp_path / "d.jsonl"  # (zstd's frame magic: not a format the standard library reads)
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + gzip.compress(b'{"question": "q?", "answer": ["a"]}\n'))
    with pytest.raises(DataError, match=r"d\.jsonl: is zstd-compressed.*zstd -d d\.jsonl"):
        load_examples("nq", zst)
    latin = tmp_path / "l.jsonl"
    latin.write_bytes(b'{"question": "q?", "answer": ["a"]}\n{"question": "caf\xe9?", "answer": ["b"]}\n')
    with pytest.raises(DataError, match=r"l\.jsonl:2: not UTF-8"):
        load_examples("nq", latin)
    iirc = tmp_path / "iirc.json"  # every question unanswerable: nothing to run
    iirc.write_text(json.dumps([{"title": "T", "questions": [
        {"qid": "q1", "question": "why?", "answer": {"type": "none"}, "context": []}]}]))
    with pytest.raises(DataError, match="no question to run"):
        load_examples("iirc", iirc)


def test_questions_without_gold_answers_are_reported(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "a?", "answer": []}) + "\n" + json.dumps({"question": "b?", "answer": ["x"]})
                 + "\n")
    with pytest.warns(UserWarning, match=r"1 question\(s\) have no gold answer \(first: nq-0\)"):
        assert len(load_examples("nq", p)) == 2
    p.write_text(json.dumps({"question": "b?", "answer": ["x"]}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_examples("nq", p)


# ------------------------------------------------------------------------------------------- config files
BASE = {"method": "attn_entropy", "dataset": "hotpotqa", "generate_max_length": 64}


@pytest.mark.parametrize("patch,pattern", [
    ({"hallucination_treshold": 5.0}, "unknown config field 'hallucination_treshold'"),
    ({"generate_max_lenght": 3}, "unknown config field 'generate_max_lenght'"),
    ({"retrieve_keep_ratio": 0.5}, "unknown config field 'retrieve_keep_ratio'"),
    ({"attention_solver": "avg"}, "attention_solver 'avg': only 'max'"),
])
def test_dragin_config_keys_that_would_change_nothing_are_refused(tmp_path, patch, pattern):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**BASE, **patch}))
    with pytest.raises(ConfigError, match=pattern):
        load_dragin_config(p)


def test_dragin_config_refuses_attn_prob(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"method": "attn_prob", "dataset": "hotpotqa"}))
    with pytest.raises(ConfigError, match="attn_prob.*does not implement"):
        load_dragin_config(p)


def test_dragin_config_accepts_published_keys_a_bom_and_refuses_streaming_mode(tmp_path):
    from fastrag.methods.registry import get_method

    p = tmp_path / "c.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({**BASE, "attention_solver": "max", "try_use_max_weight": False,
                                                "es_index_name": "wiki"}).encode())
    assert load_dragin_config(p).generate_max_length == 64
    p.write_text(json.dumps({**BASE, "mode": "streaming"}))
    with pytest.raises(ConfigError, match="--method dragin-streaming"):
        get_method("dragin").make_config("hotpotqa", str(p))
    p.write_text(json.dumps({**BASE, "mode": "streaming", "stream_chunk_tokens": 8}))
    cfg = get_method("dragin-streaming").make_config("hotpotqa", str(p))
    assert cfg.stream_chunk_tokens == 8
    p.write_text(json.dumps({**BASE, "mode": "reference"}))  # (the other way round: not silently streaming)
    with pytest.raises(ConfigError, match="'reference'.*--method dragin\\)"):
        get_method("dragin-streaming").make_config("hotpotqa", str(p))
    p.write_text(json.dumps(BASE))  # no mode: each method runs its own
    assert get_method("dragin-streaming").make_config("hotpotqa", str(p)).mode == "streaming"
    assert get_method("dragin").make_config("hotpotqa", str(p)).mode == "reference"


def test_dragin_streaming_reads_its_config_file_once(tmp_path, monkeypatch):
    """The file is read once (it was read twice: a file rewritten between the reads could mix two versions)."""
    from fastrag import config as config_mod
    from fastrag.methods import dragin_streaming
    from fastrag.methods.registry import get_method

    p = tmp_path / "c.json"
    p.write_text(json.dumps({**BASE, "stream_chunk_tokens": 8}))
    reads = []
    real = config_mod.read_json_object

    def counting(path, *a, **kw):
        reads.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(config_mod, "read_json_object", counting)
    monkeypatch.setattr(dragin_streaming, "read_json_object", counting)
    assert get_method("dragin-streaming").make_config("hotpotqa", str(p)).stream_chunk_tokens == 8
    assert reads == [str(p)]


# ------------------------------------------------------------------------------------------------ corpora
def test_a_corpus_without_titles_or_with_a_bom_is_indexed(tmp_path):
    from fastrag.retrieval.bm25 import BM25Retriever

    c = tmp_path / "notitle.jsonl"
    c.write_bytes(b"\xef\xbb\xbf" + b'{"id": 1, "text": "Paris is the capital of France"}\n'
                  b'{"id": "b", "title": null, "text": "Berlin lies in Germany"}\n')
    r = BM25Retriever(str(c), show_progress=False)
    hits = r.search(["capital of France", "Germany", "the"], 2)
    assert [[d.id for d in h] for h in hits] == [["1"], ["b"], []]
    assert BM25Retriever(str(c), show_progress=False).built is False  # the saved index loads
    tsv = tmp_path / "p.tsv"
    tsv.write_bytes(b"\xef\xbb\xbfid\ttext\ttitle\n7\tOslo is in Norway\tOslo\n")
    assert [d.id for d in BM25Retriever(str(tsv), show_progress=False).search(["Norway"], 1)[0]] == ["7"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": null, "text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'id' must be a string or an integer"):
        BM25Retriever(str(bad), show_progress=False)


def test_an_unsupported_corpus_suffix_leaves_no_index_folder(tmp_path):
    from fastrag.retrieval.bm25 import BM25Retriever

    c = tmp_path / "passages.txt"
    c.write_text('{"id": "a", "text": "x"}\n')
    with pytest.raises(ValueError, match="unsupported corpus format '.txt'"):
        BM25Retriever(str(c), show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passages.txt"]


def test_parity_of_a_method_without_oracle_is_refused_before_any_work(tmp_path):
    from fastrag.parity import parity

    opts = RunOptions(method="flare-instruct", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                      corpus=str(CORPUS), output=str(tmp_path / "p"), limit=1, progress=False)
    with pytest.raises(ValueError, match="'flare-instruct' has no per-question oracle"):
        parity(opts)
    assert not (tmp_path / "p").exists()  # no engine run was made first


def test_parity_engine_timings_cover_every_run_behind_its_records(tiny, tmp_path):
    """A parity rerun that computes only the questions the first one left (a larger --limit, a killed run) reports
    the engine's seconds and rate over both runs, as the oracle's cover all its records; they were the last run's
    only (one question's seconds beside the oracle's for all)."""
    from fastrag.parity import parity

    corpus = tmp_path / "passages.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"book number {i} was written "
                                          f"by author {i}"}) + "\n" for i in range(8)))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 0}))
    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS[:2])
    opts = RunOptions(method="dragin", dataset="nq", data=str(data), corpus=str(corpus), output=str(tmp_path / "p"),
                      model=tiny, config=str(cfg), batch_size=4, kv_cache_gb=0.05, progress=False)
    first = parity(replace(opts, limit=1))
    second = parity(replace(opts, limit=2))
    m = json.loads((tmp_path / "p" / "engine" / "metrics.json").read_text())
    assert second["n"] == 2 and m["computed_this_run"] == 1 and m["errors"] == 0
    # each run counts its seconds up to its last record (engine/runs.jsonl): the rerun's a little under its whole
    # wall (what follows its last record, the scheduler's close, is not in it)
    runs = [json.loads(x) for x in (tmp_path / "p" / "engine" / "runs.jsonl").read_text().splitlines()]
    assert [r["computed"] for r in runs] == [1, 1] and 0 < runs[1]["wall_s"] <= m["wall_s"]
    both = first["engine_wall_s"] + runs[1]["wall_s"]
    assert first["engine_wall_s"] == pytest.approx(runs[0]["wall_s"], rel=1e-9)
    assert second["engine_wall_s"] == pytest.approx(both, rel=1e-9)
    assert second["engine_questions_per_s"] == pytest.approx(2 / both, rel=1e-9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU backends can run here")
def test_a_gpu_signals_backend_asked_for_on_a_cpu_is_an_error_message(tiny, tmp_path, capsys):
    """`fastrag run --signals cuda` (or triton) on a machine without a GPU exits 2 with the reason, as other bad
    options do; it ended in a BackendUnavailableError traceback."""
    from fastrag.cli import main
    from fastrag.signals import BackendUnavailableError, get_backend

    def unavailable(name: str) -> bool:  # (Triton runs on a CPU under TRITON_INTERPRET=1, which a test may set)
        try:
            get_backend(name)
        except BackendUnavailableError:
            return True
        return False

    backends = [b for b in ("cuda", "triton") if unavailable(b)]
    if not backends:
        pytest.skip("both GPU signal backends can run here")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 0}))
    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS[:1])
    for backend in backends:
        out = tmp_path / backend
        code = main(["run", "--method", "sr-rag", "--dataset", "nq", "--data", str(data), "--corpus", str(CORPUS),
                     "--model", str(tiny), "--config", str(cfg), "--kv-cache-gb", "0.05", "--signals", backend,
                     "--output", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and f"fastrag: error: signals backend '{backend}' is not available" in err, err
        assert "Traceback" not in err and not out.exists()


def test_parity_oracle_rate_counts_answered_questions_as_the_engine_rate_does():
    """The oracle's questions/s beside the engine's: a failed question (an empty one fails at once, in both) adds its
    seconds and no answer, as in the engine's questions_per_s; it was counted as answered, so one real answer in
    0.3 s and one empty question gave the oracle 6.4 questions/s."""
    from fastrag.parity import _rate
    from fastrag.trace import QuestionResult

    ok = QuestionResult(qid="q0", question="who?", gold=["a"], wall_s=0.75)
    failed = QuestionResult(qid="q1", question="", gold=["b"], wall_s=0.25, error="ValueError: empty question")
    assert _rate([ok, failed]) == pytest.approx(1 / 1.0)
    assert _rate([ok]) == pytest.approx(1 / 0.75)
    assert _rate([failed]) == 0
    assert _rate([]) is None


def test_dense_runs_fingerprint_their_encoder(tmp_path, monkeypatch):
    """A dense run's identity carries the encoder's content fingerprint (its hits depend on the encoder's weights
    as much as on the corpus); other retrievers' do not; an encoder changed in place is another run."""
    from fastrag.eval import run_identity
    from fastrag.retrieval import dense

    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)
    enc = tmp_path / "encoder"
    enc.mkdir()
    (enc / "config.json").write_text("{}")
    (enc / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setattr(dense, "resolve_encoder", lambda name: enc)
    kw = dict(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "o"))
    cfg = object.__new__(type("Cfg", (), {}))
    one = run_identity(RunOptions(**kw, retriever="dense"), cfg)
    assert one["encoder_fingerprint"].startswith("tree:")
    assert "encoder_fingerprint" not in run_identity(RunOptions(**kw), cfg)
    (enc / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)
    assert run_identity(RunOptions(**kw, retriever="dense"), cfg)["encoder_fingerprint"] != one["encoder_fingerprint"]


def test_dense_index_options_are_part_of_a_runs_identity(tmp_path):
    """A run with an approximate dense index retrieves other passages than the exact one: its identity names the
    options (and a run without them keeps the identity it had before they existed)."""
    from fastrag.eval import run_identity

    data = nq_file(tmp_path / "nq.jsonl", QUESTIONS)
    kw = dict(method="wo-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "o"),
              retriever="dense")
    cfg = object.__new__(type("Cfg", (), {}))
    plain = run_identity(RunOptions(**kw), cfg)
    hnsw = run_identity(RunOptions(**kw, retriever_options={"index": "hnsw", "M": 16}), cfg)
    assert "retriever_options" not in plain and hnsw["retriever_options"] == {"index": "hnsw", "M": 16}
    assert run_identity(RunOptions(**kw, retriever_options={"index": "hnsw", "M": 8}), cfg) != hnsw
