#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in parts that each fit one call of the device tool in
# 9 minutes (the tool's limit is 10 minutes a command; a session may be lent ~15 minutes of device time in
# all), so a session lent a GPU spends its time measuring, not composing commands. From the repository
# root on the device, after `bash bench/gpu_wheels.sh` here (the server's wheels, carried in .whl/):
#
#   run(command="bash bench/gpu_session.sh all", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/gpu_session.sh quant", carry=[".whl"], timeout_s=300)     # then, if time is left
#   run(command="bash bench/gpu_session.sh suite", carry=[".whl"], timeout_s=600)     # another session
#
# Parts:
#   all     most important first, each step with its own time limit, cut short so that the part ends
#           within $SESSION_BUDGET_S (default 530 s) even when a step runs to its limit:
#           1. quant      the quantized-checkpoint runs of issue 36 (bench/gpu_quant.sh): FP8 and int4
#                         TPOT at batch 1 against bf16, the FP8 KV cache on nano-vllm's workload, the FP8
#                         and int4 GEMMs alone, the mixture's shape in each format
#           2. cuda_tests the CUDA tests (tests/engine/test_cuda.py, the fused kernels', the sampler's, the
#                         attention kernels', the quantized formats', FP8 KV's, LoRA's, pooling's, vision's, every
#                         CUDA/Triton/graph case elsewhere), on 4 workers
#           3. bench      bench/gpu_bench.sh --skip-hf: nano-vllm's workload at temperature 0.6 (as its
#                         bench.py samples), greedy, with Qwen3's defaults (t 0.6, top-k 20, top-p 0.95),
#                         greedy without overlap: tok/s, GPU idle, host and device ms per step, decode
#                         bytes read per second against a copy measured in the same run
#           4. kernels    `gapless.bench.kernels`: the fused kernels against torch, decode attention against
#                         a copy (batch 1, 8, 64, 256; contexts 1k-8k), every sampling mode at 1, 8, 64 and
#                         256 rows of 151,936 logits, extend attention against a matmul
#           5. latency    `gapless.bench.latency`: TTFT (512-token prompt) and TPOT at concurrency 1, 4, 16,
#                         offline and served
#           6. served     `gapless.bench.served_vs_offline`: the same 256-request workload offline and
#                         through one API server, and each process's CPU per output token
#           7. lora       `gapless.bench.lora`: 1, 4 and 16 distinct adapters in a batch of 64 against the base
#           8. vision     `gapless.bench.vision`: Qwen2.5-VL images through prefill against transformers
#   suite   the whole test suite on the GPU machine (`pytest -n 8 tests`, cut at 480 s), with a plugin
#           that names any test leaving the heap frozen (tests/bench/freeze_guard.py); then nothing else
#   serve   the host step at 256 running requests (`gapless.bench.host`), served vs offline with one and
#           two API server processes, served on asyncio and h11 (uvloop and httptools hidden), and the
#           detokenizer per step with the tokenizers library's threads on and off
#   prefill whether prefill launches cost less than the GPU work they launch (`gapless.bench.prefill_launch`,
#           fused kernels, piecewise graphs, torch ops), and the host bench at 1,024-token prompts
#   sweep   the decode and extend kernels' tunings (what `kernels` times at the defaults), for a session
#           with time to spare
#   quant   the rest of issue 36's runs, which `all` has no time for: bench/gpu_quant.sh's tables phase
#           (Qwen3-8B's FP8 and int4 TPOT on swapped tiles and those tiles alone, the GEMVs' stages, the
#           mixture's shape in each format, the FP8 GEMM's sweep, decode attention over each KV cache, the
#           int4 GEMMs alone, the int4 Triton GEMM's TPOT, the FP8 GEMM alone, gemlite), in 240 s: a second
#           call after `all` on the same machine
#
# SKIP="latency served" leaves those steps out (names as in steps.log, a folder's first part: "bench" for
# bench/run), for a session rechecking what changed with the device time it has left.
#
# The device tool returns at most 8 files from $OUT: a part works in $WORK (default
# ${TMPDIR:-/tmp}/gpu_session/<part>) and leaves in $OUT two files, rewritten after every step so a call
# cut short still returns what finished: gpu_session_<part>.tar.gz (every log and JSON, env.log with the
# commit, device and versions, steps.log with each step's limit, exit status and seconds) and
# gpu_session_<part>.txt (the summary: steps, then each benchmark's table).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
case "$part" in all | suite | serve | prefill | sweep | quant) ;; *) sed -n 2,54p "$0"; exit 2 ;; esac
OUT=${OUT:-bench/results/gpu_session}
WORK=${WORK:-${TMPDIR:-/tmp}/gpu_session/$part}
BUDGET=${SESSION_BUDGET_S:-530}
GRACE=15  # seconds `timeout` waits after SIGINT before SIGKILL
PACK=10   # seconds kept for packing at the end
T0=$SECONDS
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
PY=${PY:-python3}
# a directory that hides uvloop and httptools when put first on PYTHONPATH (their import fails, as where
# they are not installed): for the serve part's run on asyncio and h11
HIDE=${TMPDIR:-/tmp}/gapless-hide
mkdir -p "$HIDE"
for m in uvloop httptools; do echo "raise ImportError('hidden by gpu_session.sh')" >"$HIDE/$m.py"; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# The device has torch, triton and transformers but no package index: the wheels bench/gpu_wheels.sh
# downloads (carried in .whl/) go into a directory of their own on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  site=${TMPDIR:-/tmp}/gapless-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .whl/*.whl >"$WORK/pip.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$site"
fi

{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== commit: $(git rev-parse HEAD 2>/dev/null || echo '(no git here)')"
  git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  echo "cpus: $(nproc)"
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  "$PY" - <<'EOF'
import importlib
for m in "fastapi uvicorn zmq msgspec xgrammar jsonschema httpx2 openai uvloop httptools xdist peft PIL gemlite".split():
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:  # missing, or broken: either way the steps that need it will say
        print(f"{m}: missing ({type(e).__name__}: {e})")
EOF
} >"$WORK/env.log" 2>&1

pack() {  # the tarball and the summary, in $OUT
  {
    echo "gpu_session $part: $(( SECONDS - T0 )) s; commit $(git rev-parse --short HEAD 2>/dev/null)"
    grep -m1 -A1 '^name' "$WORK/env.log" | tail -1  # the GPU, from nvidia-smi
    grep -E '^torch |^cpus|missing' "$WORK/env.log"
    cat "$WORK/steps.log" 2>/dev/null
    for f in quant/gpu_quant.log bench/gpu_bench.log latency.log served.log kernels.log cuda_tests.log lora.log \
      vision.log suite.log frozen.log host.log served_vs_offline.log served_asyncio_h11.log prefill_launch_fused.log \
      prefill_launch_pieces.log prefill_launch_torch.log; do
      [ -f "$WORK/$f" ] || continue
      echo
      echo "## $f"
      case "$f" in
        kernels.log) grep -E '^\| |^[a-z].*:$' "$WORK/$f" | head -130 ;;
        *test*.log | suite.log) grep -E '(passed|failed|error)s? in |^(FAILED|ERROR) |FROZEN' "$WORK/$f" | tail -40 ;;
        frozen.log | quant/gpu_quant.log) cat "$WORK/$f" ;;  # (gpu_quant.log: its own summary)
        *) grep -E '^\| |\*\*|target|WARNING|FAILED' "$WORK/$f" | head -40 ;;
      esac
    done
  } >"$OUT/gpu_session_$part.txt" 2>&1
  tar -czf "$OUT/gpu_session_$part.tar.gz" -C "$WORK" . 2>/dev/null
}

gpu_free() {  # wait (at most 30 s) until no process holds the GPU: a server an earlier step stopped may
  # still be exiting with its KV pool allocated (test_cuda_too_little_memory_for_any_kv_is_a_clear_error
  # failed once right after the served benchmark, and passed in a fresh run)
  command -v nvidia-smi >/dev/null || return 0
  local waited=0
  while [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && [ $waited -lt 30 ]; do
    sleep 1
    waited=$(( waited + 1 ))
  done
  [ $waited -gt 0 ] && echo "(waited $waited s for the GPU's other processes to exit)" >>"$WORK/steps.log"
  return 0
}

step() {  # $1: seconds at most, $2: log name, the rest: the command. Cut to what the budget leaves.
  local limit=$1 name=$2
  shift 2
  case " ${SKIP:-} " in *" ${name%%/*} "*) echo "$name: skipped (SKIP)" >>"$WORK/steps.log"; return ;; esac
  gpu_free
  local start=$SECONDS
  local left=$(( BUDGET - (start - T0) - GRACE - PACK ))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, $(( start - T0 )) s of $BUDGET gone" >>"$WORK/steps.log"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$(dirname "$WORK/$name.log")"
  echo "== $(date -u +%T) +$(( start - T0 )) s $name (limit $limit s): $*" >>"$WORK/steps.log"
  timeout -k "$GRACE" -s INT "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( SECONDS - start )) s (limit $limit s)" >>"$WORK/steps.log"
  tail -3 "$WORK/$name.log"
  pack
}

# (in the order they matter now: pytest-xdist hands tests out in this order, and a call cut at its limit
# (an H200's at 165 s, ~85% of them) leaves the last out: what no GPU has run yet (the e5m2 KV cache's
# kernels, PDL, the FP8 rounding and act-order's column order in the norm and activation, the swapped
# tiles, the MoE align kernel), then the open issue's quantized formats and FP8 KV)
cuda_tests=(tests/attention/test_fp8_kv.py tests/test_pdl.py tests/model/test_fp8_rounding.py
  tests/model/test_ordered_columns.py
  tests/engine/test_cuda.py tests/model/test_quant_fp8.py tests/model/test_quant_int4.py
  tests/model/test_deferred_weights.py tests/model/test_quant_gguf_int4.py tests/model/test_gguf_moe.py
  tests/model/test_moe.py tests/model/test_int4_kernels.py tests/model/test_quant_rtn.py
  tests/model/test_quant_bnb_online.py tests/engine/test_fp8_kv.py tests/attention/test_triton.py
  tests/attention/test_torch_ref.py tests/attention/test_window_backends.py
  tests/sampling tests/model/test_fused_kernels.py tests/engine/test_window_kv.py tests/spec/test_graphs.py
  tests/distributed tests/engine/test_pooling.py tests/lora
  tests/engine/test_vision.py tests/engine/test_vision_gemma3.py tests/engine/test_qwen_vl.py
  tests/engine/test_llava_next.py tests/engine/test_llava_onevision.py)

case "$part" in
  all)
    mkdir -p "$WORK/bench"
    # the quantized-checkpoint runs first: the one open issue whose figures need a GPU (36)
    # (its own budget cut so the CUDA tests get their time: on an H100 they were cut at 111 s; ~140 s are
    # left them, the new kernels' tests first)
    step 365 quant env OUT="$WORK/quant" PY="$PY" QUANT_BUDGET_S=355 bash bench/gpu_quant.sh
    step 180 cuda_tests "$PY" -m pytest -q -n 6 -p no:cacheprovider "${cuda_tests[@]}" \
      -k "(nccl or cuda or gpu or triton or graph or fused or kernel) and not sm90"
    step 140 bench/run env OUT="$WORK/bench" GPU_BENCH_TIMEOUT=125 PY="$PY" bash bench/gpu_bench.sh --skip-hf
    step 75 kernels "$PY" -m gapless.bench.kernels --device cuda --batch 1 8 64 256 --json "$WORK/kernels.json"
    step 100 latency "$PY" -m gapless.bench.latency --device cuda --dtype bfloat16 --size qwen3-0.6b \
      --concurrency 1 4 16 --prompt-len 512 --output-len 128 --json "$WORK/latency.json"
    # one API server process (the issue's 0.825); `--api-server-counts 1,2` also measures two
    step 100 served "$PY" -m gapless.bench.served_vs_offline --device cuda --dtype bfloat16 --size bench \
      --layouts auto --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 \
      --json "$WORK/served.json"
    # issue 37's and 38's benchmarks: 1, 4 and 16 adapters in a batch against the base; images through
    # prefill against transformers, and image chats' decode against text-only ones
    step 70 lora "$PY" -m gapless.bench.lora --device cuda --dtype bfloat16 --size qwen3-0.6b --batch 64 \
      --input-len 128 --max-tokens 128 --json "$WORK/lora.json"
    step 90 vision "$PY" -m gapless.bench.vision --device cuda --family qwen2_5_vl --images 64 --batch 16 \
      --json "$WORK/vision.json"
    ;;
  suite)
    # the plugin names each test after which the heap is left frozen (and unfreezes it, so one leak does
    # not fail every later heap test)
    step 480 suite env PYTHONPATH="$PYTHONPATH:$PWD/tests/bench" GAPLESS_FREEZE_LOG="$WORK/frozen.log" \
      "$PY" -m pytest -q -n 8 -p no:cacheprovider -p freeze_guard --durations=25 tests
    ;;
  serve)
    step 120 host "$PY" -m gapless.bench.host --rounds 3 --engine-option device=cuda --json "$WORK/host.json"
    served=("$PY" -m gapless.bench.served_vs_offline --device cuda --dtype bfloat16 --size bench --layouts auto
      --num-seqs 512 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024)
    # one API server process and two (`--api-server-count`: whether one API server's core holds it back);
    # then with uvloop and httptools hidden (asyncio and h11), served only
    step 200 served_vs_offline "${served[@]}" --api-server-counts 1,2 --json "$WORK/served_vs_offline.json"
    step 120 served_asyncio_h11 env PYTHONPATH="$HIDE:$PYTHONPATH" "${served[@]}" --skip-offline \
      --json "$WORK/served_asyncio_h11.json"
    # the tokenizers library decodes a batch on all cores by default (the server's detokenizer does)
    for par in true false; do
      step 20 "detokenize_parallel_$par" env TOKENIZERS_PARALLELISM=$par "$PY" bench/experiments/detokenize.py \
        --rounds 3 --json "$WORK/detokenize_parallel_$par.json"
    done
    ;;
  prefill)
    # one prefill forward's launch against its GPU work: the fused kernels (this first step also builds the
    # model), the piecewise prefill graphs up to 512 tokens, the torch ops; then the engine's own meter at
    # chunks of 16,384 and 2,048 tokens
    launch=("$PY" -m gapless.bench.prefill_launch --size qwen3-0.6b --dtype bfloat16 --tokens 128 512 2048 16384)
    step 150 prefill_launch_fused "${launch[@]}" --json "$WORK/prefill_launch_fused.json"
    step 90 prefill_launch_pieces "${launch[@]}" --engine-option piecewise_cuda_graph_max_tokens=512 \
      --json "$WORK/prefill_launch_pieces.json"
    step 70 prefill_launch_torch "${launch[@]}" --engine-option fused_kernels=torch \
      --json "$WORK/prefill_launch_torch.json"
    for chunk in 16384 2048; do
      step 100 "prefill_$chunk" "$PY" -m gapless.bench.host --size qwen3-0.6b --num-seqs 64 --input-len 1024 \
        --output-len 1 --modes overlap plain --rounds 1 --engine-option device=cuda \
        --engine-option dtype=bfloat16 --engine-option chunked_prefill_size=$chunk --json "$WORK/prefill_$chunk.json"
    done
    ;;
  quant)
    step 240 quant env OUT="$WORK/quant" PY="$PY" QUANT_PHASES=tables QUANT_BUDGET_S=225 bash bench/gpu_quant.sh
    ;;
  sweep)
    # decode: programs per SM 2 is one split a request at batch 256 (the default), 32 and 64 are 3 and 5
    # shorter splits; extend: blocks of 64 x 64 (the default) against 128 queries and 32 keys; both 2
    # stages deep (the default: one buffer of keys and values, in the sm_90 binary 3 and 4 the same) and 5
    # (two: the next block's copies in flight through a block's compute)
    step 300 kernel_sweep "$PY" -m gapless.bench.kernels --device cuda --batch 1 8 256 --context 1024 4096 8192 \
      --page-size 1 16 --decode-block-n 0 32 --decode-warps 4 8 --decode-stages 2 5 \
      --decode-programs-per-sm 2 32 64 --decode-heads-first 0 1 --extend-block-m 0 128 --extend-block-n 0 32 \
      --extend-warps 4 8 --extend-stages 2 5 --sample-batch 1 256 --json "$WORK/kernel_sweep.json"
    ;;
esac
pack
echo "gpu_session $part: $(( SECONDS - T0 )) s; in $OUT:"
ls -l "$OUT"
cat "$OUT/gpu_session_$part.txt"
