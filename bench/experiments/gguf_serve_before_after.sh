#!/usr/bin/env bash
# The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF) served by gapless on the CPU before (the file's
# matrices dequantized to float32, GAPLESS_GGUF_WEIGHTS=dequantize) and after (kept quantized, the default),
# one server at a time, the same client as bench/llamacpp_cpu.sh (`python -m gapless.bench.serving`:
# /v1/completions, greedy, ignore_eos, 64 new tokens, prompts of 34 token ids, the same for both).
#   bench/experiments/gguf_serve_before_after.sh        (env: CONCURRENCY, default "1"; NUM_PROMPTS, default 16)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/gguf_cpu}
CONCURRENCY=${CONCURRENCY:-1}
CLIENT=(--num-prompts "${NUM_PROMPTS:-16}" --input-len 34 --output-len 64 --range-ratio 0 --seed 0 --disable-tqdm)
server=
stop() { [ -n "$server" ] && { kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; }; server=; }
trap stop EXIT
echo "$(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores; commit $(git rev-parse --short HEAD)" | tee "$OUT/machine.txt"
for weights in dequantize quantized; do
  log="$OUT/server_$weights.log"
  GAPLESS_GGUF_WEIGHTS=$weights "$PY" -m gapless serve --port 0 --device cpu --dtype float32 >"$log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    grep -q 'serving .* at http' "$log" && break
    kill -0 "$server" 2>/dev/null || { tail -20 "$log"; echo "server died" >&2; exit 1; }
    sleep 1
  done
  url=$(grep -o "http://[0-9.:]*" "$log" | tail -1)
  for c in $CONCURRENCY; do
    "$PY" -m gapless.bench.serving --base-url "$url" "${CLIENT[@]}" --max-concurrency "$c" \
      --summary-json "$OUT/gapless-$weights-c$c.summary.json" | tee "$OUT/gapless-$weights-c$c.log"
  done
  stop
done
