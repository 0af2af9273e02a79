#!/usr/bin/env bash
# Where a served request's time goes on the CPU: serve SmolLM2-135M (the default model, float32), send the
# issue-21 client at concurrency 1 and 8 (greedy, ignore_eos, 64 new tokens, ~34-token prompts), and
# sample every process of the server with py-spy (`pip install py-spy`) while the client runs. Writes, per
# concurrency C, under $OUT (default bench/results/cpu_profile/):
#   cC_pidN.txt       py-spy's collapsed stacks of each process (the summary names its role)
#   cC_summary.txt    per process: the share of the run it was on a core, and where that time went
#   cC_bench.log      the client's report
# Usage: bench/profile_served.sh [extra `gapless serve` flags]; PROMPTS1/PROMPTS8 set the request counts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SPY=${SPY:-$(dirname "$PY")/py-spy}
OUT=${OUT:-bench/results/cpu_profile}
mkdir -p "$OUT"
log="$OUT/server.log"
"$PY" -m gapless serve --port 0 --device cpu "$@" >"$log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "serving .* at http" "$log" && break; sleep 1; done
url=$(grep -o "http://[0-9.:]*" "$log" | tail -1)
# the server's process tree: the API server and every descendant (fork server's children included)
tree() { local p; for p in $(pgrep -P "$1"); do echo "$p"; tree "$p"; done; }
for c in 1 8; do
  n=$([ "$c" = 1 ] && echo "${PROMPTS1:-4}" || echo "${PROMPTS8:-16}")
  spies=()
  for pid in $server $(tree $server); do
    "$SPY" record --pid "$pid" --rate 200 --format raw --output "$OUT/c${c}_pid$pid.txt" >/dev/null 2>&1 &
    spies+=($!)
  done
  sleep 2
  start=$(date +%s.%N)
  "$PY" -m gapless.bench.serving --base-url "$url" --num-prompts "$n" --input-len 34 --output-len 64 \
    --range-ratio 0 --max-concurrency "$c" --seed 0 --disable-tqdm | tee "$OUT/c${c}_bench.log"
  seconds=$(echo "$(date +%s.%N) - $start + 2" | bc)
  for s in "${spies[@]}"; do kill -INT "$s"; done
  for s in "${spies[@]}"; do wait "$s" || true; done
  "$PY" bench/experiments/spy.py --rate 200 --seconds "$seconds" "$OUT"/c${c}_pid*.txt | tee "$OUT/c${c}_summary.txt"
done
