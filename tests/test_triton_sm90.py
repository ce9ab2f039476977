"""Every Triton kernel of fastrag.kernels compiles for Hopper (sm_90) without a GPU (tests/triton_sm90.py, run in a
subprocess without TRITON_INTERPRET): through Triton's whole pipeline to a cubin, with the argument types and
constants its launcher passes, bf16 and fp32. The interpreted tests check what the kernels compute; this checks
that the GPU compiler accepts them, which the interpreter does not."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _launched_kernels() -> set[str]:
    """Names of the @triton.jit functions in kernels/*.py that a launcher starts (`..._kernel`), by module."""
    out = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                out.add(f"{path.stem}.{node.name}")
    return out


@pytest.mark.skipif(not PTXAS.exists(), reason=f"the Triton wheel has no ptxas at {PTXAS}")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9's default, stated: it warns when unset)
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_sm90.py")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert not report["failed"], "\n\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
    done = {c.split("(")[0] for c in report["compiled"]}
    missing = _launched_kernels() - done
    assert not missing, f"kernels no launcher in tests/triton_sm90.py reached (add a launch there): {sorted(missing)}"
    # the paged prefill kernel's launch settings keep its bf16 tiles in registers (a spill to local memory was
    # 896 bytes a thread at 4 warps with int64 key offsets)
    # (and the flash prefix kernel's, at blocks of 64 query rows: 616 bytes a thread at 4 warps and 64-key tiles)
    for label, res in report["usage"].items():
        if label.startswith(("paged_prefill._paged_prefill_kernel(", "fused_decode._prefix_flash_partial_kernel(")) \
                and "IEEE=False" in label and res:
            assert res["stack"] == 0, f"{label} spills {res['stack']} bytes a thread ({res['registers']} registers)"
    # the prefill statistics form s = q.k * scale in several kernels and normalise one kernel's scores by another's
    # log-sum-exp: the scale must be read only by a multiply rounded to nearest that no compiler fuses (mul.rn).
    # With a plain `* scale`, Triton made `dot * scale - m` one fma.rn.f32 in the rows kernel: a row's largest p
    # came out exp(r - log l), r up to half a float32 step of s (tests/ptx_scan.py; kernels/attn_stats.py `_scaled`)
    stats = {label: uses for label, uses in report["scalars"].items() if label.startswith(
        ("attn_stats._causal_lse_kernel(", "attn_stats._causal_colmax_kernel(", "attn_stats._causal_row_lse_kernel(",
         "attn_stats._causal_rows_kernel("))}
    assert len({label.split("(")[0] for label in stats}) == 4, sorted(stats)
    for label, uses in stats.items():
        assert list(uses) and all(ops and all(op.startswith("mul.rn.") for op in ops) for ops in uses.values()), \
            f"{label}: its scale is read by {uses}, which a compiler may contract with the subtraction after it"
    # the row-wise kernels, the shared-prefix softmax and merge and the prefill statistics' rows kernels launch one
    # row a program on a GPU, as every GPU session measured them (rows_per_program in kernels/__init__.py, which
    # they all use: more rows a program only under the interpreter)
    for k in ("fused_decode._add_rms_norm_kernel", "fused_decode._rope_write_kv_kernel",
              "fused_decode._silu_mul_kernel", "fused_decode._prefix_softmax_kernel",
              "fused_decode._prefix_merge_kernel", "attn_stats._causal_row_lse_kernel",
              "attn_stats._causal_rows_kernel"):
        labels = [c for c in report["compiled"] if c.startswith(f"{k}(")]
        assert labels and all("ROWS=1)" in c or "ROWS=1," in c for c in labels), labels
    # both dtypes of the model's attention kernels (bf16 on tensor cores, fp32 in IEEE precision)
    for k in ("paged_prefill._paged_prefill_kernel", "paged_attention._paged_decode_partial_kernel"):
        assert {c for c in report["compiled"] if c.startswith(k + "(") and "IEEE=True" in c} \
            and {c for c in report["compiled"] if c.startswith(k + "(") and "IEEE=False" in c}, k


def test_varying_sizes_compile_each_kernel_once():
    """A size that changes from call to call (a block table's width, rows sharing a prefix, an attention pass's
    tokens) gives the kernels no new Triton specialisation, so an engine run compiles nothing after its warm-up
    (tests/triton_sm90.py --keys: Triton's own specialisation of every launch at sizes 1, 16k and neither)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_sm90.py"), "--keys"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    keys = json.loads(run.stdout.strip().splitlines()[-1])
    seen = {k.split("(")[0] for k in keys}
    for k in ("paged_prefill._paged_prefill_kernel", "paged_attention._paged_decode_partial_kernel",
              "attn_stats._attn_decode_span_kernel", "attn_stats._causal_colmax_kernel",
              "attn_stats._causal_row_lse_kernel", "attn_stats._causal_rows_kernel",
              "fused_decode._prefix_softmax_kernel", "fused_decode._prefix_merge_kernel",
              "fused_decode._prefix_flash_partial_kernel", "fused_decode._prefix_flash_merge_kernel",
              "fused_decode._add_rms_norm_kernel", "fused_decode._rope_write_kv_kernel",
              "fused_decode._silu_mul_kernel"):
        assert k in seen, f"{k} was not launched by tests/triton_sm90.py --keys"
    several = {k: v for k, v in keys.items() if len(v) > 1}
    assert not several, "\n".join(f"{k}: {len(v)} specialisations\n  " + "\n  ".join(v) for k, v in several.items())
