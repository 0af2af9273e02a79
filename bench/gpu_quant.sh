#!/usr/bin/env bash
# The quantized-weights runs of issue 36 on a GPU (sm_89+), in at most ~250 s on an H200:
#   1. TPOT at batch 1, FP8 weights against bf16, on Qwen3-0.6B's, Qwen3-8B's and Qwen3-30B-A3B's (a
#      mixture of experts) shapes (random weights,
#      `load_format=dummy`: nothing written or read; `gapless.bench.quant`), each run in its own process;
#      the table gives each TPOT and its ratio to bf16's (the issue's target: <= 0.6)
#   2. the FP8 KV cache on nano-vllm's workload, greedy (the issue's target: >= 1.3x bf16 KV's tok/s)
#   3. the int4 GEMM alone against bf16 on Llama-3-8B's layers (`gapless.bench.int4_gemm`), then
#   4. the FP8 GEMM alone against bf16 and torch._scaled_mm on both models' linear shapes, 1 and 128 rows
#      (bench/experiments/fp8_gemm.py)
# Logs go to $1, else $OUT, else bench/results/gpu_quant: gpu_quant.log (the tables), quant_*.json (each
# run), fp8_gemm.log. bench/gpu_session.sh's `all` part calls it (step `quant`, OUT=$WORK/quant).
#
#   run(command="bash bench/gpu_quant.sh", timeout_s=300)      # on the device tool; $OUT is set there
#
# Each step has its own time limit (`timeout`), so one that hangs leaves the others their time; the GEMM
# table gets what is left of $QUANT_BUDGET_S (default 250) seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results/gpu_quant}}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/gpu_quant.log"
SHAPES="${TMPDIR:-/tmp}/gapless-quant-shapes"
T0=$SECONDS

say() { echo "$*" | tee -a "$LOG"; }
: >"$LOG"
say "== gpu_quant $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" -m gapless.bench.quant make "$SHAPES" >>"$LOG" 2>&1 || { say "FAILED: making the shapes"; exit 1; }

runs=()
tpot() {  # $1: limit (s), $2: shape, $3: run name, the rest: --engine-option items
  local limit=$1 shape=$2 name=$3
  shift 3
  local json="$OUT/quant_${shape}_${name}.json"
  timeout -k 10 -s INT "$limit" "$PY" -m gapless.bench.quant run "$SHAPES/$shape" --json "$json" "$@" \
    >"$OUT/quant_${shape}_${name}.log" 2>&1
  local rc=$?
  say "$shape $name: exit $rc at +$(( SECONDS - T0 )) s; $(tail -1 "$OUT/quant_${shape}_${name}.log")"
  runs+=("$json")
}

tpot 40 qwen3-0.6b bf16
tpot 40 qwen3-0.6b fp8 --engine-option quantization=fp8
tpot 50 qwen3-8b bf16
tpot 50 qwen3-8b fp8 --engine-option quantization=fp8
# the mixture (~61 GB in bf16): its experts in fp8 too (W8A16 in the fused grouped GEMM)
tpot 70 qwen3-30b-a3b bf16
tpot 60 qwen3-30b-a3b fp8 --engine-option quantization=fp8
# slots for the other quantized runs of issue 36, when they land:
say ""
"$PY" -m gapless.bench.quant report "${runs[@]}" 2>&1 | tee -a "$LOG"

# the FP8 KV cache on nano-vllm's workload, greedy (`bench/gpu_bench.sh --kv-cache-dtype fp8`); the bf16
# figure it compares with is the same run's greedy row (bench/gpu_session.sh's bench step, same machine)
timeout -k 5 -s INT 55 env OUT="$OUT/kv_fp8" GPU_BENCH_TIMEOUT=50 PY="$PY" bash bench/gpu_bench.sh --skip-hf \
  --runs greedy --kv-cache-dtype fp8 >"$OUT/kv_fp8.log" 2>&1
say ""
say "kv_fp8: exit $? at +$(( SECONDS - T0 )) s"
grep -E '^\| gapless' "$OUT/kv_fp8/gpu_bench.log" 2>/dev/null | tee -a "$LOG"

# the int4/int8 weight-only GEMM against bf16's on Llama-3-8B's layers, at 1 and 16 rows, the heuristic's
# tiles and the one-row GEMV variant (the issue's TPOT target needs an int4 checkpoint of that shape)
timeout -k 5 -s INT 45 "$PY" -m gapless.bench.int4_gemm --device cuda --block-m 0 1 \
  --json "$OUT/int4_gemm.json" >"$OUT/int4_gemm.log" 2>&1
say ""
say "int4_gemm: exit $? at +$(( SECONDS - T0 )) s"
grep -E '^\|' "$OUT/int4_gemm.log" | tee -a "$LOG"

left=$(( ${QUANT_BUDGET_S:-250} - (SECONDS - T0) ))
if [ "$left" -gt 15 ]; then
  timeout -k 5 -s INT "$left" "$PY" bench/experiments/fp8_gemm.py --rows 1 128 >"$OUT/fp8_gemm.log" 2>&1
  rc=$?
  say ""
  say "fp8_gemm: exit $rc at +$(( SECONDS - T0 )) s"
  grep -E '^\|' "$OUT/fp8_gemm.log" | tee -a "$LOG"
else
  say "fp8_gemm: skipped, $(( SECONDS - T0 )) s gone"
fi
say "gpu_quant: $(( SECONDS - T0 )) s"
