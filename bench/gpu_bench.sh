#!/usr/bin/env bash
# The GPU benchmark of the issue, in one command: nano-vllm's offline workload (256 requests, prompt and
# output lengths uniform in [100, 1024], ignore_eos, seed 0) on Qwen3-0.6B's shape with random bf16 weights,
# gapless at temperature 0.6 (as nano-vllm's and Mini-SGLang's bench.py sample), greedy, with Qwen3's
# generation defaults (temperature 0.6, top-k 20, top-p 0.95), greedy without overlap, then transformers
# batched greedy generate on the first 64 requests, in one process (`python -m gapless.bench.gpu`; each row:
# tok/s, GPU idle, host and device ms per step, decode bytes read per second against a device copy
# measured in the same run). Everything goes to $OUT (the device tool copies it back) and to
# stdout:
#   gpu_env.log     nvidia-smi, python/torch/triton/transformers versions, the commit
#   gpu_bench.log   the run's progress, the engine's log lines and the markdown table for the README
#   gpu_bench.json  every number (rewritten after each run, so a run cut short keeps what finished)
#   gpu_util.csv    nvidia-smi's utilization.gpu every 200 ms beside the run: a check of the idle fraction
# Extra arguments go to the benchmark (e.g. --engine-option cuda_graph_max_bs=0, --quick, --skip-hf,
# --runs sampled greedy).
#
#   OUT=/some/dir bash bench/gpu_bench.sh        # on the device: run(command="bash bench/gpu_bench.sh",
#                                                 #   timeout_s=600); $OUT is set there
#
# Runtime on an H100, estimated (not yet measured): about 4 minutes, at most ~7.
#   ~10 s   versions, imports
#   ~10 s   building the 1.2 GB random checkpoint on the CPU (9 s measured on the 2-core dev machine)
# Measured on an H200 (2026-11-25, greedy runs): ~10 s a gapless run, ~30 s in all before transformers.
#   4 x gapless: ~10-30 s engine start (weights, a ~31 GiB KV pool for the whole workload, CUDA graphs
#           when on), ~5 s warm-up (64 requests), and the timed run: 144k output tokens, ~7 s at the
#           20k tok/s target, ~70 s at 2k tok/s; up to ~2 min each if the engine is much slower than that
#   transformers: ~10 s load, then one batch of 64 decoding ~1,000 steps at ~25-40 ms: ~30-40 s
# The benchmark gets SIGINT after GPU_BENCH_TIMEOUT seconds (default 560, inside the device tool's 600),
# so whatever finished is still in the JSON and the log when it comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# the device has torch, triton and transformers but no registry: run from the source tree, no install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== nvidia-smi"
  nvidia-smi || echo "(nvidia-smi failed or is missing)"
  echo "== versions"
  "$PY" - <<'EOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs", f"sm_{p.major}{p.minor}")
for name in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "tqdm"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # a missing package shows here, before the benchmark needs it
        print(name, "MISSING:", e)
import gapless.bench.gpu  # noqa: F401  (the benchmark imports)
print("gapless imports ok")
EOF
  echo "== commit"
  git rev-parse HEAD 2>/dev/null || echo "(no git here)"
  git status --short 2>/dev/null | head -20
} 2>&1 | tee "$OUT/gpu_env.log"

SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used,clocks.sm,power.draw \
    --format=csv -lms 200 >"$OUT/gpu_util.csv" 2>&1 &
  SMI=$!
fi
timeout -k 20 -s INT "${GPU_BENCH_TIMEOUT:-560}" \
  "$PY" -m gapless.bench.gpu --json "$OUT/gpu_bench.json" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
rc=${PIPESTATUS[0]}
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
[ "$rc" = 124 ] && echo "gpu_bench: stopped after ${GPU_BENCH_TIMEOUT:-560} s; partial results in $OUT/gpu_bench.json"
echo "gpu_bench: exit $rc; files in $OUT:"
ls -l "$OUT"
exit "$rc"
