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

The README's test command hands out whole files (`--dist loadfile`), and xdist sends them longest test list first by
default, which put the files of a few long end-to-end tests last: one worker ran them while the other had finished.
Here the files are sent slowest first instead, by the seconds measured for them (`FILE_SECONDS`), and the files not
listed after them in their usual order; the order of the tests within a file is kept.
"""
from __future__ import annotations

import os


# Seconds each slow test file took in one worker of the README's test command (two workers, 2-core Xeon VM,
# 2026-12-02, `--durations=0` summed by file); the order they give is all that is used. A file left out runs after
# these; a name here that is no test file fails tests/test_conftest_threads.py.
FILE_SECONDS = {
    "test_methods_e2e.py": 660, "test_e2e.py": 424, "test_ray.py": 306, "test_prefill_graphs.py": 243,
    "test_signals.py": 200, "test_run_many.py": 194, "test_fused_decode.py": 152, "test_graph_replay_trace.py": 129,
    "test_paged_prefill.py": 100, "test_bench_reports.py": 85, "test_serving.py": 80, "test_inputs.py": 77,
    "test_triton_sm90.py": 64, "test_kernels_engine.py": 57, "test_kernels.py": 49, "test_prefix_flash.py": 43,
}


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


def pytest_configure(config) -> None:
    # xdist's own order (files with the most tests first) unless it was asked for by name
    if getattr(config.option, "loadscopereorder", False) and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # (a stable sort)
