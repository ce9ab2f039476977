"""Settings every test file shares.

Under pytest-xdist (the README's test command runs one worker per core, at most 4), each worker gets its share of
the machine's cores for torch's and OpenMP's threads, and passes that share on to the processes it starts (CLI runs,
text workers, Ray's workers) through OMP_NUM_THREADS: two workers of two threads each on two cores would spend their
time waiting on each other. A run without xdist keeps torch's own default; an OMP_NUM_THREADS given by the user is
kept either way.

Without a CUDA device, Triton's kernels run under its interpreter (TRITON_INTERPRET=1), which Triton reads when it is
first imported. The test modules that run kernels on CPU tensors set it before they import anything, but the first
module to import triton decides for all: `pytest tests/test_triton_sm90.py tests/test_kernels.py` (that order; the
first imports triton to compile for sm_90 in a subprocess) failed 294 kernel tests with "Cannot call @triton.jit'd
outside of the scope of a kernel". So it is set here, before any test module is imported; a value the user gave
is kept.
"""
from __future__ import annotations

import os


def _share_the_cores() -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _interpret_triton_without_a_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_share_the_cores()
_interpret_triton_without_a_gpu()

import pytest  # noqa: E402  (after the settings above, which must come before any module that imports torch)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """benchmarks/make_random_model.py's tiny shape in a folder of its own: random float32 weights, the embedded
    tokenizer (the random-model parity tests of tests/test_e2e.py and tests/test_methods_e2e.py)."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from make_random_model import make

    return make("tiny", tmp_path_factory.mktemp("tiny"), dtype=torch.float32, device="cpu")
