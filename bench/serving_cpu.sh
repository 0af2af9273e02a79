#!/usr/bin/env bash
# Online benchmark on the CPU: the built-in tiny model served with overlap on and off, alternately (the
# machine is shared and its speed drifts), each measured by `python -m gapless.bench.serving` with the
# same workload. Logs go to $OUT (default bench/results/serving_cpu/), with per run:
#   server_RUN.log        the server's log
#   bench_RUN.log         the benchmark's report, then the server's idle and integrity metrics after it
#   RUN.summary.json      the run's config, summary and report (committed)
#   RUN.json              the same with every request's timings (large: bench/.gitignore keeps it out of git)
# Extra arguments go to every benchmark run (e.g. --num-prompts 20 for a quick check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/serving_cpu}
mkdir -p "$OUT"
BENCH_ARGS=(--num-prompts 200 --request-rate 50 --input-len 128 --output-len 64 --range-ratio 0.5 --seed 0 --disable-tqdm)
for run in overlap-1 plain-1 overlap-2 plain-2; do
  mode=${run%-*}
  flags=(--device cpu --kv-cache-tokens 65536)
  [ "$mode" = plain ] && flags+=(--disable-overlap)
  log="$OUT/server_$run.log"
  "$PY" -m gapless serve --model tiny-random --port 0 "${flags[@]}" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do grep -q "serving .* at http" "$log" && break; sleep 1; done
  url=$(grep -o "http://[0-9.:]*" "$log" | tail -1)
  "$PY" -m gapless.bench.serving --base-url "$url" "${BENCH_ARGS[@]}" "$@" --output-json "$OUT/$run.json" \
    --summary-json "$OUT/$run.summary.json" | tee "$OUT/bench_$run.log"
  curl -s "$url/metrics" | grep -E "^gapless_(device_idle|num_requests|kv_used|integrity)" >>"$OUT/bench_$run.log"
  kill -INT $pid; wait $pid || true
done
