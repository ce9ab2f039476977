"""fastrag.kernels.compiles: Triton's JIT cache misses, recorded by kernel, per timed run (metrics.json
`triton_compiles`) and per engine step (the step trace's `compiles`).

Without a GPU nothing compiles (TRITON_INTERPRET=1), so these tests call Triton's own hook knob the way Triton's
`JITFunction._do_compile` calls it; on a GPU the last test compiles a real kernel."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from triton import knobs

from fastrag.kernels import compiles
from fastrag.kernels.compiles import COMPILES, CompileLog


def _miss(name: str):
    """A JIT cache miss of kernel `name`, as Triton reports it to its hook: what the hook returns."""
    try:
        from triton.runtime.jit import JitFunctionInfo
        fn = JitFunctionInfo("some.module", name, None)
    except ImportError:  # (a Triton without the class: the same fields)
        fn = SimpleNamespace(module="some.module", name=name, jit_function=None)
    return knobs.runtime.jit_cache_hook(key=("k",), repr=f"{name}[num_warps=4, num_ctas=1](x: *fp32)", fn=fn,
                                        compile={}, is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def knob(monkeypatch):
    """Triton's hook knob and the process-wide log, as they were, back after the test."""
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", knobs.runtime.jit_cache_hook)
    for attr in ("installed", "why_not", "row", "_prev"):
        monkeypatch.setattr(COMPILES, attr, getattr(COMPILES, attr))
    return knobs.runtime


def test_the_log_records_each_miss_by_kernel_and_chains_to_the_hook_before_it(knob):
    seen = []

    def earlier(**kw):  # a hook someone set first: it is still called, and its answer (skip the compile) kept
        seen.append(kw["fn"].name)
        return len(seen) == 2

    knob.jit_cache_hook = earlier
    log = CompileLog()
    assert log.install() and log.installed and log.why_not is None
    assert log.install()  # (once: it does not chain to itself)
    mark0 = log.mark()
    assert _miss("attn_kernel") is False
    mark1 = log.mark()
    assert _miss("attn_kernel") is True  # the earlier hook's answer goes back to Triton
    row = {"step": 7}
    log.row = row
    assert _miss("norm_kernel") is False
    assert seen == ["attn_kernel", "attn_kernel", "norm_kernel"]
    assert row["compiles"] == ["norm_kernel"]
    assert log.since(mark0) == {"attn_kernel": 2, "norm_kernel": 1}
    assert log.since(mark1) == {"attn_kernel": 1, "norm_kernel": 1}
    assert log.report(mark1) == {"hooked": True, "why_not": None, "count": 2,
                                 "kernels": {"attn_kernel": 1, "norm_kernel": 1}}
    assert [n for _, n in log.events] == ["attn_kernel", "attn_kernel", "norm_kernel"]
    # a kernel defined inside a function or a class: Triton gives its qualified name, the log its own
    mark2 = log.mark()
    _miss("test_x.<locals>._scaled_copy")
    _miss("Fused.rope_kernel")
    assert log.since(mark2) == {"_scaled_copy": 1, "rope_kernel": 1}


def test_a_triton_without_the_hook_is_said_so(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "knobs", SimpleNamespace(runtime=SimpleNamespace()))
    log = CompileLog()
    assert log.install() is False and not log.installed
    assert "jit_cache_hook" in log.why_not
    assert log.report(0)["hooked"] is False


def test_a_run_reports_the_compiles_inside_its_clock_and_the_steps_they_stopped(tmp_path, monkeypatch, knob):
    """fastrag.eval with the step trace: a compile before the run is not counted; one in the second step is counted
    in metrics.json and named in that step's row and in the trace's summary."""
    from fastrag.engine import Engine
    from fastrag.eval import BUNDLED, RunOptions, run

    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    model_dir = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    cfg = tmp_path / "dragin.json"
    cfg.write_text(json.dumps({"method": "attn_entropy", "generate_max_length": 12, "hallucination_threshold": 0.5,
                               "retrieve_topk": 2, "query_formulation": "real_words"}))
    assert COMPILES.install()
    _miss("before_the_run")
    at = random.randrange(1, 4)  # the step that compiles
    launches = []
    launch = Engine.step_launch

    def step_launch(self, *a, **k):
        out = launch(self, *a, **k)
        launches.append(len(launches))
        if len(launches) - 1 == at:
            _miss("paged_prefill_kernel")
        return out

    monkeypatch.setattr(Engine, "step_launch", step_launch)
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "1")
    m = run(RunOptions(method="dragin", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                       corpus=str(BUNDLED / "wiki_passages.jsonl"), model=str(model_dir), config=str(cfg),
                       limit=2, batch_size=2, output=str(tmp_path / "run"), progress=False, overlap=True))
    assert len(launches) > at
    assert m["triton_compiles"] == {"hooked": True, "why_not": None, "count": 1,
                                    "kernels": {"paged_prefill_kernel": 1}}
    rows = [json.loads(x) for x in (tmp_path / "run" / "step_trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("compiles")] == [at]
    assert rows[at]["compiles"] == ["paged_prefill_kernel"]
    assert m["step_trace"]["triton_compiles"] == 1
    assert [x["step"] for x in m["step_trace"]["steps_with_compiles"]] == [at]
    assert COMPILES.row is None  # (no row of an ended run is written to afterwards)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real Triton compile needs a GPU")
def test_a_real_compile_on_the_gpu_is_recorded(knob):
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_copy(x, y, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * SCALE, mask=i < n)

    assert COMPILES.install()
    mark = COMPILES.mark()
    x = torch.randn(100, device="cuda")
    y = torch.full_like(x, float("nan"))
    scale = random.randrange(2, 1000)  # a constexpr this process has not compiled
    _scaled_copy[(1,)](x, y, x.numel(), SCALE=scale, BLOCK=128)
    torch.testing.assert_close(y, x * scale)
    assert COMPILES.since(mark) == {"_scaled_copy": 1}
    _scaled_copy[(1,)](x, y, x.numel(), SCALE=scale, BLOCK=128)  # in Triton's cache now: no miss
    assert COMPILES.since(mark) == {"_scaled_copy": 1}
    assert compiles.COMPILES is COMPILES
