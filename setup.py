"""Build the C++ (and, on CUDA machines, CUDA) extension `fastrag._C`.

Metadata lives in pyproject.toml; this file only defines `ext_modules` and `cmdclass`. Install with
`pip install --no-build-isolation -e .` so the build uses the torch already installed (build isolation would
fetch a different torch wheel, and the extension's ABI must match the torch it is imported with).

Sources: every `csrc/*.cpp` is compiled; `csrc/*.cu` are added only when torch is a CUDA build and nvcc is on
PATH (then the extension becomes a CUDAExtension and `FASTRAG_WITH_CUDA` is defined; glue_cuda.cpp compiles to
nothing without it). Dropping a new `.cu` file into csrc/ is all that adding a CUDA kernel takes here; the .cu files
include no torch header, and tests/test_kernels_build.py compiles them with nvcc for sm_90 on CPU-only machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"


def _compiler_supports(flag: str) -> bool:
    """True if the C++ compiler accepts `flag` when compiling and linking a trivial program."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        try:
            res = subprocess.run([cxx, flag, str(src), "-o", str(Path(tmp) / "probe")], capture_output=True)
        except OSError:
            return False
    return res.returncode == 0


def _ext_modules() -> list:
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cpp_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC).glob("*.cpp"))
    cu_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC).glob("*.cu"))
    cxx_flags = ["-O3", "-std=c++17"]
    # FP operations may run speculatively (no code here reads the FP exception flags): GCC then turns the selects
    # of the softmax loops (csrc/row_softmax.*) into vector blends instead of branches. Results are unchanged.
    if _compiler_supports("-fno-trapping-math"):
        cxx_flags.append("-fno-trapping-math")
    # rpath to torch's lib/ so `import fastrag._C` finds libc10/libtorch even before `import torch`.
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    link_flags: list[str] = [f"-Wl,-rpath,{torch_lib}"] if sys.platform.startswith("linux") else []
    # OpenMP parallelises the kernels over rows; torch's own CPU wheel already ships libgomp.
    if sys.platform.startswith("linux") and os.environ.get("FASTRAG_NO_OPENMP") != "1" and _compiler_supports(
        "-fopenmp"
    ):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    elif _compiler_supports("-fopenmp-simd"):  # without OpenMP threads the `omp simd` reductions still vectorise
        cxx_flags.append("-fopenmp-simd")

    with_cuda = bool(torch.version.cuda) and shutil.which("nvcc") is not None and bool(cu_sources)
    if with_cuda:
        return [
            CUDAExtension(
                "fastrag._C",
                cpp_sources + cu_sources,
                # no --use_fast_math: it turns logf into __logf, whose absolute error near 1 would bend the
                # Gumbel noise of the in-kernel sampler (-ln(-ln u), u -> 1 for the likely winners)
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
                extra_link_args=link_flags,
                define_macros=[("FASTRAG_WITH_CUDA", None)],
            )
        ]
    return [CppExtension("fastrag._C", cpp_sources, extra_compile_args=cxx_flags, extra_link_args=link_flags)]


def _cmdclass() -> dict:
    from torch.utils.cpp_extension import BuildExtension

    # ninja is optional: without it BuildExtension falls back to setuptools' sequential compiler.
    return {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


setup(ext_modules=_ext_modules(), cmdclass=_cmdclass())
