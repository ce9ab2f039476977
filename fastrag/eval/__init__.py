"""Batch evaluation: run a method over a dataset, write results.jsonl incrementally, resume, score.

The parts: `options` (RunOptions, what a run is), `store` (the results folder: records, manifest, lock, progress,
metrics.json), `report` (scoring, the summary, what the engine and the question loop measured), `runner` (the
engine built, the question loop run, the metrics put together). The names below are what the command line, the
distributed runner, the benchmarks and the tests import; programs embedding fastrag use `fastrag.RAG`
(fastrag.api), which runs through these.
"""

from fastrag.eval.options import (BUNDLED, RunError, RunOptions, method_config, path_problem, sampling_of,
                                  select_qids)
from fastrag.eval.report import Probes, measurements, score_result, summarize, triton_compile_log
from fastrag.eval.runner import build_engine, make_policy, run, run_many
from fastrag.eval.store import (LATER_KEYS, MANIFEST, MEASURED_FIELDS, ResultWriter, check_manifest, close_progress,
                                is_run_record, latest_records, measured_fields, output_lock, path_fingerprint,
                                read_metrics, read_results, resume, run_identity, write_json, write_progress)

__all__ = ["BUNDLED", "LATER_KEYS", "MANIFEST", "MEASURED_FIELDS", "Probes", "ResultWriter", "RunError", "RunOptions",
           "build_engine", "check_manifest", "close_progress", "is_run_record", "latest_records", "make_policy",
           "measured_fields", "measurements", "method_config", "output_lock", "path_fingerprint", "path_problem",
           "read_metrics", "read_results", "resume", "run", "run_identity", "run_many", "sampling_of", "score_result",
           "select_qids", "summarize", "triton_compile_log", "write_json", "write_progress"]
