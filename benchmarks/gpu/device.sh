#!/usr/bin/env bash
# Run on a lent GPU machine (device tool, from the repository root, carry [".gpu_carry"] made by prepare.sh):
#     bash benchmarks/gpu/device.sh STAGE [STAGE ...]
# Stages (each logs to $OUT/logs/STAGE.log and leaves its tables in $OUT/results/; a failing stage does not stop the
# ones after it; the setup runs first whenever this machine has not done it, so every call is self-contained):
#   tests     the GPU test suite: kernels (Triton, CUDA) against fastrag/signals/reference.py, the Triton paged
#             decode attention, CUDA graphs vs eager decoding, engine/model/attention-tracking tests on the GPU
#   kernels   benchmarks/bench_kernels.py (signal kernels vs torch, GB/s, fraction of the copy bandwidth)
#   decode    benchmarks/bench_decode.py (Llama-2-7B shape, B 1/16/64/256 x ctx 1k/4k, vs roofline, graphs/eager)
#   model     make_random_model.py llama2-7b (E2E_SHAPE) into /tmp (kept while the machine stays warm)
#   e2e       bench_e2e.py: engine DRAGIN vs the published per-question recipe and the tuned one, on that model
#             (E2E_LIMIT, E2E_BATCH, E2E_ORACLE_LIMIT, E2E_TUNED_LIMIT override the sizes)
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

setup() {
    if [ -f /tmp/fastrag_setup_done ]; then return 0; fi
    nvidia-smi || true
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    mkdir -p "$SITE" /tmp/fastrag_data
    tar xJf "$C/site.tar.xz" -C "$SITE"
    tar xJf "$C/data.tar.xz" -C /tmp/fastrag_data
    # the GPU image's torch/transformers/triton stay; the extension is built against that torch (CUDA kernels too)
    $PY -m pip install --no-deps --no-build-isolation --no-index -e . || return 1
    $PY -c "import fastrag._C as C; print('fastrag._C built; CUDA kernels:', hasattr(C, 'decode_signals_cuda'))"
    touch /tmp/fastrag_setup_done
}

stage() {
    local name=$1
    shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/logs/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 25 "$OUT/logs/$name.log"
    return $rc
}

copy_results() {
    cp benchmarks/results/*gpu* benchmarks/results/*cuda* "$OUT/results/" 2>/dev/null || true
}

stage setup setup || { echo "setup failed: see $OUT/logs/setup.log"; exit 1; }
for st in "$@"; do
    case $st in
        tests)
            stage tests $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/results/gpu_tests.xml" \
                tests/test_kernels.py tests/test_paged_attention_triton.py tests/test_cuda_graphs.py \
                tests/test_kernels_engine.py tests/test_attn_tracking.py tests/test_model.py tests/test_kv_reuse.py \
                tests/test_paged_attention.py tests/test_signals.py tests/test_cache.py
            ;;
        kernels) stage kernels $PY benchmarks/bench_kernels.py ;;
        decode) stage decode $PY benchmarks/bench_decode.py ;;
        model)
            [ -f "$MODEL/config.json" ] || stage model $PY benchmarks/make_random_model.py \
                --shape "$SHAPE" --out "$MODEL" --tokenizer "$C/tokenizer"
            ;;
        e2e)
            stage e2e $PY benchmarks/bench_e2e.py --model "$MODEL" --data-dir /tmp/fastrag_data \
                --limit "${E2E_LIMIT:-64}" --batch-size "${E2E_BATCH:-128}" --oracle-limit "${E2E_ORACLE_LIMIT:-3}" \
                --tuned-oracle-limit "${E2E_TUNED_LIMIT:-6}" --output /tmp/fastrag_runs/bench_e2e
            ;;
        *) echo "unknown stage $st (tests, kernels, decode, model, e2e)"; exit 2 ;;
    esac
    copy_results
done
copy_results
ls -la "$OUT/results"
