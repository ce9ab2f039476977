"""Methods end to end through the CLI on the real SmolLM2 (short): `fastrag run --method flare`, the parity of FLARE
and of each DRAGIN-paper baseline with its per-question oracle (on a random model too), and the CLI's errors for an
unknown method and a bad method option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastrag.eval import BUNDLED

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"
OWN = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "questions_outside_shared.jsonl"
# exemplars in the parity runs' prompts (HotpotQA's default is 8): both sides build the same prompt from any number,
# and the per-question oracle prefills the whole prompt again at every generate call, which is most of these tests'
# time (flare-explicit: 224 s with 8 and the default question length, 115 s with 4 and 8-token questions; one
# thread each, beside another job, on a 2-core Xeon VM)
FEWSHOT = 4


def cli(*args):
    return subprocess.run([sys.executable, "-m", "fastrag", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


def test_flare_runs_end_to_end_with_counters(tmp_path):
    cfg = tmp_path / "flare.json"
    cfg.write_text(json.dumps({"generate_max_length": 16, "look_ahead_tokens": 12, "theta": 0.9}))
    out = tmp_path / "o"
    p = cli("run", "--method", "flare", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS,
            "--config", cfg, "--limit", 2, "--batch-size", 2, "--kv-cache-gb", 0.25, "--output", out, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    corpus_ids = {json.loads(x)["id"] for x in CORPUS.read_text().splitlines()}
    assert len(recs) == 2
    for r in recs:
        assert r["error"] is None, r["error"]
        assert r["retrievals"] >= 1  # step 1 retrieves with the question
        assert r["rounds"][0]["query"] == r["question"] and set(r["rounds"][0]["doc_ids"]) <= corpus_ids
        c = r["counters"]
        assert c["searches"] >= 1 and c["generate_calls"] >= 2 and c["reused_prompt_tokens"] > 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["method"] == "flare" and m["errors"] == 0
    assert m["retrieval"]["queries"] == sum(r["counters"]["searches"] for r in recs)
    assert m["retrieval"]["max_batch_size"] >= 1 and m["retrieval"]["seconds"] >= 0
    assert m["engine"]["prefix_hit_tokens"] > 0 and m["reused_prompt_tokens_per_question"] > 0
    # where the time went: the engine's prefill and decode parts, and the scheduler's step by part
    assert m["engine"]["prefill_s"] > 0 and m["engine"]["decode_s"] > 0
    st = m["step_seconds"]
    assert set(st) == {"engine", "attention_passes", "methods_and_other", "waiting_text_workers"} \
        and min(st.values()) >= 0
    assert st["engine"] >= m["engine"]["prefill_s"] + m["engine"]["decode_s"] > 0
    assert st["methods_and_other"] > 0 and sum(st.values()) <= m["wall_s"] * 1.01


def _parity_on_own_questions(tmp_path, method: str, config: dict) -> dict:
    """`fastrag parity` on the real SmolLM2 and bm25s over the first two of the project's own questions
    (benchmarks/data/questions_outside_shared.jsonl), checked: both sides answered both questions, made the same
    decisions and count the same work in each question's record (generate calls, decoded tokens, retrievals: the
    same generations, a final EOS counted on neither side). FEWSHOT exemplars unless `config` says otherwise.
    Returns that work, {qid: (calls, decoded, retrievals)}."""
    cfg = tmp_path / "method.json"
    cfg.write_text(json.dumps({"fewshot": FEWSHOT, **config}))
    out = tmp_path / "p"
    p = cli("parity", "--method", method, "--dataset", "hotpotqa", "--data", OWN, "--corpus", CORPUS, "--config",
            cfg, "--limit", 2, "--batch-size", 2, "--kv-cache-gb", 0.25, "--output", out, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    return _same_work(json.loads((out / "parity.json").read_text()), out, 2)


def _same_work(rep: dict, out: Path, n: int) -> dict:
    """A parity report of n questions that all agree, whose two sides count the same work in each question's record;
    returns that work, {qid: (calls, decoded, retrievals)}."""
    assert rep["n"] == n and rep["n_errored"] == 0 and rep["agreement"] == 1.0, rep
    work = {}
    for side in ("engine", "oracle"):
        recs = [json.loads(x) for x in (out / side / "results.jsonl").read_text().splitlines()]
        work[side] = {r["qid"]: (r["llm_calls"], r["decode_tokens"], r["retrievals"]) for r in recs}
    assert work["engine"] == work["oracle"] and len(work["engine"]) == n
    return work["oracle"]


# (the real-model parity of explicit FLARE is marked slow: the random-model test below makes its confidence test
# fail and its masked-span questions retrieve, 2 retrievals a question or more; implicit FLARE's trigger is this
# file's to check on the real model, where its look-ahead is uncertain. Explicit took 146 s, implicit 76 s, in a
# clean clone's CI run on a 2-core Xeon VM, 2026-12-02)
@pytest.mark.parametrize("method", ["flare", pytest.param("flare-explicit", marks=pytest.mark.slow)])
def test_flare_parity_with_the_real_model_counts_the_same_work_on_both_sides(tmp_path, method):
    """FLARE's engine and per-question oracle make the same decisions and count the same work."""
    # (explicit: each question it asks about the uncertain spans at most 8 tokens long, against 32 by default)
    short = {"question_max_tokens": 8} if method == "flare-explicit" else {}
    work = _parity_on_own_questions(tmp_path, method, {"generate_max_length": 16, "look_ahead_tokens": 12,
                                                       "theta": 0.9, **short})
    # a retrieval beyond the first (the question's own): a confidence test failed and a query was formed
    assert any(retrievals >= 2 for _, _, retrievals in work.values()), "no trigger: a weak check"


BASELINES = [
    ("wo-rag", {"generate_max_length": 16}, 0),
    ("sr-rag", {"generate_max_length": 16}, 1),
    ("fl-rag", {"generate_max_length": 16, "fix_length": 6}, 2),
    ("fs-rag", {"generate_max_length": 16}, 2),
    ("token-rag", {"generate_max_length": 16, "fewshot": 8}, 1),  # (with 4 its rule found no sentence uncertain)
]
# the real-model parity of the baselines whose decisions do not read the model's numbers (the schedule-driven ones,
# and wo-rag, which never retrieves) is marked slow (`pytest -m slow`): CI checks them on a random model below, and
# the real model's plain generation in FLARE's and DRAGIN's parity; token-rag's rule reads probabilities and stays
SLOW_ON_THE_REAL_MODEL = {"wo-rag", "sr-rag", "fl-rag", "fs-rag"}


@pytest.mark.parametrize("method, config, retrievals", [
    pytest.param(*b, marks=pytest.mark.slow) if b[0] in SLOW_ON_THE_REAL_MODEL else b for b in BASELINES])
def test_baseline_parity_with_the_real_model_counts_the_same_work_on_both_sides(tmp_path, method, config,
                                                                                 retrievals):
    """Each DRAGIN-paper baseline's engine policy and its per-question oracle (fastrag.oracle.baselines) make the
    same decisions (the rounds' triggers and queries, the answer) and count the same work on the real model. The
    configs are short enough for CI and still make every retrieving baseline retrieve (`retrievals`: the least a
    question must have done on both sides; token-rag retrieves only for a sentence its rule found uncertain)."""
    work = _parity_on_own_questions(tmp_path, method, config)
    assert min(r for _, _, r in work.values()) >= retrievals, work


@pytest.mark.parametrize("method, config, retrievals", [
    ("wo-rag", {}, 0), ("sr-rag", {}, 1), ("fl-rag", {"fix_length": 6}, 4), ("fs-rag", {}, 3),
    ("token-rag", {}, 1),
    # (implicit FLARE: the tiny model settles on tokens it gives p > 0.999, so no look-ahead fails its test here and
    # the trigger is the real-model test's to check; this one checks the accepting path's parity)
    ("flare", {"look_ahead_tokens": 12, "theta": 0.9}, 1),
    ("flare-explicit", {"look_ahead_tokens": 12, "theta": 0.9, "question_max_tokens": 8}, 2),
    # (DRAGIN as the published code computes it: special tokens and EOS kept, its word and query rules; random text
    # is uncertain everywhere, so RIND triggers)
    ("dragin-published", {}, 1),
    # (the baselines' published loops: special tokens and EOS kept, padded passages, FL/FS-RAG's joins and typo)
    ("wo-rag", {"fidelity": "published"}, 0), ("sr-rag", {"fidelity": "published"}, 1),
    ("fl-rag", {"fix_length": 6, "fidelity": "published"}, 4), ("fs-rag", {"fidelity": "published"}, 2),
    ("token-rag", {"fidelity": "published"}, 1)])
def test_parity_on_a_random_model(tmp_path, tiny_model, method, config, retrievals):
    """Each baseline and FLARE on a random model (the embedded tokenizer, 48 new tokens): its text is no sentence a
    real model writes, and the engine and the per-question oracle still make the same decisions and count the same
    work over the project's own questions. In process (`fastrag.parity.parity`): the CLI's parity entry is the
    real-model tests'. `retrievals`: the fewest that the question retrieving most may make (both sides)."""
    from fastrag.eval import RunOptions
    from fastrag.parity import parity

    cfg = tmp_path / "method.json"
    cfg.write_text(json.dumps({"fewshot": FEWSHOT, "generate_max_length": 48, **config}))  # (seconds on this model)
    out = tmp_path / "p"
    rep = parity(RunOptions(method=method, dataset="hotpotqa", data=str(OWN), corpus=str(CORPUS), output=str(out),
                            model=str(tiny_model), config=str(cfg), limit=3, batch_size=3, kv_cache_gb=0.05,
                            progress=False))
    work = _same_work(rep, out, 3)
    # the retrievals of the question that made the most: the method's rule fired (FLARE's first is the question's)
    assert max(r for _, _, r in work.values()) >= retrievals, work
    if method == "wo-rag":
        assert all(r == 0 for _, _, r in work.values()), work


def test_unknown_method_and_bad_option_are_clear_errors(tmp_path):
    p = cli("run", "--method", "flair", "--dataset", "hotpotqa", "--output", tmp_path / "o")
    assert p.returncode == 2 and "unknown method 'flair'" in p.stderr and "flare" in p.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"theta": 2.0}))
    p = cli("run", "--method", "flare", "--dataset", "hotpotqa", "--config", bad, "--output", tmp_path / "o")
    assert p.returncode == 2 and "theta must be a number in [0, 1]" in p.stderr, p.stderr[-2000:]
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"look_ahead": 8}))
    p = cli("run", "--method", "flare", "--dataset", "hotpotqa", "--config", typo, "--output", tmp_path / "o")
    assert p.returncode == 2 and "unknown config field 'look_ahead'" in p.stderr, p.stderr[-2000:]
    pub = tmp_path / "FLARE.json"  # a published DRAGIN "FLARE" config is TokenRAG: it names the right method
    pub.write_text(json.dumps({"method": "token", "dataset": "hotpotqa", "hallucination_threshold": 0.1}))
    p = cli("run", "--method", "flare", "--dataset", "hotpotqa", "--config", pub, "--output", tmp_path / "o")
    assert p.returncode == 2 and "token-rag" in p.stderr, p.stderr[-2000:]
