"""Settings every test file shares.

Under pytest-xdist (the README's test command runs one worker per core, at most 4), each worker gets its share of
the machine's cores for torch's and OpenMP's threads, and passes that share on to the processes it starts (CLI runs,
text workers, Ray's workers) through OMP_NUM_THREADS: two workers of two threads each on two cores would spend their
time waiting on each other. A run without xdist keeps torch's own default; an OMP_NUM_THREADS given by the user is
kept either way.
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


_share_the_cores()
