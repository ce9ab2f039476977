"""The token-signal kernels must not contract `x * inv_t - m` into one FMA (checked on the CPU: Triton compiles
PTX for sm_90 without a GPU).

An FMA keeps the product's rounding error, so at the smallest temperature the row's maximum gets y - m ~ 1e31
instead of 0: a positive log-probability, and in the nucleus kernel an infinite weight that picked token 0. The
H200 run of tests/test_kernels.py::test_decode_signals_at_the_smallest_temperature failed so on 2026-11-25; the
interpreter, which never contracts, cannot show it. Here every launch that `token_signals` makes is recorded
(kernels stubbed), compiled with the options it was launched with, and its PTX searched for `fma.rn.f32`; the
same kernel compiled with contraction on must contain one, so the search can fail. The prefill attention
statistics have the same check in tests/test_triton_sm90.py (Triton) and tests/test_kernels_build.py (CUDA): their
scale is read only by a multiply rounded to nearest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.token_signals as ts

launches = []

class Stub:
    def __init__(self, name):
        self.fn = getattr(ts, name)
        self.name = name
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launches.append((self.name, self.fn, args, kwargs))
        return launch

for name in ("_token_signals_partial_kernel", "_token_signals_combine_kernel", "_token_signals_top_p_kernel"):
    setattr(ts, name, Stub(name))

B, V = 2, 5000
logits = torch.randn(B, V, dtype=torch.bfloat16)
out = (torch.empty(B, dtype=torch.int64), torch.empty(B), torch.empty(B), torch.empty(B), None)
keys = torch.zeros(B, dtype=torch.int64)
ts.token_signals(logits, 0.7, keys, None, None, out)              # split-V: partial + combine
ts.token_signals(logits, 0.7, keys, None, None, out, top_p=0.5)   # nucleus

PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32",
       torch.uint8: "*u8"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
target = GPUTarget("cuda", 90, 32)
report = []
for name, fn, args, kwargs in launches:
    names = fn.arg_names
    sig, consts = {}, {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            sig[names[i]] = PTR[a.dtype]
        elif isinstance(a, float):
            sig[names[i]] = "fp32"
        else:  # as Triton specialises a Python int argument
            sig[names[i]] = "i32" if -2**31 <= a < 2**31 else "i64"
    for k, v in kwargs.items():
        if k not in OPTIONS:
            sig[k] = "constexpr"
            consts[(names.index(k),)] = v
    opts = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    counts = {}
    for fuse in (opts.get("enable_fp_fusion", True), True):
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                             options=opts | {"enable_fp_fusion": fuse}).asm["ptx"]
        counts[str(fuse)] = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    report.append({"kernel": name, "options": {k: v for k, v in opts.items()}, "fma": counts})
print(json.dumps(report))
"""


def test_token_signal_kernels_compile_without_fma_contraction():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JIT functions, compiled
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(r["kernel"] for r in report) == ["_token_signals_combine_kernel", "_token_signals_partial_kernel",
                                                   "_token_signals_top_p_kernel"]
    for r in report:
        assert r["options"].get("enable_fp_fusion") is False, r
        assert r["fma"]["False"] == 0, r  # launched as it is: no contraction
        assert r["fma"]["True"] > 0, r    # the search finds the contraction when it is there
