#!/usr/bin/env bash
# The rounding each GGUF type takes when kept quantized on the CPU (issue 35, item 1): the default model's
# Q4_1 file requantized by llama.cpp's llama-quantize into each type (`--allow-requantize --pure`: every
# matrix of that type where its shape allows; llama.cpp falls back for matrices whose rows are not a
# multiple of a K-quant's 256, which SmolLM2's 576-wide ones are not), then bench/experiments/gguf_quality.py
# on each file: perplexity of a fixed text and greedy agreement, kept quantized against the same file
# dequantized to float32. The file's types are the first line of each log.
#
#   bench/experiments/gguf_formats.sh LLAMA_QUANTIZE [TYPE ...]     (default types: Q8_0 Q5_0 Q5_1 Q6_K Q5_K Q4_K Q3_K Q2_K)
# Environment: GGUF_DIR (where the files go, default /tmp/gapless_gguf_formats), OUT (default
# bench/results/gguf_cpu), PY.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,12p "$0"; exit 2; }
QUANTIZE=$(realpath "$1"); shift
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/gguf_cpu}
DIR=${GGUF_DIR:-/tmp/gapless_gguf_formats}
mkdir -p "$DIR" "$OUT"
SRC=$(PYTHONPATH=. "$PY" -c "from gapless.default_model.smollm2 import smollm2_path; print(smollm2_path())")
for t in "${@:-Q8_0 Q5_0 Q5_1 Q6_K Q5_K Q4_K Q3_K Q2_K}"; do
  for fmt in $t; do
    f="$DIR/SmolLM2-135M-Instruct.$fmt.gguf"
    [ -f "$f" ] || "$QUANTIZE" --allow-requantize --pure "$SRC" "$f" "$fmt" >"$DIR/quantize_$fmt.log" 2>&1
    echo "$(date -u) load $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)" >"$OUT/quality_$fmt.log"
    PYTHONPATH=. "$PY" bench/experiments/gguf_quality.py "$f" 2>&1 | grep -v "^USDT\|Warning" >>"$OUT/quality_$fmt.log" \
      || echo "gguf_quality.py failed on $fmt (see above)" >>"$OUT/quality_$fmt.log"
    tail -6 "$OUT/quality_$fmt.log"
  done
done
