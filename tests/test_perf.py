"""The device floor (fastrag/perf.py): the engine's work counters against sums over the sequences it ran, the
model's sizes against the Llama shapes' formulas, and the floor's arithmetic on hand-made figures."""

from __future__ import annotations

import math

import pytest
import torch

from fastrag.engine import Engine
from fastrag.model.llama import LlamaModel
from fastrag.perf import DeviceFigures, floor, measure_device, model_costs


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _cfg(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, eos_token_id=None)
    return LlamaConfig(**(base | kw))


@pytest.mark.parametrize("tied", [False, True])
def test_model_costs_follow_the_llama_shape(tied):
    h, inter, L, H, Hkv, V = 48, 64, 2, 6, 2, 96
    hd = h // H
    m = LlamaModel.from_hf_config(_cfg(tie_word_embeddings=tied), seed=1)
    c = model_costs(m)
    per_layer = h * H * hd + 2 * h * Hkv * hd + H * hd * h + 3 * h * inter
    matrices = L * per_layer + V * h  # the LM head (the tied embedding table read as one)
    norms = L * 2 * h + h
    assert c["matmul_params"] == matrices and c["lm_head_params"] == V * h
    assert c["weight_bytes_per_step"] == 4 * (matrices + norms)  # the embedding table is not streamed
    assert c["kv_bytes_per_token"] == 4 * 2 * L * Hkv * hd
    assert c["attn_flops_per_entry"] == 4 * L * H * hd
    m16 = LlamaModel.from_hf_config(_cfg(tie_word_embeddings=tied), seed=1, dtype=torch.bfloat16)
    assert model_costs(m16)["weight_bytes_per_step"] == 2 * (matrices + norms)


def test_engine_counts_the_kv_entries_its_attention_reads():
    """Three sequences of one 32-token prefix, own prompts of a_i tokens, m_i new tokens each (no EOS): decode
    step j of sequence i reads a_i + j own entries, every step reads the prefix once; the prefill of a_i tokens
    after P cached ones attends to P + t entries at its t-th token; the prefix's own prefill P(P+1)/2."""
    m = LlamaModel.from_hf_config(_cfg(), seed=3)
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=8, prefix_caching=False)
    P = 32
    eng.set_prefix(" ".join(str(10 + i % 80) for i in range(P)))
    pre_ids = [10 + i % 80 for i in range(P)]
    g = torch.Generator().manual_seed(4)
    own = [5, 17, 40]
    new = [6, 11, 3]
    seqs = []
    for a, n in zip(own, new):
        s = eng.new_sequence()
        eng.start(s, pre_ids + torch.randint(1, 96, (a,), generator=g).tolist(), n)
        seqs.append(s)
    steps = 0
    while eng.has_work:
        steps += bool(eng.running)
        eng.step()
    st = eng.stats
    assert [len(s.out.ids) for s in seqs] == new
    assert st["decode_tokens"] == sum(n - 1 for n in new) and st["decode_steps"] == max(new) - 1
    assert st["decode_ctx_tokens"] == sum(sum(a + j for j in range(1, n)) for a, n in zip(own, new))
    assert st["decode_prefix_tokens"] == P * st["decode_steps"]
    assert st["prefill_ctx_tokens"] == P * (P + 1) // 2 + sum(a * P + a * (a + 1) // 2 for a in own)
    # attention passes: T(T+1)/2 entries per list of T tokens
    before = st["prefill_ctx_tokens"]
    eng.attention_passes([[1, 2, 3], [4] * 10], "colmax")
    assert eng.stats["prefill_ctx_tokens"] - before == 6 + 55


def test_floor_takes_the_slower_of_bytes_and_flops_per_phase():
    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4}
    stats = {"decode_steps": 5, "decode_tokens": 40, "decode_ctx_tokens": 300, "decode_prefix_tokens": 200,
             "prefill_calls": 2, "prefill_tokens": 50, "prefill_ctx_tokens": 900}
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    f = floor(stats, costs, dev)
    dec_bytes = 5 * 1000 + 500 * 10  # 10,000 B -> 1.0 s
    dec_flops = 2 * 100 * 40 + 4 * 500  # 10,000 FLOP -> 0.5 s
    pre_bytes = 2 * 1000 + 50 * 10  # 2,500 B -> 0.25 s
    pre_flops = 2 * (100 - 30) * 50 + 4 * 900  # 10,600 FLOP (no LM head per prefilled token) -> 0.53 s
    assert (f["decode_bytes"], f["decode_flops"], f["prefill_bytes"], f["prefill_flops"]) == \
        (dec_bytes, dec_flops, pre_bytes, pre_flops)
    assert f["decode_s"] == pytest.approx(1.0) and f["decode_bound"] == "bandwidth"
    assert f["prefill_s"] == pytest.approx(0.53) and f["prefill_bound"] == "compute"
    assert f["total_s"] == pytest.approx(1.53)
    assert floor(stats, costs, dev.as_dict()) == f


def test_measure_device_gives_finite_positive_figures():
    d = measure_device("cpu", torch.float32, copy_bytes=1 << 22, matmul_n=128, reps=3)
    assert d.device.startswith("CPU") and d.dtype == "float32"
    for v in (d.copy_bytes_per_s, d.matmul_flops_per_s):
        assert math.isfinite(v) and v > 0


def test_report_reads_run_directories_and_names_what_is_missing(tmp_path):
    import json

    from fastrag.perf import main, report

    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    stats = {"decode_steps": 5, "decode_tokens": 40, "decode_ctx_tokens": 300, "decode_prefix_tokens": 200,
             "prefill_calls": 2, "prefill_tokens": 50, "prefill_ctx_tokens": 900, "prefill_s": 0.5, "decode_s": 2.5}
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.json").write_text(json.dumps({"method": "dragin", "dataset": "hotpotqa", "wall_s": 4.2,
                                                   "computed_this_run": 3, "engine": stats, "model_costs": costs,
                                                   "step_seconds": {"methods_and_other": 0.7,
                                                                    "attention_passes": 0.25,
                                                                    "waiting_text_workers": 0.125}}))
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    (r,) = report([str(good)], dev)
    assert r["run"] == "dragin/hotpotqa" and r["floor_s"] == pytest.approx(1.53)
    assert r["wall_over_floor"] == pytest.approx(4.2 / 1.53) and r["mean_decode_batch"] == 8
    assert r["prefill_and_passes_s"] == pytest.approx(0.75) and r["decode_s"] == 2.5
    m = json.loads((good / "metrics.json").read_text())  # the shared prefixes' prefill, timed apart, counts too
    m["engine"]["prefix_prefill_s"] = 0.125
    (good / "metrics.json").write_text(json.dumps(m))
    assert report([str(good)], dev)[0]["prefill_and_passes_s"] == pytest.approx(0.875)
    assert r["methods_and_other_s"] == 0.7 and r["waiting_text_workers_s"] == 0.125
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.json").write_text(json.dumps({"method": "dragin", "dataset": "hotpotqa", "wall_s": 1.0,
                                                  "engine": {k: v for k, v in stats.items()
                                                             if k != "prefill_ctx_tokens"},
                                                  "model_costs": costs}))
    with pytest.raises(ValueError, match=r"old/metrics.json: field engine.prefill_ctx_tokens is missing"):
        report([str(old)], dev)
    with pytest.raises(FileNotFoundError, match="nowhere/metrics.json"):
        report([str(tmp_path / "nowhere")], dev)
    out = tmp_path / "floor.md"
    main([str(good), "--output", str(out)])
    text = out.read_text()
    assert "dragin/hotpotqa" in text and "| run | questions | wall_s | floor_s |" in text
    with pytest.raises(SystemExit, match=r"--output .*nodir/x\.md: its folder does not exist"):
        main([str(good), "--output", str(tmp_path / "nodir" / "x.md")])
    # a rerun that computed nothing carries the figures over, with the count of questions behind them
    m = json.loads((good / "metrics.json").read_text())
    (good / "metrics.json").write_text(json.dumps(m | {"computed_this_run": 0, "questions_measured": 3,
                                                       "measured_in_an_earlier_run": True}))
    assert report([str(good)], dev)[0]["questions"] == 3


def _run_metrics(stats: dict, **extra) -> dict:
    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    return {"method": "dragin", "dataset": "nq", "wall_s": 2.0, "computed_this_run": 2, "engine": stats,
            "model_costs": costs} | extra


WORK = {"decode_steps": 5, "decode_tokens": 40, "decode_ctx_tokens": 300, "decode_prefix_tokens": 200,
        "prefill_calls": 2, "prefill_tokens": 50, "prefill_ctx_tokens": 900, "prefill_s": 0.5, "decode_s": 2.5}


def test_report_of_a_run_that_did_no_model_work_has_no_ratio(tmp_path):
    # every question failed before the model ran (e.g. all empty): the counters are 0, so is the floor
    import json

    from fastrag.perf import report

    (tmp_path / "metrics.json").write_text(json.dumps(_run_metrics({k: 0 for k in WORK})))
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    (r,) = report([str(tmp_path)], dev)
    assert r["floor_s"] == 0 and r["wall_over_floor"] is None and r["mean_decode_batch"] is None


def test_report_names_a_metrics_file_that_is_not_a_json_object(tmp_path):
    from fastrag.perf import main

    for name, text in (("list", "[]"), ("cut", '{"method": '), ("blank", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(text)
        with pytest.raises(SystemExit, match=rf"fastrag.perf: error: .*{name}/metrics.json: "):
            main([str(tmp_path / name)])


def test_report_of_a_ray_run_reads_its_shards(tmp_path):
    import json

    from fastrag.perf import report

    ray_metrics = _run_metrics({}, ray={"workers": 2, "shard_retries": 0})
    del ray_metrics["engine"], ray_metrics["model_costs"]  # as run_ray writes it: the engines are the shards'
    (tmp_path / "metrics.json").write_text(json.dumps(ray_metrics))
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    with pytest.raises(ValueError, match="--ray run"):
        report([str(tmp_path)], dev)
    for k, steps in ((0, 5), (1, 10)):
        (tmp_path / "shards" / str(k)).mkdir(parents=True)
        (tmp_path / "shards" / str(k) / "metrics.json").write_text(
            json.dumps(_run_metrics(WORK | {"decode_steps": steps})))
    rows = report([str(tmp_path)], dev)
    assert [r["run"] for r in rows] == ["dragin/nq shards/0", "dragin/nq shards/1"]
    assert [r["decode_steps"] for r in rows] == [5, 10]
    # a shard folder left by an earlier run with more workers: the run names its own shards, and only those count
    (tmp_path / "shards" / "2").mkdir()
    (tmp_path / "shards" / "2" / "metrics.json").write_text(json.dumps(_run_metrics(WORK | {"decode_steps": 99})))
    assert [r["decode_steps"] for r in report([str(tmp_path)], dev)] == [5, 10, 99]  # (older runs name none)
    ray_metrics["ray"]["shards"] = ["0", "1"]
    (tmp_path / "metrics.json").write_text(json.dumps(ray_metrics))
    assert [r["decode_steps"] for r in report([str(tmp_path)], dev)] == [5, 10]
    assert rows[0]["floor_s"] == pytest.approx(floor(WORK, _run_metrics(WORK)["model_costs"], dev)["total_s"])


def test_launch_tables_group_the_steps_and_the_fit_recovers_the_per_sequence_cost():
    """launch_by_batch groups a step trace's decode steps by batch, with and without a prefill; launch_fit recovers
    a launch made of a fixed part, a part a decode sequence and a part a prefilled sequence and token, leaving out
    the eager prefills (whose launch is of another kind)."""
    import random
    import statistics

    from fastrag.perf import launch_by_batch, launch_fit

    rng = random.Random(4)
    rows = []
    for i in range(300):
        b = rng.randint(1, 256)
        pre = rng.choice([0, 0, 0, rng.randint(1, 8)])
        tok = pre * rng.randint(20, 120)
        r = {"step": i, "decode_batch": b, "prefill_seqs": pre, "prefill_tokens": tok,
             "launch_s": 6e-4 + 30e-6 * b + 150e-6 * pre + 1e-6 * tok, "track_s": 2e-6 * b}
        r["launch_cpu_s"] = r["launch_s"] * (0.5 if b >= 192 else 1.0)  # (the big steps waited half their launch)
        if pre:
            r["prefill_graphed"] = True
        rows.append(r)
    rows.append({"step": 300, "decode_batch": 0, "launch_s": 0.05, "prefill_seqs": 3, "prefill_tokens": 90})
    rows += [{"step": 301 + i, "decode_batch": 100, "prefill_seqs": 4, "prefill_tokens": 1500,
              "prefill_graphed": False, "launch_s": 0.03} for i in range(10)]
    fit = launch_fit(rows)
    assert fit["steps"] == 300
    for k, want in (("fixed_ms", 0.6), ("per_decode_seq_us", 30), ("per_prefill_seq_us", 150),
                    ("per_prefill_token_us", 1)):
        assert math.isclose(fit[k], want, rel_tol=1e-6, abs_tol=1e-9), (k, fit[k])
    table = launch_by_batch(rows)
    plain = [r for r in table if r["steps"] == "decode only"]
    assert plain[-1]["batch"] == "all" and plain[-1]["n"] == sum(1 for r in rows[:300] if not r["prefill_seqs"])
    big = next(r for r in plain if r["batch"] == "192+")
    sel = [r for r in rows[:300] if not r["prefill_seqs"] and r["decode_batch"] >= 192]
    assert big["n"] == len(sel) and math.isclose(big["launch_s"], sum(r["launch_s"] for r in sel))
    assert math.isclose(big["median_track_ms"], 1e3 * statistics.median(r["track_s"] for r in sel))
    assert math.isclose(big["median_launch_cpu_share"], 0.5) and math.isclose(plain[0]["median_launch_cpu_share"], 1.0)
    with_pre = [r for r in table if r["steps"] == "with a prefill"]
    assert with_pre[-1]["n"] == sum(1 for r in rows if r.get("prefill_seqs") and r.get("decode_batch"))
    assert launch_by_batch([]) == [] and launch_fit(rows[:5]) is None
