"""benchmarks/step_profile.py: a decode step's profile split into its parts and its matrix multiplies by weight.

The kernel names below are the ones torch.profiler recorded on the H200 (benchmarks/results/prefill_gpu_h200_*.md,
torch's own kernels) and the names of this project's Triton and CUDA kernels; a CPU profile of a real decode step
of make_random_model's tiny shape checks the GEMM table against the model's own layer count and weight shapes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from fastrag import kernel_parts as kp

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
ROOT = BENCH.parent


def load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


sp = load("step_profile")  # (the GEMM table; the parts are fastrag.kernel_parts')

GPU_NAMES = {
    "nvjet_sm90_tst_256x160_64x4_2x1_v_bz_coopA_TNT": "GEMM",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "GEMM",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false>": "GEMM",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "GEMM",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>":
        "SDPA attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>":
        "SDPA attention",
    "_paged_decode_partial_kernel": "own-context attention",
    "_paged_decode_merge_kernel": "own-context attention",
    "_paged_prefill_kernel": "prefill attention (paged)",
    "_causal_colmax_kernel": "signals and sampling",
    "void causal_rows_kernel<__nv_bfloat16>(...)": "signals and sampling",
    "_prefix_softmax_kernel": "shared-prefix attention",
    "_prefix_merge_kernel": "shared-prefix attention",
    "_prefix_flash_partial_kernel": "shared-prefix attention",
    "_prefix_flash_merge_kernel": "shared-prefix attention",
    "_add_rms_norm_kernel": "fused layer ops",
    "_rope_write_kv_kernel": "fused layer ops",
    "_silu_mul_kernel": "fused layer ops",
    "_token_signals_partial_kernel": "signals and sampling",
    "void decode_partial_kernel<__nv_bfloat16>(...)": "signals and sampling",
    "void decode_combine_kernel(...)": "signals and sampling",
    "_attn_decode_row_kernel": "signals and sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)":
        "signals and sampling",
    "Memcpy DtoH (Device -> Pinned)": "copies and fills",
    "Memset (Device)": "copies and fills",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
    "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)": "copies and fills",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>": "other torch kernels",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>":
        "other torch kernels",
}


@pytest.mark.parametrize("name", sorted(GPU_NAMES))
def test_each_kernel_lands_in_its_part(name):
    assert kp.part_of(name) == GPU_NAMES[name]


def test_every_part_is_reached_and_the_last_takes_anything():
    parts = [p for p, _ in kp.PARTS]
    assert set(GPU_NAMES.values()) == set(parts), set(parts) - set(GPU_NAMES.values())
    assert kp.part_of("a kernel nobody has named yet") == parts[-1]


@pytest.mark.parametrize("name,shapes,dims", [
    ("aten::mm", [[256, 4096], [4096, 12288]], (1, 256, 4096, 12288)),
    ("aten::addmm", [[12288], [256, 4096], [4096, 12288], [], []], (1, 256, 4096, 12288)),
    ("aten::bmm", [[32, 256, 128], [32, 128, 640]], (32, 256, 128, 640)),
    ("aten::baddbmm", [[32, 256, 640], [32, 256, 128], [32, 128, 640], [], []], (32, 256, 128, 640)),
    ("mkldnn::_linear_pointwise", [[4, 1, 576], [960, 576], [], [], [], []], (1, 4, 576, 960)),
    ("aten::mm", [[256, 4096]], None),
    ("aten::mm", [], None),
    ("aten::bmm", [[256, 4096], [4096, 12288]], None),
])
def test_gemm_dims_read_each_operators_shapes(name, shapes, dims):
    assert kp.gemm_dims(name, shapes) == dims


def test_gemm_table_prices_each_shape_against_its_floor():
    """Two steps of a 4096 x 12288 multiply at M = 256 (2 calls, 300 and 500 us), one bmm, one call without shapes:
    the floor is the slower of bytes / bandwidth and FLOPs / rate, counted here by hand."""
    bw, rate = 4.0e12, 6.0e14
    g = [kp.Launch("aten::mm", 300.0, [[256, 4096], [4096, 12288]]),
         kp.Launch("aten::mm", 500.0, [[256, 4096], [4096, 12288]]),
         kp.Launch("aten::bmm", 40.0, [[32, 8, 128], [32, 128, 640]]),
         kp.Launch("aten::mm", 7.0, [])]
    rows = sp.gemm_table(g, steps=2, names={(4096, 12288): "layers.*.qkv"}, elt=2, bw=bw, rate=rate)
    assert [r["gemm"] for r in rows] == ["layers.*.qkv", "batched 32 x", "shapes not recorded"]
    qkv = rows[0]
    nbytes = (256 * 4096 + 4096 * 12288 + 256 * 12288) * 2
    flops = 2 * 256 * 4096 * 12288
    floor = max(nbytes / bw, flops / rate)
    assert flops / rate > nbytes / bw and qkv["bound"] == "compute"
    assert qkv["calls_per_step"] == 1.0 and qkv["ms_per_step"] == pytest.approx(0.4)
    assert qkv["floor_ms_per_step"] == pytest.approx(floor * 1e3)
    assert qkv["x_floor"] == pytest.approx(400e-6 / floor)
    assert qkv["tflop_per_s"] == pytest.approx(flops / 400e-6 / 1e12)
    bmm = rows[1]
    assert bmm["bound"] == "bandwidth"
    assert bmm["floor_ms_per_step"] == pytest.approx(32 * (8 * 128 + 128 * 640 + 8 * 640) * 2 / bw / 2 * 1e3)
    assert rows[2]["floor_ms_per_step"] is None and rows[2]["ms_per_step"] == pytest.approx(0.0035)


def test_parts_table_shares_and_counts():
    ks = [kp.Launch("nvjet_a", 600.0), kp.Launch("nvjet_b", 200.0), kp.Launch("_paged_decode_partial_kernel", 150.0),
          kp.Launch("_paged_decode_merge_kernel", 50.0)] * 2
    rows = kp.parts_table(ks, steps=2)
    assert [r["part"] for r in rows] == ["own-context attention", "GEMM"]  # PARTS order, empty parts left out
    gemm = rows[1]
    assert gemm["kernels"] == 2 and gemm["launches_per_step"] == 2 and gemm["ms_per_step"] == pytest.approx(0.8)
    assert gemm["share"] == pytest.approx(0.8) and rows[0]["share"] == pytest.approx(0.2)
    assert gemm["top"][0] == ("nvjet_a", pytest.approx(0.6))


def test_a_real_cpu_decode_step_profiles_into_its_weights(tmp_path, monkeypatch):
    """bench_decode --profile on the tiny shape (CPU, eager): every layer's four multiplies are one row each with
    one call per layer a step, the LM head one call, at the model's own (K, N); with a shared prefix its batched
    multiplies come too; the section is in the results file."""
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--cpu-small", "--shape", "tiny", "--batches", "3",
                                      "--ctx", "24", "--reps", "1", "--span", "4", "--prefixes", "1",
                                      "--prefix-len", "32", "--profile", "--profile-steps", "2",
                                      "--results", str(tmp_path)])
    bd = load("bench_decode")
    shape = bd.hf_shape("tiny")
    bd.main()
    md = (tmp_path / "decode_cpu_tiny.md").read_text()
    assert "## Where a step's time goes (torch.profiler, 2 steps a way)" in md, md
    assert "### ctx 24, B 3, shared prefixes 1 x 32" in md, md
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and re.fullmatch(r"\d+ x \d+ x \d+ x \d+", cells[1]):
            rows[cells[0]] = cells
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    qkv_out = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * hd
    want = {"layers.*.qkv": (h, qkv_out), "layers.*.o": (h, h), "layers.*.gate_up": (h, 2 * inter),
            "layers.*.down": (inter, h), "lm_head": (h, shape["vocab_size"])}
    for name, (k, n) in want.items():
        assert name in rows, (name, md)
        b, m, kk, nn = map(int, rows[name][1].split(" x "))
        assert (b, m, kk, nn) == (1, 3, k, n), rows[name]
        assert float(rows[name][2]) == (1.0 if name == "lm_head" else float(L)), rows[name]
        assert float(rows[name][3]) > 0 and float(rows[name][4]) > 0, rows[name]
    assert any(k.startswith("batched ") for k in rows), md  # the shared prefix's scores and values
    part_lines = [line for line in md.splitlines() if "%" in line and (
        line.startswith("| GEMM |") or line.startswith("| own-context attention |"))]
    assert len(part_lines) == 2, md  # (the C++ paged kernel is an operator of its own on the CPU)


def test_kernel_profile_window_reads_first_and_count(monkeypatch):
    from fastrag.kernel_parts import KERNEL_PROFILE_ENV, kernel_profile_window

    monkeypatch.delenv(KERNEL_PROFILE_ENV, raising=False)
    assert kernel_profile_window() is None
    for raw, want in (("200:40", (200, 40)), (" 0 : 1 ", (0, 1)), ("", None)):
        monkeypatch.setenv(KERNEL_PROFILE_ENV, raw)
        assert kernel_profile_window() == want, raw
    for bad in ("200", "5:0", "-1:3", "a:b", "1:2:3"):
        monkeypatch.setenv(KERNEL_PROFILE_ENV, bad)
        with pytest.raises(ValueError, match=r"\$FASTRAG_KERNEL_PROFILE=.*expected FIRST:COUNT"):
            kernel_profile_window()


def _steps(window, n_steps: int, stats: dict):
    """n_steps fake engine steps: step i multiplies (i + 1) times and counts one decode step and i prefill tokens."""
    import torch

    a = torch.randn(8, 16)
    b = torch.randn(16, 4)
    for i in range(n_steps):
        window.before_step(stats)
        for _ in range(i + 1):
            torch.mm(a, b)
        stats["decode_steps"] += 1
        stats["prefill_tokens"] += i


def test_a_step_window_profiles_its_steps_only():
    """Window 2:2 over six steps: the GEMM part holds steps 2 and 3's multiplies alone (3 + 4 over 2 steps), and the
    engine counters are the window's change."""
    from fastrag.kernel_parts import StepWindow

    stats = {"decode_steps": 0, "prefill_tokens": 0}
    w = StepWindow(2, 2, "cpu")
    _steps(w, 6, stats)
    assert w.summary is not None and w.finish(stats) is w.summary  # (stopped at step 4's launch already)
    s = w.summary
    assert s["first_step"] == 2 and s["steps"] == 2 and s["unit"].startswith("CPU operator (")
    assert s["engine"]["decode_steps"] == 2 and s["engine"]["prefill_tokens"] == 2 + 3
    gemm = next(r for r in s["parts"] if r["part"] == "GEMM")
    assert gemm["launches_per_step"] == 3.5 and gemm["top"][0][0] == "aten::mm", gemm
    assert s["kernel_s"] > 0 and sum(r["share"] for r in s["parts"]) == pytest.approx(1.0)


def test_a_run_that_ends_inside_the_window_stops_it_there_and_one_that_ends_before_has_none():
    from fastrag.kernel_parts import StepWindow

    stats = {"decode_steps": 0, "prefill_tokens": 0}
    w = StepWindow(1, 10, "cpu")
    _steps(w, 4, stats)  # steps 1, 2, 3 profiled
    assert w.summary is None
    s = w.finish(stats)
    assert s["steps"] == 3 and s["engine"]["decode_steps"] == 3
    assert next(r for r in s["parts"] if r["part"] == "GEMM")["launches_per_step"] == (2 + 3 + 4) / 3
    late = StepWindow(10, 2, "cpu")
    _steps(late, 4, {"decode_steps": 0, "prefill_tokens": 0})
    assert late.finish({"decode_steps": 4}) is None


def test_launches_of_a_gpu_profile_take_kernels_and_the_gemm_operators_device_time():
    """The GPU side of `launches` on a profile as torch.profiler hands it over (device kernels as CUDA events, a
    record_function range's span on the device flagged as a user annotation, operators with their kernels): the
    kernels are the CUDA events but the span, and a multiply operator's time is its kernels' device time."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval, Kernel

    from fastrag.kernel_parts import launches

    def ev(name, dev, start, end, **kw):
        return NS(**({"name": name, "device_type": dev, "time_range": Interval(start, end),
                      "is_user_annotation": False, "is_python_function": False, "kernels": [], "input_shapes": [],
                      "self_cpu_time_total": end - start} | kw))

    events = [ev("nvjet_sm90_tst_256x160", DeviceType.CUDA, 10, 110),
              ev("_paged_decode_partial_kernel", DeviceType.CUDA, 120, 150),
              ev("fastrag.decode", DeviceType.CUDA, 0, 500, is_user_annotation=True),
              ev("aten::mm", DeviceType.CPU, 0, 5, kernels=[Kernel("nvjet_sm90_tst_256x160", 0, 100)],
                 input_shapes=[[256, 4096], [4096, 12288]]),
              ev("cudaLaunchKernel", DeviceType.CPU, 1, 2)]
    prof = NS(events=lambda: events)
    kernels, gemms = launches(prof, gpu=True)
    assert [(k.name, k.us) for k in kernels] == [("nvjet_sm90_tst_256x160", 100), ("_paged_decode_partial_kernel", 30)]
    assert [(g.name, g.us, g.shapes) for g in gemms] == [("aten::mm", 100, [[256, 4096], [4096, 12288]])]
    cpu_kernels, cpu_gemms = launches(prof, gpu=False)  # (a CPU profile: the operators' own times)
    assert [k.name for k in cpu_kernels] == ["aten::mm"] and cpu_gemms[0].us == 5
