#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in parts that each fit one call of the device tool (at
# most 10 minutes a command, 30 minutes of device time a session), so a session lent a GPU spends its time
# measuring, not composing commands. Run from the repository root on the device:
#
#   run(command="bash bench/gpu_session.sh tests", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/gpu_session.sh bench", timeout_s=600)        # = bench/gpu_bench.sh
#   run(command="bash bench/gpu_session.sh serve", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/gpu_session.sh prefill", timeout_s=600)
#   run(command="bash bench/gpu_session.sh suite", carry=[".whl"], timeout_s=600)
#
# Five parts of up to 10 minutes each exceed one session's 30 minutes of device time: take them in this
# order (the open issues' targets first) and leave `suite` to the next session lent a GPU.
#
# Parts (each writes $OUT/<part>/, with env.log: the commit, the device, the versions):
#   tests   the CUDA tests (tests/engine/test_cuda.py and every CUDA/Triton/graph case elsewhere, and the
#           fused kernels' tests, which run on the GPU where there is one), then the
#           kernel microbenchmark (`gapless.bench.kernels`: fused kernels, sampling, decode attention in
#           TB/s against a copy, extend attention in TFLOP/s against a matmul) and its sweep of the decode
#           kernel's tunings at batch 256, contexts 1k-8k, page sizes 1 and 16 (issue 11's 80%-of-bandwidth
#           check) and of the extend kernel's at 2k and 16k tokens
#   bench   bench/gpu_bench.sh: nano-vllm's workload, overlap on and off, transformers beside it
#           (issues 10 and 11: tok/s, GPU idle, host and device ms per step)
#   serve   the host step at 256 running requests (`gapless.bench.host`, issue 10's <= 1.5 ms per decode
#           step), served vs offline throughput of one workload (`gapless.bench.served_vs_offline`,
#           >= 0.9: nano-vllm's lengths, 512 requests at once, a small model whose steps are short, with
#           each server process's CPU per output token and the collector's pauses; one API server
#           process and two, `--api-server-count`), served again with
#           uvloop and httptools hidden (asyncio and h11: what they save on this machine), and the
#           detokenizer per step (`gapless.bench.detokenize`)
#   prefill whether prefill launches cost less than the GPU work they launch (issue 10 item 2): one
#           forward's launch time against its GPU work and a CUDA graph's (`gapless.bench.prefill_launch`,
#           Qwen3-0.6B's shape, 128 to 16,384 tokens: fused kernels, the piecewise prefill graphs up to
#           512 tokens, torch ops), then the host bench with 1,024-token prompts and one output token,
#           chunks of 16,384 and 2,048 tokens: host ms per prefill step beside device ms per job
#   suite   the whole test suite on the GPU machine, 8 workers (pytest-xdist is installed there), with
#           CUDA present: the parity, overlap and server suites on the device they are meant for; then the
#           scoring path (`gapless.bench.scoring`)
# The device has torch, triton and transformers but no package index: `serve` and the server tests need
# the wheels `bench/gpu_wheels.sh` downloads here into .whl/ (run it first; ~12 MB), carried with
# carry=[".whl"]; they are installed into /tmp/gapless-site for the part. Each step has its own timeout,
# so a slow step leaves the later ones their time and everything finished is in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
case "$part" in tests | bench | serve | prefill | suite) ;; *) sed -n 2,41p "$0"; exit 2 ;; esac
OUT=${OUT:-bench/results/gpu_session}
dir="$OUT/$part"
mkdir -p "$dir"
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

install() {  # $1: a target directory, the rest: wheels
  local target=$1
  shift
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}
if ls .whl/*.whl >/dev/null 2>&1; then
  install /tmp/gapless-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gapless-site"
fi
# a directory that hides uvloop and httptools when put first on PYTHONPATH (their import fails, as where
# they are not installed): for the serve part's run on asyncio and h11
HIDE=/tmp/gapless-hide
mkdir -p "$HIDE"
for m in uvloop httptools; do echo "raise ImportError('hidden by gpu_session.sh')" >"$HIDE/$m.py"; done

{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== commit: $(git rev-parse HEAD 2>/dev/null || echo '(no git here)')"
  git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  for m in fastapi uvicorn zmq msgspec xgrammar flashinfer; do
    "$PY" -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>/dev/null || echo "$m: missing"
  done
  for m in uvloop httptools; do
    "$PY" -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>/dev/null || echo "$m: missing"
  done
} 2>&1 | tee "$dir/env.log"

step() {  # $1: seconds, $2: log name, the rest: the command
  local limit=$1 name=$2
  shift 2
  echo "== $(date -u +%T) $name: $*" | tee -a "$dir/steps.log"
  timeout -k 15 -s INT "$limit" "$@" >"$dir/$name.log" 2>&1
  local rc=$?
  echo "== $(date -u +%T) $name: exit $rc" | tee -a "$dir/steps.log"
  tail -5 "$dir/$name.log"
}

case "$part" in
  tests)
    step 240 cuda_tests "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda.py tests/attention \
      tests/sampling tests/model/test_moe.py tests/model/test_fused_kernels.py tests/engine/test_window_kv.py \
      tests/spec/test_graphs.py tests/distributed -k "nccl or cuda or triton or graph"
    # the fused kernels' own tests, whole (their names do not say cuda): on the GPU they compile for it
    step 120 fused_tests "$PY" -m pytest -q -p no:cacheprovider tests/model/test_fused_kernels.py \
      tests/sampling/test_fused_draw.py tests/sampling/test_fused_penalties.py tests/sampling/test_fused_nucleus.py
    step 90 kernels "$PY" -m gapless.bench.kernels --device cuda --json "$dir/kernels.json"
    # decode: programs per SM 2 is one split a request at batch 256 (the default), 32 and 64 are 3 and 5
    # shorter splits; extend: blocks of 64 x 64 (the default) against 128 queries and 32 keys
    # (sm_90 resources, from the compiled binaries here: block n 64 takes 75 registers and 39 KB of shared
    # memory a program, 128 takes 160 registers and 73 KB: too few programs an SM, so it is not swept)
    step 240 kernel_sweep "$PY" -m gapless.bench.kernels --device cuda --batch 256 --context 1024 4096 8192 \
      --page-size 1 16 --decode-block-n 0 32 --decode-warps 4 8 --decode-stages 2 3 \
      --decode-programs-per-sm 2 32 64 --decode-heads-first 0 1 --extend-block-m 0 128 --extend-block-n 0 32 \
      --extend-warps 4 8 --extend-stages 2 3 --json "$dir/kernel_sweep.json"
    ;;
  bench)
    OUT="$dir" GPU_BENCH_TIMEOUT=${GPU_BENCH_TIMEOUT:-560} bash bench/gpu_bench.sh
    ;;
  serve)
    step 170 host "$PY" -m gapless.bench.host --rounds 3 --engine-option device=cuda --json "$dir/host.json"
    served=("$PY" -m gapless.bench.served_vs_offline --device cuda --dtype bfloat16 --size bench --layouts auto
      --num-seqs 512 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024)
    # the server as installed (uvloop and httptools), with the offline run for the ratio, with one API
    # server process and with two (`--api-server-count`: whether one API server's core holds it back);
    # then with uvloop and httptools hidden, served only (its tok/s and the API server's CPU per token)
    step 300 served_vs_offline "${served[@]}" --api-server-counts 1,2 --json "$dir/served_vs_offline.json"
    step 150 served_asyncio_h11 env PYTHONPATH="$HIDE:$PYTHONPATH" "${served[@]}" --skip-offline \
      --json "$dir/served_asyncio_h11.json"
    # the tokenizers library decodes a batch on all cores by default (the server's detokenizer does); on
    # 2 cores one thread was faster: both, to choose
    for par in true false; do
      step 20 "detokenize_parallel_$par" env TOKENIZERS_PARALLELISM=$par "$PY" -m gapless.bench.detokenize \
        --rounds 3 --json "$dir/detokenize_parallel_$par.json"
    done
    ;;
  prefill)
    # one prefill forward's launch against its GPU work (decisive: the meter below cannot tell a
    # launch-bound job from a GPU-bound one): the fused kernels (this first step also builds the model),
    # the piecewise prefill graphs up to 512 tokens, the torch ops; then the engine's own meter at chunks
    # of 16,384 and 2,048 tokens
    launch=("$PY" -m gapless.bench.prefill_launch --size qwen3-0.6b --dtype bfloat16 --tokens 128 512 2048 16384)
    step 180 prefill_launch_fused "${launch[@]}" --json "$dir/prefill_launch_fused.json"
    step 100 prefill_launch_pieces "${launch[@]}" --engine-option piecewise_cuda_graph_max_tokens=512 \
      --json "$dir/prefill_launch_pieces.json"
    step 80 prefill_launch_torch "${launch[@]}" --engine-option fused_kernels=torch \
      --json "$dir/prefill_launch_torch.json"
    for chunk in 16384 2048; do
      step 110 "prefill_$chunk" "$PY" -m gapless.bench.host --size qwen3-0.6b --num-seqs 64 --input-len 1024 \
        --output-len 1 --modes overlap plain --rounds 1 --engine-option device=cuda \
        --engine-option dtype=bfloat16 --engine-option chunked_prefill_size=$chunk --json "$dir/prefill_$chunk.json"
    done
    ;;
  suite)
    step 470 suite "$PY" -m pytest -q -n 8 -p no:cacheprovider tests
    step 110 scoring "$PY" -m gapless.bench.scoring --device cuda --out "$dir/scoring.json"
    ;;
esac
echo "gpu_session $part: files in $dir"
ls -l "$dir"
