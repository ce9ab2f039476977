"""Build checks that need no GPU: the CUDA sources compile for Hopper with the machine's nvcc (compile only,
-gencode=arch=compute_90,code=sm_90), and the CUDA host glue (glue_cuda.cpp, torch headers) passes the C++
compiler's syntax check with FASTRAG_WITH_CUDA defined. A CUDA source that does not compile fails CI here.

nvcc is looked up as $FASTRAG_NVCC, `nvcc` on PATH and /usr/local/cuda/bin/nvcc (this workplace's machines carry
CUDA 13.0 there); every distinct one found compiles the sources. PyPI has no usable stand-in: the wheel
nvidia-cuda-nvcc-cu12==12.9.86 ships ptxas and headers but no nvcc driver, and nvidia-cuda-nvcc 13.5 the driver
without the NVVM front end (checked 2026-11), so scripts/install.sh reports a machine without nvcc instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CU_SOURCES = sorted(CSRC.glob("*.cu"))
ARCH = "-gencode=arch=compute_90,code=sm_90"


def _nvccs() -> list[tuple[Path, list[str]]]:
    """(nvcc, extra include dirs) for every distinct nvcc found."""
    found: list[tuple[Path, list[str]]] = []
    for cand in (os.environ.get("FASTRAG_NVCC"), shutil.which("nvcc")):
        if cand and Path(cand).exists():
            found.append((Path(cand), []))
    if not found and Path("/usr/local/cuda/bin/nvcc").exists():
        found.append((Path("/usr/local/cuda/bin/nvcc"), []))
    seen, out = set(), []
    for nvcc, inc in found:
        key = nvcc.resolve()
        if key not in seen:
            seen.add(key)
            out.append((nvcc, inc))
    return out


NVCCS = _nvccs()


def _cuda_include_dirs() -> list[str]:
    dirs = [str(n.resolve().parent.parent / "include") for n, _ in NVCCS]
    return [d for d in dict.fromkeys(dirs + ["/usr/local/cuda/include"]) if Path(d).is_dir()]


def test_cuda_sources_exist():
    names = {p.name for p in CU_SOURCES}
    assert {"token_signals.cu", "attn_stats.cu"} <= names, names


@pytest.mark.skipif(not NVCCS, reason="no nvcc on this machine (PATH, $FASTRAG_NVCC, /usr/local/cuda/bin)")
@pytest.mark.parametrize("nvcc,inc", NVCCS, ids=[str(n) for n, _ in NVCCS])
def test_cuda_sources_compile_for_sm90(nvcc, inc, tmp_path):
    """Each .cu compiles alone (device code must not need torch headers), warnings shown on failure."""
    procs = []
    for src in CU_SOURCES:
        cmd = [str(nvcc), "-c", str(src), "-o", str(tmp_path / (src.stem + ".o")), ARCH, "-std=c++17", "-O3",
               "-Xptxas", "-warn-spills", *[f"-I{d}" for d in inc]]
        procs.append((src, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for src, cmd, p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{src.name} does not compile with {nvcc}:\n{' '.join(cmd)}\n{out[-4000:]}"
        assert (tmp_path / (src.stem + ".o")).stat().st_size > 0


@pytest.mark.skipif(not NVCCS, reason="no nvcc on this machine (PATH, $FASTRAG_NVCC, /usr/local/cuda/bin)")
@pytest.mark.parametrize("nvcc,inc", NVCCS, ids=[str(n) for n, _ in NVCCS])
def test_prefill_statistics_round_their_scores_alike(nvcc, inc, tmp_path):
    """csrc/attn_stats.cu's prefill kernels (lse, colmax, rows) read the softmax scale only in `mul.rn.f32`, which no
    compiler contracts: each forms s = q.k * scale rounded, as the lse kernel that normalises the row did. With a
    plain `dot * scale`, ptxas made `dot * scale - m` one FFMA in the rows kernel (the exact product less m), and a
    row's largest p came out exp(r - log l), r up to half a float32 step of s: with head dim 128 (scale 128 ** -0.5)
    a float32 emulation finds rows off by 1.3e-5 at scores ~62 and by 0.13 at ~1e6
    (benchmarks/results/score_rounding_emulation.md). What this test reads is the PTX: ptxas may still contract a
    `mul.f32`, never a `mul.rn.f32`."""
    import ptx_scan

    ptx = tmp_path / "attn_stats.ptx"
    cmd = [str(nvcc), "-ptx", str(CSRC / "attn_stats.cu"), "-o", str(ptx), ARCH, "-std=c++17", "-O3",
           *[f"-I{d}" for d in inc]]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
    kernels = {n: b for n, b in ptx_scan.entries(ptx.read_text()).items() if "causal_" in n}
    # lse, colmax and rows, each for float, bf16 and fp16
    assert len(kernels) == 9, sorted(kernels)
    for name, body in kernels.items():
        uses = ptx_scan.f32_param_uses(body)
        assert len(uses) == 1, f"{name}: expected one f32 parameter (the scale), got {sorted(uses)}"
        (param, lines), = uses.items()
        assert lines, f"{name}: the scale is never read"
        other = [line for line in lines if not line.startswith("mul.rn.")]
        assert not other, f"{name}: the scale is read by instructions a compiler may contract: {other}"


def test_cuda_glue_syntax(tmp_path):
    """glue_cuda.cpp + bindings.cpp with FASTRAG_WITH_CUDA, against the installed torch's headers. A CPU torch
    wheel lacks one generated CUDA header (c10/cuda/impl/cuda_cmake_macros.h, only macros for Windows DLL
    exports), so an empty stand-in is provided; everything else is the real headers."""
    import torch.utils.cpp_extension as ce

    cuda_inc = _cuda_include_dirs()
    if not any((Path(d) / "cuda_runtime_api.h").exists() for d in cuda_inc):
        pytest.skip("no CUDA runtime headers (cuda_runtime_api.h) next to any nvcc")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        pytest.skip(f"no C++ compiler {cxx}")
    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [str(tmp_path / "shim"), *ce.include_paths(), sysconfig.get_paths()["include"], *cuda_inc, str(CSRC)]
    procs = []
    for src in ("glue_cuda.cpp", "bindings.cpp"):
        cmd = [cxx, "-std=c++17", "-fsyntax-only", "-DFASTRAG_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C",
               *[f"-I{d}" for d in incs], str(CSRC / src)]
        procs.append((src, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for src, cmd, p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{src} fails the syntax check:\n{out[-4000:]}"
