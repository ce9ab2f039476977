"""Engine level: DRAGIN decisions (trigger sentence, hit words, query, retrieved documents, final text) are
identical between the torch signals backend and each kernel backend (C++ CPU; Triton under TRITON_INTERPRET=1 on
the CPU, or on the GPU) on a fixed set of bundled HotpotQA questions, real SmolLM2-135M and bm25s, greedy decoding.
The kernels are used inside the engine's decode step (fused token signals; for streaming DRAGIN also the fused
in-context attention statistics) and in the attention passes (reference mode's RIND and both modes' QFS rows).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any fastrag.kernels import

from fastrag.eval import BUNDLED, RunOptions, build_engine, run  # noqa: E402
from fastrag.signals import BackendUnavailableError, get_backend  # noqa: E402

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"


# CI size: 2 exemplars, short generations and a low threshold so that the few decode steps still trigger
# retrievals (RIND scoring, QFS attention rows, queries). The published settings run under -m slow.
CI_CONFIG = {"generate_max_length": 16, "hallucination_threshold": 0.2, "fewshot": 2, "n_questions": 1}
# the CI question: one whose first round triggers a retrieval at CI_CONFIG (checked below, so a change shows)
CI_QID = "5a85ea095542994775f606a8"
SLOW_CONFIG = {"generate_max_length": 20, "hallucination_threshold": 1.2, "fewshot": 8, "n_questions": 3}


@pytest.fixture(scope="module", params=[pytest.param(CI_CONFIG, id="ci"),
                                        pytest.param(SLOW_CONFIG, id="published", marks=pytest.mark.slow)])
def config(request, tmp_path_factory):
    params = dict(request.param)
    n = params.pop("n_questions")
    tmp = tmp_path_factory.mktemp("cfg")
    path = tmp / "DRAGIN.json"
    data = DATA
    if n == 1:
        data = tmp / "questions.jsonl"
        data.write_text("".join(x + "\n" for x in DATA.read_text().splitlines() if CI_QID in x))
    path.write_text(json.dumps({
        "model_name_or_path": "smollm2", "method": "attn_entropy", "dataset": "hotpotqa",
        "query_formulation": "real_words", "retrieve_keep_top_k": 35, "retriever": "BM25", "retrieve_topk": 3,
        "check_real_words": True, "use_counter": True, **params,
    }))
    return path, n, data


def _decisions(backend: str, method: str, config, tmp_path) -> list[dict]:
    config, n, data = config
    try:
        get_backend(backend)
        engine = build_engine("smollm2", n, backend, kv_cache_gb=0.5, device="cpu",
                              dtype=torch.float32)
    except (BackendUnavailableError, FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(f"{backend}: {e}")
    assert engine.signals.name == backend
    opts = RunOptions(method=method, dataset="hotpotqa", data=str(data), corpus=str(CORPUS),
                      output=str(tmp_path / backend), config=str(config), limit=n, batch_size=n,
                      signals=backend, progress=False)
    run(opts, engine=engine)
    recs = [json.loads(x) for x in (tmp_path / backend / "results.jsonl").read_text().splitlines()]
    return sorted(({"qid": r["qid"], "text": r["text"], "prediction": r["prediction"], "error": r["error"],
                    "rounds": r["rounds"]} for r in recs), key=lambda r: r["qid"])


@pytest.fixture(scope="module")
def torch_runs(config, tmp_path_factory):
    done: dict[str, list[dict]] = {}

    def get(method: str) -> list[dict]:
        if method not in done:
            done[method] = _decisions("torch", method, config, tmp_path_factory.mktemp(f"torch-{method}"))
        return done[method]

    return get


@pytest.mark.parametrize("method", ["dragin", "dragin-streaming"])
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_dragin_decisions_match_torch_backend(backend, method, torch_runs, config, tmp_path):
    torch_decisions = torch_runs(method)
    got = _decisions(backend, method, config, tmp_path)
    assert len(got) == len(torch_decisions) == config[1]
    assert all(r["error"] is None for r in got), [r["error"] for r in got]
    assert any(rd["query"] for r in torch_decisions for rd in r["rounds"]), "the questions should trigger retrieval"
    for a, b in zip(got, torch_decisions):
        assert a == b, f"{backend} decisions differ from torch on {a['qid']}:\n{a}\nvs\n{b}"
