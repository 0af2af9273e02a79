#!/usr/bin/env bash
# gapless vs llama.cpp on the CPU, issue 21's comparison: SmolLM2-135M-Instruct, one server at a time, the
# same client (`python -m gapless.bench.serving`: /v1/completions, greedy, ignore_eos, 64 new tokens, 64
# prompts of 34 token ids, the same ids for every server), at concurrency 1, 8 and 32.
#
#   bench/llamacpp_cpu.sh LLAMA_SERVER F32.gguf [OTHER.gguf ...]
#
# LLAMA_SERVER: a built llama-server binary (README, "Serving on a CPU", says how to build it from the
# package index); F32.gguf: SmolLM2's Q4_1 GGUF requantized to F32 (`llama-quantize --allow-requantize
# IN.gguf OUT.gguf F32`), so both engines serve bit-identical weights (gapless serves the Q4_1 GGUF
# dequantized, its default model). Further GGUFs (F16, Q4_1) run after it, each as its own engine.
# Environment: GAPLESS_DTYPES (default "float32"; e.g. "float32 bfloat16"), CONCURRENCY (default "1 8 32"),
# THREADS (llama-server -t, default the core count), NUM_PROMPTS (default 64; fewer for a quick check),
# OUT (default bench/results/llamacpp_cpu), PY; GAPLESS_ARGS and LLAMA_ARGS: more options for each server
# (e.g. GAPLESS_ARGS="--speculative-algorithm ngram" LLAMA_ARGS="--spec-type ngram-simple": both engines'
# n-gram speculation). The tables name the engines alone, so give such a run its own OUT; machine.txt
# records the options.
# Writes per engine and concurrency C: <engine>_cC.summary.json and .log, the servers' logs, and
# comparison.md (gapless.bench.compare: the ratio table). Every process it starts is stopped on exit.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,18p "$0"; exit 2; }
LLAMA_SERVER=$(realpath "$1"); shift
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/llamacpp_cpu}
THREADS=${THREADS:-$(nproc)}
CONCURRENCY=${CONCURRENCY:-1 8 32}
mkdir -p "$OUT"
CLIENT=(--num-prompts "${NUM_PROMPTS:-64}" --input-len 34 --output-len 64 --range-ratio 0 --seed 0 --disable-tqdm)
server=
stop() { [ -n "$server" ] && { kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; }; server=; }
trap stop EXIT

wait_ready() {  # $1: log, $2: command that succeeds once the server is up
  for _ in $(seq 600); do
    eval "$2" >/dev/null 2>&1 && return 0
    kill -0 "$server" 2>/dev/null || { tail -20 "$1"; echo "server died" >&2; exit 1; }
    sleep 1
  done
  echo "server not ready after 600 s" >&2; exit 1
}

measure() {  # $1: engine label, $2: base URL, $3: concurrency
  "$PY" -m gapless.bench.serving --base-url "$2" "${CLIENT[@]}" --max-concurrency "$3" \
    --summary-json "$OUT/$1_c$3.summary.json" | tee "$OUT/$1_c$3.log"
}

echo "$(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores; commit $(git rev-parse --short HEAD);" \
  "gapless options: ${GAPLESS_ARGS:-(defaults)}; llama-server options: ${LLAMA_ARGS:-(defaults)}" | tee "$OUT/machine.txt"
for dtype in ${GAPLESS_DTYPES:-float32}; do
  log="$OUT/server_gapless-$dtype.log"
  # shellcheck disable=SC2086  # GAPLESS_ARGS: several words on purpose
  "$PY" -m gapless serve --port 0 --device cpu --dtype "$dtype" ${GAPLESS_ARGS:-} >"$log" 2>&1 &
  server=$!
  wait_ready "$log" "grep -q 'serving .* at http' '$log'"
  url=$(grep -o "http://[0-9.:]*" "$log" | tail -1)
  for c in $CONCURRENCY; do measure "gapless-$dtype" "$url" "$c"; done
  stop
done
port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
for gguf in "$@"; do
  engine="llama.cpp-$(basename "$gguf" .gguf | grep -o '[^.]*$')"
  for c in $CONCURRENCY; do
    log="$OUT/server_${engine}_c$c.log"
    # shellcheck disable=SC2086  # LLAMA_ARGS: several words on purpose
    "$LLAMA_SERVER" -m "$gguf" -t "$THREADS" -np "$c" -c $((c * 256)) --host 127.0.0.1 --port "$port" \
      ${LLAMA_ARGS:-} >"$log" 2>&1 &
    server=$!
    wait_ready "$log" "curl -sf http://127.0.0.1:$port/health"  # 503 while the model loads
    measure "$engine" "http://127.0.0.1:$port" "$c"
    stop
  done
done
"$PY" -m gapless.bench.compare "$OUT" | tee "$OUT/comparison.md"
