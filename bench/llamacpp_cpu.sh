#!/usr/bin/env bash
# gapless vs llama.cpp on the CPU, the same GGUF file in both (issue 35): each file is served by
# `gapless serve FILE` and by `llama-server -m FILE`, one server at a time, alternately (for each file and
# each concurrency C: gapless, then llama.cpp, each a fresh server so neither meets a warm prefix cache),
# with the same client (`python -m gapless.bench.serving`: /v1/completions, greedy, ignore_eos, 64 new
# tokens, prompts of 34 token ids, the same ids for every server), at concurrency 1, 8 and 32.
#
#   bench/llamacpp_cpu.sh LLAMA_SERVER FILE.gguf [FILE.gguf ...]
#
# LLAMA_SERVER: a built llama-server binary (docs/benchmarks.md, "Measuring against llama.cpp", says how to
# build it and llama-quantize from the package index). Files: the default model's Q4_1 GGUF as it is, and
# `llama-quantize --allow-requantize Q4_1.gguf OUT.gguf F32` (or Q8_0, ...); each engine is labelled by the
# file name's last dotted part (`SmolLM2-135M-Instruct.Q8_0.gguf` -> gapless-Q8_0, llama.cpp-Q8_0).
# Environment: GAPLESS_DTYPES (default "float32": the activations' dtype gapless serves each file with;
# others are labelled gapless-<FILE>-<dtype>), CONCURRENCY (default "1 8 32"), THREADS (llama-server -t,
# default the core count), NUM_PROMPTS (default: 8 at 1 request, C at C: one wave; one number for every C), OUT (default
# bench/results/llamacpp_gguf), PY; GAPLESS_ARGS and LLAMA_ARGS: more options for each server (e.g.
# GAPLESS_ARGS="--speculative-algorithm ngram" LLAMA_ARGS="--spec-type ngram-simple"); machine.txt records them.
# Writes per engine and concurrency C: <engine>_cC.summary.json and .log, the servers' logs, and
# comparison.md (gapless.bench.compare: the ratio tables, and one row per file: gapless vs llama.cpp).
# Every process it starts is stopped on exit.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,22p "$0"; exit 2; }
LLAMA_SERVER=$(realpath "$1"); shift
files=(); for f in "$@"; do files+=("$(realpath "$f")"); done
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/llamacpp_gguf}
THREADS=${THREADS:-$(nproc)}
CONCURRENCY=${CONCURRENCY:-1 8 32}
mkdir -p "$OUT"
CLIENT=(--input-len 34 --output-len 64 --range-ratio 0 --seed 0 --disable-tqdm)
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
  echo "$(date -u +%T) $1 c=$3, load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/order.txt"
  local n=$(($3 == 1 ? 8 : $3))
  "$PY" -m gapless.bench.serving --base-url "$2" "${CLIENT[@]}" --num-prompts "${NUM_PROMPTS:-$n}" --max-concurrency "$3" \
    --summary-json "$OUT/$1_c$3.summary.json" | tee "$OUT/$1_c$3.log"
}

gapless() {  # $1: file, $2: label, $3: dtype, $4: concurrency
  local log="$OUT/server_$2_c$4.log"
  # shellcheck disable=SC2086  # GAPLESS_ARGS: several words on purpose
  "$PY" -m gapless serve "$1" --port 0 --device cpu --dtype "$3" ${GAPLESS_ARGS:-} >"$log" 2>&1 &
  server=$!
  wait_ready "$log" "grep -q 'serving .* at http' '$log'"
  measure "$2" "$(grep -o "http://[0-9.:]*" "$log" | tail -1)" "$4"
  stop
}

llama() {  # $1: file, $2: label, $3: concurrency
  local log="$OUT/server_$2_c$3.log"
  # shellcheck disable=SC2086  # LLAMA_ARGS: several words on purpose
  "$LLAMA_SERVER" -m "$1" -t "$THREADS" -np "$3" -c $(($3 * 256)) --host 127.0.0.1 --port "$port" \
    ${LLAMA_ARGS:-} >"$log" 2>&1 &
  server=$!
  wait_ready "$log" "curl -sf http://127.0.0.1:$port/health"  # 503 while the model loads
  measure "$2" "http://127.0.0.1:$port" "$3"
  stop
}

echo "$(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores; commit $(git rev-parse --short HEAD);" \
  "gapless options: ${GAPLESS_ARGS:-(defaults)}; llama-server options: ${LLAMA_ARGS:-(defaults)}" | tee "$OUT/machine.txt"
port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
: >"$OUT/order.txt"
for gguf in "${files[@]}"; do
  fmt=$(basename "$gguf" .gguf | grep -o '[^.]*$')
  for c in $CONCURRENCY; do
    for dtype in ${GAPLESS_DTYPES:-float32}; do
      label="gapless-$fmt"; [ "$dtype" = float32 ] || label="$label-$dtype"
      gapless "$gguf" "$label" "$dtype" "$c"
    done
    llama "$gguf" "llama.cpp-$fmt" "$c"
  done
done
"$PY" -m gapless.bench.compare "$OUT" | tee "$OUT/comparison.md"
