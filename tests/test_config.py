"""DraginConfig validation, the paper's defaults, and loading published DRAGIN config files."""

from __future__ import annotations

import json

import pytest

from fastrag.config import DRAGIN_DEFAULTS, ConfigError, DraginConfig, dragin_config, load_dragin_config, method_config
from fastrag.signals.checks import MIN_TEMPERATURE

# the contents of oneal2000/DRAGIN config/Llama2-13b-chat/HotpotQA/DRAGIN.json
PUBLISHED_HOTPOTQA = {
    "model_name_or_path": "/liuzyai04/thuir/tyc/base_model/llama2-13b-chat",
    "method": "attn_entropy",
    "dataset": "hotpotqa",
    "data_path": "../data/hotpotqa",
    "generate_max_length": 100,
    "query_formulation": "real_words",
    "retrieve_keep_top_k": 35,
    "output_dir": "../result/hotpotqa/16",
    "retriever": "BM25",
    "retrieve_topk": 3,
    "attention_solver": "max",
    "hallucination_threshold": 1.4,
    "fewshot": 8,
    "sample": 1000,
    "shuffle": False,
    "check_real_words": True,
    "es_index_name": "39773_wiki",
    "config_path": "../config/hotpotqa/attn_entropy_real_topk.json",
    "use_counter": True,
    "try_use_max_weight": False,
}


def test_paper_table9_defaults():
    # Llama2-13b-chat row of Table 9: (L, theta, top n); exemplar counts from appendix F
    expect = {"2wikimultihopqa": (64, 0.6, 25, 6), "hotpotqa": (100, 1.2, 35, 8), "iirc": (128, 1.25, 25, 8),
              "strategyqa": (100, 1.0, 25, 6), "nq": (100, 1.2, 35, 8), "webq": (100, 1.2, 35, 8),
              "qa": (100, 1.2, 35, 8)}  # (generic QA: NQ's)
    for ds, (length, theta, topn, shots) in expect.items():
        c = dragin_config(ds)
        assert (c.generate_max_length, c.hallucination_threshold, c.retrieve_keep_top_k, c.fewshot) == (
            length, theta, topn, shots)
        assert (c.retrieve_topk, c.query_formulation, c.check_real_words, c.max_query_tokens) == (3, "real_words", True, 64)
        assert (c.mode, c.stop_case_insensitive, c.qfs_skip_first) == ("reference", False, True)
    assert set(DRAGIN_DEFAULTS) == set(expect)


def test_overrides_and_aliases():
    c = dragin_config("2wikimultihop", {"hallucination_threshold": 2, "mode": "streaming"})
    assert c.dataset == "2wikimultihopqa" and c.hallucination_threshold == 2.0 and c.mode == "streaming"
    with pytest.raises(ConfigError, match="'bogus'"):
        dragin_config("hotpotqa", {"bogus": 1})


@pytest.mark.parametrize("field,value", [
    ("generate_max_length", 0), ("generate_max_length", 10.0), ("generate_max_length", True),
    ("retrieve_keep_top_k", -1), ("retrieve_topk", 0), ("fewshot", -1), ("max_query_tokens", 0),
    ("hallucination_threshold", "1.2"), ("hallucination_threshold", float("nan")),
    ("mode", "fast"), ("query_formulation", "current"), ("check_real_words", 1),
    ("stop_case_insensitive", "no"), ("qfs_skip_first", None), ("dataset", "no such set"), ("extra", []),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        dragin_config("hotpotqa", {field: value})


def test_fewshot_zero_and_every_exemplar_are_valid_one_more_is_not():
    assert DraginConfig("iirc", 128, 1.25, 25, 0).fewshot == 0
    assert dragin_config("hotpotqa", {"fewshot": 8}).fewshot == 8  # (HotpotQA has 8 exemplars)
    with pytest.raises(ConfigError, match="fewshot is 9 but hotpotqa has only 8 exemplars"):
        dragin_config("hotpotqa", {"fewshot": 9})


def test_probability_bounds_are_closed():
    """FLARE's theta and beta are probabilities: 0 and 1 are valid (beta 0 masks nothing), past them is not."""
    for field_ in ("theta", "beta"):
        for v in (0, 1):
            assert getattr(method_config("flare", "hotpotqa", overrides={field_: v}), field_) == float(v)
        for v in (-1e-9, 1 + 1e-9):
            with pytest.raises(ConfigError, match=f"{field_} must be a number in \\[0, 1\\]"):
                method_config("flare", "hotpotqa", overrides={field_: v})


def test_load_published_config(tmp_path):
    p = tmp_path / "DRAGIN.json"
    p.write_text(json.dumps(PUBLISHED_HOTPOTQA, indent=4))
    # the keys that choose the model, index, questions... are the command line's here: one warning names each
    with pytest.warns(UserWarning, match=r"DRAGIN\.json: not applied from the file: .*es_index_name='39773_wiki' "
                                         r"\(\$FASTRAG_ES_INDEX\); model_name_or_path='[^']*' \(--model\)"):
        c = load_dragin_config(p)
    assert (c.dataset, c.generate_max_length, c.hallucination_threshold, c.retrieve_keep_top_k, c.fewshot) == (
        "hotpotqa", 100, 1.4, 35, 8)  # the file's values, not Table 9's
    assert c.extra["model_name_or_path"].endswith("llama2-13b-chat") and c.extra["es_index_name"] == "39773_wiki"
    assert c.extra["method"] == "attn_entropy" and "generate_max_length" not in c.extra
    with pytest.warns(UserWarning, match=r"dataset='hotpotqa' \(the run's --dataset nq is used"):
        assert load_dragin_config(p, dataset="nq").dataset == "nq"
    p.write_text(json.dumps({"dataset": "HotpotQA", "hallucination_threshold": 1.4, "sample": 1000,
                             "shuffle": False}))
    with pytest.warns(UserWarning, match=r"sample=1000 \(the first N questions: --limit N\); shuffle=False"):
        load_dragin_config(p)
    p.write_text(json.dumps({"dataset": "HotpotQA", "hallucination_threshold": 1.4, "output_dir": "../result"}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bookkeeping only (where the published code wrote): no warning
        load_dragin_config(p)


def test_load_2wiki_config_and_missing_keys_fall_back(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"method": "attn_entropy", "dataset": "2wikimultihop", "hallucination_threshold": 0.9}))
    c = load_dragin_config(p)
    assert (c.dataset, c.hallucination_threshold, c.generate_max_length, c.fewshot) == ("2wikimultihopqa", 0.9, 64, 6)
    assert c.extra["source_dataset"] == "2wikimultihop"


@pytest.mark.parametrize("patch,pattern", [
    ({"method": "flare"}, r"c\.json: field 'method'"),
    ({"method": "token"}, r"c\.json: field 'method' is 'token', which is not DRAGIN"),
    ({"attention_solver": "mean"}, r"c\.json: attention_solver 'mean': only 'max'"),
    ({"generate_max_length": "100"}, r"c\.json: generate_max_length"),
    ({"retrieve_keep_top_k": 0}, r"c\.json: retrieve_keep_top_k"),
    ({"dataset": "no such set"}, r"c\.json: field 'dataset'"),
    ({"check_real_words": "true"}, r"c\.json: check_real_words"),
    ({"qfs_skip_first": 0}, r"c\.json: qfs_skip_first must be true or false, got 0"),
    ({"mode": "stream"}, r"c\.json: mode must be one of 'reference', 'streaming', got 'stream'"),
    ({"query_formulation": "current_wo_wrong"}, r"c\.json: query_formulation must be one of 'real_words'"),
    ({"hallucination_threshold": True}, r"c\.json: hallucination_threshold must be a finite number >= 0, got True"),
    ({"hallucination_threshold": "1.2"}, r"c\.json: hallucination_threshold must be a finite number >= 0, got '1\.2'"),
])
def test_load_errors_name_file_and_field(tmp_path, patch, pattern):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**PUBLISHED_HOTPOTQA, **patch}))
    with pytest.raises(ConfigError, match=pattern):
        load_dragin_config(p)


def test_a_field_given_twice_is_refused_with_its_lines(tmp_path):
    """json.loads keeps the last of two equal keys: an edit to the first would change nothing without a word."""
    from fastrag.config import method_config
    from fastrag.methods.beamsearchqa import BeamConfigError, beamsearchqa_config

    p = tmp_path / "c.json"
    p.write_text('{\n "method": "attn_entropy",\n "dataset": "hotpotqa",\n "hallucination_threshold": 1.4,\n'
                 ' "fewshot": 8,\n "hallucination_threshold": 0.5\n}\n')
    with pytest.raises(ConfigError, match=r"c\.json: field 'hallucination_threshold' is given twice \(lines 4, 6\)"):
        load_dragin_config(p)
    p.write_text('{"fewshot": 2, "fewshot": 3}')
    with pytest.raises(ConfigError, match="'fewshot' is given twice"):
        method_config("wo-rag", "hotpotqa", p)
    p.write_text('{"K": 2, "K": 3}')
    with pytest.raises(BeamConfigError, match="'K' is given twice"):
        beamsearchqa_config("hotpotqa", p)


def test_load_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_dragin_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON"):
        load_dragin_config(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_dragin_config(lst)
    nods = tmp_path / "nods.json"
    nods.write_text(json.dumps({"method": "attn_entropy"}))
    with pytest.raises(ConfigError, match="'dataset'"):
        load_dragin_config(nods)


# The range of every numeric config field of every method (docs/methods.md, "Ranges"): (least, most) with None for
# no bound. A field missing here fails test_every_numeric_field_of_every_method_has_a_range: a new field gets a
# range with it.
RANGES = {
    "generate_max_length": (1, None), "fewshot": (0, None), "retrieve_topk": (1, None),
    "max_query_tokens": (1, None), "retrieve_keep_top_k": (1, None), "stream_chunk_tokens": (1, None),
    "fix_length": (1, None), "look_ahead_tokens": (1, None), "question_max_tokens": (1, None),
    "max_searches": (0, None),
    # IRCoT: steps, tokens a step, documents gathered; Iter-RetGen: rounds
    "max_steps": (1, None), "thought_max_tokens": (1, None), "max_docs": (1, None), "iterations": (1, None),
    # DRAGIN: a word hits when (a_i / sum a) * H_i * len(sentence) > theta, a product of non-negative factors
    "dragin.hallucination_threshold": (0.0, None),
    # ETC: theta against the attention-weighted smoothed second difference of word entropy
    "etc.hallucination_threshold": (0.0, None),
    # Self-Ask: generations per question
    "max_iter": (1, None),
    # TokenRAG: solver(1 - p) over a sentence, a probability
    "token-rag.hallucination_threshold": (0.0, 1.0),
    "theta": (0.0, 1.0), "beta": (0.0, 1.0),
    # BeamSearchQA
    "max_questions": (1, None), "max_depth": (0, None), "num_docs": (1, None), "score_threshold": (0.0, 1.0),
    "beam_size": (1, None), "answer_max_tokens": (1, None), "ask_max_tokens": (1, None),
    "summary_max_tokens": (1, None), "score_max_tokens": (1, None), "max_doc_chars": (1, None),
    # SeaKR: samples (two at least: one has no spread), their sampling, the hidden layer, the eigen score's ridge
    # (> 0: the least accepted value stands for the open bound) and threshold (any finite number: a log-determinant),
    # the query words' 1 - p bound, steps and documents (max_docs above)
    "samples": (2, None), "sample_temperature": (MIN_TEMPERATURE, None), "sample_top_k": (0, None),
    "sample_top_p": (1e-6, 1.0), "seed": (0, None), "step_max_tokens": (1, None), "hidden_layer": (0, None),
    "eigen_alpha": (1e-12, None), "eigen_threshold": (None, None), "prob_threshold": (0.0, 1.0),
    "max_reasoning_steps": (1, None),
}


def _numeric_fields():
    """(method, field, its type name) of every int / float field of every registered method's config."""
    import dataclasses

    from fastrag.methods.registry import available, get_method

    out = []
    for m in available():
        cfg = get_method(m).make_config("hotpotqa", None)
        out += [(m, f.name, f.type) for f in dataclasses.fields(cfg) if f.type in ("int", "float", int, float)]
    return out


def _range(method: str, name: str):
    """(least, most) of a field; None where RANGES has none (None, None: any finite number)."""
    family = "dragin" if method.startswith("dragin") else method
    return RANGES.get(f"{family}.{name}", RANGES.get(name))


def test_every_numeric_field_of_every_method_has_a_range():
    missing = [(m, f) for m, f, _ in _numeric_fields() if _range(m, f) is None]
    assert not missing, f"numeric config fields without a range in RANGES (and docs/methods.md): {missing}"


@pytest.mark.parametrize("method,name,kind", _numeric_fields())
def test_a_value_out_of_a_numeric_field_s_range_is_an_error_naming_file_and_field(tmp_path, method, name, kind):
    """A negative DRAGIN hallucination_threshold was taken silently (every word then hits, as with 0); every
    numeric field of every method refuses a value past its range, naming the file and the field, and takes its
    bounds themselves."""
    from fastrag.methods.registry import get_method

    lo, hi = _range(method, name)
    spec = get_method(method)
    is_float = kind in ("float", float)
    bad = ([lo - (0.5 if is_float else 1)] if lo is not None else []) + ([hi + 0.5] if hi is not None else [])
    if is_float:
        bad += [float("nan"), float("inf")]
    for v in bad:
        path = tmp_path / "c.json"
        path.write_text(json.dumps({name: v}))
        with pytest.raises(ValueError, match=rf"c\.json: {name} must be .*got {v!r}") as e:
            spec.make_config("hotpotqa", str(path))
        assert "Traceback" not in str(e.value)
    for v in ([-1e6, 0.0, 1e6] if lo is None and hi is None else [lo] if hi is None else [lo, hi]):
        if name == "fewshot":
            continue  # (its most is the dataset's exemplar count: test_fewshot_zero_and_every_exemplar_...)
        path = tmp_path / "c.json"
        path.write_text(json.dumps({name: v}))
        assert getattr(spec.make_config("hotpotqa", str(path)), name) == v
