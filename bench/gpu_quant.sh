#!/usr/bin/env bash
# The quantized-weights runs of issue 36 on a GPU (sm_89+), within $QUANT_BUDGET_S seconds (default 370),
# in two phases ($QUANT_PHASES, default "targets tables"), the issue's targets first:
#   targets
#   1. TPOT at batch 1 against bf16 (`gapless.bench.quant`; random weights, `load_format=dummy`: nothing
#      written or read), each run in its own process and profiled: FP8 weights (`--quantization fp8`) on
#      Qwen3-0.6B's and Qwen3-8B's shapes (the issue's target: <= 0.6), int4 w4a16 (AWQ g128) on
#      Qwen3-8B's (target: <= 0.4) through the default (`auto`: torch's tinygemm at decode rows)
#   2. nano-vllm's workload, greedy, with a bf16 and an FP8 KV cache (the issue's target: >= 1.3x bf16 KV's
#      tok/s), each with 8 decode steps profiled, then the FP8 cache's again with the decode kernel
#      pipelined 5 stages deep (`GAPLESS_DECODE_STAGES=5`); then Qwen3-8B's FP8 in Qwen's own layout
#      (`-fp8`: a scale per [128, 128] block, as `Qwen/Qwen3-8B-FP8` holds it)
#   tables (what decides the next change; bench/gpu_session.sh's `all` has time for the targets only, so a
#   second call runs these: `QUANT_PHASES=tables bash bench/gpu_quant.sh`)
#   3a. decode attention at batch 256 over a bf16 and an fp8 cache in blocks of 64 and 128 keys; Qwen3-8B's
#      int4 TPOT on the swapped tiles (W x^T) and on the Triton GEMM as chosen (the GEMV at one row), its
#      bitsandbytes NF4 and NVFP4 TPOT (the codebook's lookups), its FP8 TPOT on the swapped tiles,
#      Qwen3-0.6B's FP8 with the activation and the norms launched before the GEMVs (against the targets
#      phase's runs on this machine); decode attention alone over each KV cache, batches of 64 and 256, 2
#      and 5 stages, registers capped at 96, 128 or not (`gapless.bench.kernels`); the int4 GEMV with its
#      loads 1 and 4 iterations deep and K split as now chosen (~7 programs an SM), as before (~2) and 16
#      ways, factored or not, against tinygemm; nano-vllm's workload over the bf16 KV cache
#      with the decode kernel 5 stages deep; the FP8 GEMV's stages
#   3b. the mixture's TPOT in bf16; the swapped tiles alone at 1 and 16 rows
#   3. the mixture Qwen3-30B-A3B's shape in FP8 and int4 (its experts in the fused grouped GEMM)
#   4. the FP8 GEMM's tiles, K splits, stages and ways of rounding x at 1, 32 and 128 rows, and its GEMV's
#      at one row (`fp8_gemm.py --sweep`)
#   5. decode attention at batch 1 over short contexts, split less, prefetched or not
#   6. the int4 GEMMs alone (Triton with its GEMV and PTX values, tinygemm) against bf16 on Llama-3-8B's
#      layers, from decode to prefill sizes (`gapless.bench.int4_gemm`); int4 TPOT with act-order (GPTQ
#      `desc_act`: o's x gathered a layer), the 8B's and the mixture's; the FP8 GEMM alone against bf16 and
#      torch._scaled_mm on both models' linear shapes, 1 and 128 rows (bench/experiments/fp8_gemm.py);
#      Qwen3-8B's FP8 TPOT with x rounded by launches; its int4 TPOT on gemlite; its TPOT as a Q4_K_M GGUF
#      file
# then the table of every TPOT run and their profiles. Logs go to $1, else $OUT, else
# bench/results/gpu_quant: gpu_quant.log (the tables), quant_*.json (each run), fp8_sweep.log,
# fp8_gemm.log, int4_gemm.log, kv_attention.log. bench/gpu_session.sh's `all` part calls it first (step
# `quant`, OUT=$WORK/quant).
#
#   run(command="bash bench/gpu_quant.sh", timeout_s=360)      # on the device tool; $OUT is set there
#
# Each step has its own time limit (`timeout`), so one that hangs leaves the others their time; a step
# whose limit is past what is left of $QUANT_BUDGET_S (default 370) seconds is cut to it, or skipped.
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
left() { echo $(( ${QUANT_BUDGET_S:-370} - (SECONDS - T0) )); }
limit() {  # $1: a step's own limit; what of it the budget leaves (0: skip the step)
  local l
  l=$(left)
  [ "$l" -lt 15 ] && { echo 0; return; }
  [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
tpot() {  # $1: limit (s), $2: shape, $3: run name, the rest: --engine-option items
  local lim shape=$2 name=$3
  lim=$(limit "$1")
  shift 3
  [ "$lim" -eq 0 ] && { say "$shape $name: skipped, $(( SECONDS - T0 )) s gone"; return; }
  local json="$OUT/quant_${shape}_${name}.json"
  timeout -k 10 -s INT "$lim" "$PY" -m gapless.bench.quant run "$SHAPES/$shape" --json "$json" "$@" \
    >"$OUT/quant_${shape}_${name}.log" 2>&1
  local rc=$?
  say "$shape $name: exit $rc at +$(( SECONDS - T0 )) s; $(tail -1 "$OUT/quant_${shape}_${name}.log")"
  runs+=("$json")
}
other() {  # $1: limit (s), $2: name (its log $OUT/$2.log), the rest: the command; then its table rows
  local lim name=$2
  lim=$(limit "$1")
  shift 2
  say ""
  [ "$lim" -eq 0 ] && { say "$name: skipped, $(( SECONDS - T0 )) s gone"; return; }
  timeout -k 5 -s INT "$lim" "$@" >"$OUT/$name.log" 2>&1
  say "$name: exit $? at +$(( SECONDS - T0 )) s"
}

phase() { [[ " ${QUANT_PHASES:-targets tables} " == *" $1 "* ]]; }
kv_run() {  # nano-vllm's workload, greedy, 8 decode steps profiled: $1: the run's name, $2: its KV cache
  # dtype, the rest: its environment (NAME=value); then its table rows and profile
  local name=$1 kv=$2
  shift 2
  other 80 "$name" env "$@" OUT="$OUT/$name" GPU_BENCH_TIMEOUT=75 PY="$PY" bash bench/gpu_bench.sh --skip-hf \
    --runs greedy --kv-cache-dtype "$kv" --profile-steps 8
  grep -E '^\| gapless|Triton compiled' "$OUT/$name/gpu_bench.log" 2>/dev/null | tee -a "$LOG"
  sed -n '/a decode step of every request/,/^$/p' "$OUT/$name/gpu_bench.log" 2>/dev/null | tee -a "$LOG"
}

if phase targets; then
# each TPOT run of the issue's targets profiled after it is timed (`--profile`: each kernel's device time a
# token, and their sum against TPOT: how much of a token is the GEMMs, the other kernels, the gaps)
tpot 45 qwen3-0.6b bf16 --profile  # (first: a cold machine's start-up falls on the smallest model)
tpot 50 qwen3-8b bf16 --profile
tpot 50 qwen3-8b fp8 --profile --engine-option quantization=fp8
# the small shape's FP8 (every layer under the GEMV's bound: no rounding launch, and now no activation or
# input norm launch, the GEMVs make them as they load x; 0.75x bf16's TPOT on an H200 before those two,
# 1.01x without the GEMV: bench/results/h200-2026-11-27-default), launch-bound: with PDL after the KV runs
tpot 40 qwen3-0.6b fp8 --profile --engine-option quantization=fp8
tpot 50 qwen3-8b-awq int4 --profile  # (its config's quantization_config: AWQ int4 g128), the default GEMM

# the FP8 KV cache on nano-vllm's workload, greedy (`bench/gpu_bench.sh --kv-cache-dtype fp8`), against
# the bf16 KV cache's run just before it on the same machine; each run then profiles 8 decode steps of
# its 256 requests at once (`--profile-steps`: each kernel's device time a step, attention's against the
# rest), and names any Triton compile in its timed run (an H200's fp8 run of 4e5a5eb took 0.66 s more
# host time in prefill than bf16's, likely compiling: bench/results/h200-2026-11-27-default)
# then the FP8 KV cache's run again with the decode kernel pipelined 5 stages deep (`GAPLESS_DECODE_STAGES`:
# in the sm_90 binary 2-4 stages keep one buffer, so each step waits for all its copies and a program's
# loads and compute take turns; 5 keep the next key block's copies in flight through a block's compute,
# for shared memory: docs/gpu.md#fp8-kv-on-a-gpu), against the same bf16 run
kv_run kv_auto auto
kv_run kv_fp8 fp8
kv_run kv_fp8_staged fp8 GAPLESS_DECODE_STAGES=5
# Qwen's own FP8 layout (`Qwen/Qwen3-8B-FP8`: a scale per [128, 128] block, the checkpoints users serve),
# against the per-channel run above: the same GEMV and tiles, each K step's block scale loaded with it
tpot 45 qwen3-8b-fp8 fp8_block --profile
# Qwen3-0.6B's FP8 with programmatic dependent launch (`gapless.pdl`: each Triton kernel launched while the
# one before it runs), against its run above; last, as the one the budget cuts first
GAPLESS_PDL=1 tpot 40 qwen3-0.6b fp8_pdl --profile --engine-option quantization=fp8
fi

if phase tables; then
# the int4 and FP8 targets' likeliest ways first, as TPOT: int4 on the swapped tiles and on the Triton GEMV
# (never timed since a split GEMM's parts were added by a torch sum and cast after it, two launches a
# layer), FP8 on the swapped tiles, the 0.6B's FP8 with its activations and norms launched; then decode
# attention over each cache (the FP8 KV target's lever), the int4 GEMV's stages and splits against
# tinygemm, the bf16 KV run pipelined deeper, the FP8 GEMV's stages (each short, each deciding a default);
# the mixture in bf16, the swapped tiles alone, what no GPU has run (the mixture quantized), the sweeps
# that decide the next defaults (the FP8 GEMM's at one row for gate/up and down; decode attention at batch
# 1 split less), the int4 GEMMs' table, act-order, the FP8 GEMM's table, the 8B's FP8 with x rounded by
# launches, and gemlite; before all of them, one short table (the FP8 KV target is the furthest from its
# figure: 0.99x of >= 1.3x)

# decode attention at batch 256 over 4k keys, bf16 and fp8 caches, in blocks of 64 keys (the default) and
# 128, at 2 stages (never timed at 128). In the sm_90 binary (Triton 3.6 and 3.9) a step's slots load and
# its copies are issued after the step before's compute and waited for at its top, so a program's bytes in
# flight are one block's: at 64 keys 16 KB over fp8 against bf16's 32, at 105 registers (4 programs an SM)
# against 79 (5), which fits fp8 reading 0.67x bf16's bytes rate on an H200 (2.64 against 3.95 TB/s:
# bench/results/h200-2026-11-27-default). At 128 keys fp8's blocks are 32 KB: 142 registers and 75 KB of
# shared memory, 3 programs an SM
other 30 kv_blocks "$PY" -m gapless.bench.kernels --device cuda --batch 256 --context 4096 --page-size 1 \
  --kv-cache-dtype auto fp8 --decode-block-n 0 128 --tokens 16 --extend-tokens 2048 --sample-batch 1 \
  --json "$OUT/kv_blocks.json"
awk '/^decode attention/,/^$/' "$OUT/kv_blocks.log" 2>/dev/null | tee -a "$LOG"

# Qwen3-8B's TPOT with every FP8 layer (`GAPLESS_FP8_SWAPPED`: up to 16 rows, the GEMV off) and every int4
# layer (`GAPLESS_INT4_SWAPPED`, on the Triton GEMM) in swapped tiles, against the targets phase's FP8
# (0.70x bf16's on an H200) and AWQ (tinygemm: 0.66x) runs on this machine: FP8's are fp8's wgmma with both
# operands e4m3 from shared memory (115 instructions a loop step for 64 x 128 weight bytes in the sm_90
# binary, no widening), int4's the dequantized weights as wgmma's register operand (253 instructions a 4 KB
# step, against the GEMV's 420 and the 16-row tiles' 627)
GAPLESS_INT4_KERNEL=triton GAPLESS_INT4_SWAPPED=1 tpot 45 qwen3-8b-awq int4_swapped
# the same on gapless's Triton GEMM as chosen (`GAPLESS_INT4_KERNEL=triton`: the GEMV at one row, its K
# split for ~7 programs an SM, never timed, the parts added by the tile's last program, `split_k.finish`)
GAPLESS_INT4_KERNEL=triton tpot 50 qwen3-8b-awq int4_triton
# bitsandbytes NF4 kept in 4 bits (unsloth's `*-bnb-4bit`; never run on a GPU): the int4 path's Triton GEMV
# looking each value up in the codebook (a gather load a value where AWQ's take arithmetic), against bf16
# and the AWQ runs above: whether a GPU keeps such weights by default (`GAPLESS_BNB_WEIGHTS=auto`) or
# runs them as floats (`dequantize`: bf16's TPOT, 3.5x the bytes)
tpot 50 qwen3-8b-nf4 nf4
# ModelOpt's NVFP4 (never run on a GPU): the same lookups in groups of 16 (a scale a 16 values), as vLLM
# runs such checkpoints on Hopper, weight-only
tpot 50 qwen3-8b-nvfp4 nvfp4
# GPTQ int4 with its LM head quantized too (GPTQModel's `lm_head: true`): the 8B's bf16 head took 283 us of
# the AWQ run's 3,255 (an H200), the same in every run that keeps it bf16; the int4 target (<= 0.4x bf16's)
# leaves ~910 us for the 144 layer GEMMs with a bf16 head (3.69 GB: 4.1 TB/s, above cuBLAS bf16's 3.76 on
# these layers), ~1,080 with the head in int4 (0.33 GB, ~110 us: 3.4 TB/s)
tpot 50 qwen3-8b-gptq-head int4_head
GAPLESS_FP8_SWAPPED=1 tpot 45 qwen3-8b fp8_swapped --engine-option quantization=fp8
# Qwen3-0.6B's FP8 with the activation launched before each down GEMV and the RMSNorm before each qkv
# and gate/up GEMV (`GAPLESS_FP8_UNFUSED_ACTIVATION`, `GAPLESS_FP8_UNFUSED_NORM`), against the targets
# phase's run, where the GEMVs make them as they load x (three launches a layer fewer; never timed)
GAPLESS_FP8_UNFUSED_ACTIVATION=1 GAPLESS_FP8_UNFUSED_NORM=1 \
    tpot 40 qwen3-0.6b fp8_launched --engine-option quantization=fp8
# decode attention alone over a bf16 and an fp8 cache (the FP8 KV target's lever): batches of 256
# (nano-vllm's full batch) and 64, 1k and 4k contexts, pages of 1 token (the engine's default; 16 timed the
# same within 1% on an H200), blocks of 64 keys (the default; an fp8 cache's values in pairs: 0.75x bf16's
# time at batch 256 on an H200, 2.6 TB/s of e4m3 against bf16's 3.9: bench/results/h200-2026-11-27-default),
# pipelined 2 stages deep (the default) and 5 (`DecodeTuning.num_stages`), each with the registers the
# compiler chooses and capped at 96 and 128 (`DecodeTuning.max_registers`). In the sm_90 binary (Triton 3.6)
# at 2 stages a program has one block in flight at most, and none during its compute
# (docs/gpu.md#fp8-kv-on-a-gpu), so the programs an SM holds bound its bytes in flight: the fp8 kernel's 138
# registers fit 3 programs an SM where bf16's 96 fit 5 (at the ~2.4 us step fp8's 2.6 TB/s implies, 5
# would read past the bandwidth); capped at 96 (no spills) fp8 fits 5 too. At 5 stages the next block's
# copies are in flight through a block's compute, in 57.3 KB of shared memory over fp8 (3 programs an SM
# at 148 registers, 4 capped at 128) and 73.7 over bf16 (3). Extend attention over each cache at 2,048
# tokens
other 75 kv_attention "$PY" -m gapless.bench.kernels --device cuda --batch 64 256 --context 1024 4096 \
  --page-size 1 --kv-cache-dtype auto fp8 --decode-stages 2 5 --decode-max-registers 0 96 128 \
  --tokens 16 --extend-tokens 2048 --sample-batch 1 --json "$OUT/kv_attention.json"
awk '/^(decode|extend) attention/,/^$/' "$OUT/kv_attention.log" 2>/dev/null | tee -a "$LOG"
# the GEMVs' loads through asynchronous copies 1-4 loop iterations deep (never timed; 1 is today's plain
# loads, the default): FP8 on both models' layers against the default path, so also whether the GEMV then
# beats the 16-row tiles on the 8B's gate/up and down (`fp8_gemm.py --gemv-stages`); int4 on Llama-3-8B's
# layers against tinygemm, the default at decode (on an H200 the GEMV took 1.3-2.1x its time), with K split
# as now chosen (`--split-k 0`: ~7 programs an SM, as its registers allow: 768 on qkv), as before (2 on
# qkv, 4 on o and down: ~2 an SM; that H200 run) and 16 ways, each with PTX values (the default) and
# factored (`--factored`: the scale and zero once a word; 335 instructions a loop body in the sm_90 binary
# against 420). Why deeper or more: a program's plain loads keep one 4 KB step in flight, so 1.5 programs an
# SM hold ~6 KB where the H200's bandwidth wants ~29 KB an SM in flight (4.8 TB/s times ~0.8 us, over 132
# SMs: docs/gpu.md); 4 stages 16 KB a program. A split's parts are added by the tile's last program
# (`split_k.finish`), no launch after
other 55 int4_gemv_stages "$PY" -m gapless.bench.int4_gemm --device cuda --m 1 --block-m 1 --ptx-values 1 \
  --factored 0 1 --stages 1 4 --split-k 0 2 4 16 --kernels triton tinygemm --json "$OUT/int4_gemv_stages.json"
tee -a "$LOG" <"$OUT/int4_gemv_stages.log" 2>/dev/null
# nano-vllm's workload with the bf16 KV cache and the decode kernel 5 stages deep: against the targets
# phase's bf16 run (the first call's `kv_auto`), whether the default changes for both caches, and the FP8
# KV target's ratio then (against `kv_fp8_staged`)
kv_run kv_auto_staged auto GAPLESS_DECODE_STAGES=5
# Qwen3-8B's FP8 with programmatic dependent launch (`gapless.pdl`: each Triton kernel launched while the
# one before it runs; 132 us of a token idle between kernels in an H200's FP8 run), against the targets
# phase's FP8 run (the targets phase times the 0.6B's, where launches weigh most)
GAPLESS_PDL=1 tpot 45 qwen3-8b fp8_pdl --engine-option quantization=fp8
# (the FP8 GEMVs' stages, as above)
other 40 fp8_gemv_stages "$PY" bench/experiments/fp8_gemm.py --gemv-stages
grep -E '^\|' "$OUT/fp8_gemv_stages.log" 2>/dev/null | tee -a "$LOG"

# the mixture Qwen3-30B-A3B's shape in bf16 (~61 GB; 7.0 ms a token on an H200 before its sort by expert
# became one kernel at decode sizes, `moe_triton._align_kernel`: ~25 launches fewer a layer, 48 layers)
tpot 70 qwen3-30b-a3b bf16
# each alone: FP8 on both models' layers at 1 and 16 rows against the default path, BN 64 and 128, K split
# to 256 and 512 programs (`fp8_gemm.py --swapped`); int4 on Llama-3-8B's layers against the 16-row tiles
# and tinygemm at 1 and 16 rows, plain loads and 4 stages (the swapped tiles' default, untimed)
other 40 fp8_swapped "$PY" bench/experiments/fp8_gemm.py --swapped
grep -E '^\|' "$OUT/fp8_swapped.log" 2>/dev/null | tee -a "$LOG"
other 45 int4_swapped "$PY" -m gapless.bench.int4_gemm --device cuda --m 1 16 --block-m 16 --swapped 0 1 \
  --nibble-dots 0 --ptx-values 1 --stages 1 4 --kernels triton tinygemm --json "$OUT/int4_swapped.json"
tee -a "$LOG" <"$OUT/int4_swapped.log" 2>/dev/null

# the mixture's experts in fp8 (W8A8 in the fused grouped GEMM) and in int4 (no GPU has run these yet)
tpot 60 qwen3-30b-a3b fp8 --engine-option quantization=fp8
tpot 70 qwen3-30b-a3b-awq int4  # (the experts in the fused grouped GEMM's int4 path, whatever the kernel)

# the FP8 GEMM's decode tiles and ways of rounding x at one row (16x64 at ~512 programs, x rounded by a
# launch: the default for gate/up and down, at 3.3 and 2.9 TB/s where bf16's cuBLAS reads 4.1 and 3.7),
# that tile also unsplit and at 256 programs over 3, 4 and 6 stages, and the GEMV's tiles, x by a launch,
# in its registers or in fp16; at 32 and 128 rows the tiles (64x64 split, the default to 128 rows), the K
# split and x rounded in the loop or by a launch first; first, Qwen3-0.6B's layers through the GEMV at one
# row, K split to 0-512 programs
other 110 fp8_sweep "$PY" bench/experiments/fp8_gemm.py --sweep --rows 1 32 128
grep -E '^\|' "$OUT/fp8_sweep.log" 2>/dev/null | tee -a "$LOG"

# decode attention at batch 1 over the short contexts of a chat's first tokens (and of the TPOT runs above:
# 8.2 us a layer on an H200 at ~190 keys, split in 3, merged by the last split), each split at least 64
# keys (the default), 256 or 1,024 (one split up to there), each also prefetched (`DecodeTuning.prefetch`:
# the next block's keys and values in registers during this one's compute; at batch 1 a program's loads'
# latency is most of what it waits on, and 2 programs an SM leave registers to spare)
other 40 attention_b1 "$PY" -m gapless.bench.kernels --device cuda --batch 1 --context 128 256 512 1024 \
  --page-size 1 --decode-min-split-len 0 256 1024 --decode-prefetch 0 1 --tokens 16 --extend-tokens 2048 \
  --sample-batch 1 --json "$OUT/attention_b1.json"
awk '/^decode attention/,/^$/' "$OUT/attention_b1.log" 2>/dev/null | tee -a "$LOG"

# the int4/int8 weight-only GEMM against bf16's on Llama-3-8B's layers, from a decode's 1 and 16 rows to a
# prefill's 256 and 2048 (`auto` runs tinygemm's copy up to int4_kernels.TINYGEMM_ROWS rows, the Triton
# GEMM's above: this checks where they cross); at one row also the Triton GEMV (`--block-m 1`: the CUDA
# cores, x as a vector; 503 instructions a loop body in the sm_90 binary where it was 1,916 when an H200
# timed it at 2.9-4.4x bf16's time), and the dots' values dequantized by PTX (`--ptx-values`: 338
# instructions a loop body at one row against 530; the same bits)
# (gemlite's kernels are left to their TPOT run below: their first call tunes for longer than this step's
# limit, and with them in its list the table printed no row in 60 s on an H200)
other 60 int4_gemm "$PY" -m gapless.bench.int4_gemm --device cuda --m 1 16 256 2048 --block-m 0 1 \
  --ptx-values 0 1 --kernels triton tinygemm --json "$OUT/int4_gemm.json"
tee -a "$LOG" <"$OUT/int4_gemm.log" 2>/dev/null

say ""
# act-order (GPTQ desc_act): the default GEMMs, x's columns in each layer's order, written so by the fused
# norm before q/k/v and gate/up, gathered for o alone (`index_select`, one a layer), down's order on
# gate/up's rows (never timed; against the AWQ twin's TPOT in the targets phase); then the mixture's, its
# experts' gate/up gathering x's columns in each expert's order in the grouped GEMM (never run on a GPU;
# against its AWQ twin's above)
tpot 50 qwen3-8b-gptq-act int4_act_order
tpot 60 qwen3-30b-a3b-gptq-act int4_act_order

# the FP8 GEMM alone against bf16 and torch's on both models' shapes, x rounded in the loop, by a launch, by
# each program
other 45 fp8_gemm "$PY" bench/experiments/fp8_gemm.py --rows 1 128
grep -E '^\|' "$OUT/fp8_gemm.log" 2>/dev/null | tee -a "$LOG"

# Qwen3-8B's FP8 with x rounded by the layers' own launches, as before the fused norm and SiLU·mul rounded
# it (`GAPLESS_FP8_UNFUSED_ROUNDING`), against the targets phase's FP8 run
GAPLESS_FP8_UNFUSED_ROUNDING=1 tpot 45 qwen3-8b fp8_unfused --engine-option quantization=fp8

# int4 through gemlite's kernels (its wheel; its first call tunes for up to a minute, so last; on an H100
# 0.59x bf16's TPOT against tinygemm's 0.50x: bench/results/h100-2026-11-26/quant)
say ""
GAPLESS_INT4_KERNEL=gemlite tpot 70 qwen3-8b-awq int4_gemlite

# a GGUF file on the GPU (its projections on the int4/int8 path: Q4_K in groups of 32 on tinygemm at decode,
# Q6_K and fused q/k/v with a Q6_K v as 8 bits in groups of 16 on the Triton GEMV; never timed): Qwen3-8B's
# shape as llama.cpp's Q4_K_M mix of random Q4_K and Q6_K blocks (~4.8 GB written first, then read as a
# file, its blocks decoded on the GPU), against the targets phase's bf16 and AWQ runs; first the rate each
# type's blocks decode at on the GPU (a 4096 x 4096 matrix; on this 2-core host 510-1,020 M weights/s)
say ""
other 20 gguf_decode "$PY" bench/experiments/gguf_decode.py --device cuda
grep "M weights/s" "$OUT/gguf_decode.log" 2>/dev/null | tee -a "$LOG"
other 45 gguf_write "$PY" -m gapless.bench.quant gguf "$SHAPES/qwen3-8b"
tpot 120 qwen3-8b-gguf gguf --engine-option load_format=auto
fi

say ""
"$PY" -m gapless.bench.quant report "${runs[@]}" 2>&1 | tee -a "$LOG"
say "gpu_quant: $(( SECONDS - T0 )) s"
