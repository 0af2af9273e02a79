#!/usr/bin/env bash
# Decode throughput of gapless and llama.cpp on the same GGUF files, without a server: gapless's offline
# decode step (bench/experiments/cpu_step.py: B prompts of 34 random token ids, greedy, ms per step over
# 32 steps after the prefill) against llama.cpp's `llama-batched-bench` (-npp 34 -ntg 64 -npl B: its S_TG,
# the generation tokens/s of B sequences after their prefill), alternately (for each file and B: gapless,
# then llama.cpp), both with THREADS threads. A quicker companion of bench/llamacpp_cpu.sh (the served
# comparison), for when llama-server is not built: it needs only llama-batched-bench.
#
#   bench/llamacpp_step.sh LLAMA_BATCHED_BENCH FILE.gguf [FILE.gguf ...]
# Environment: BATCH (default "1 8 32"), THREADS (default the core count), OUT (default
# bench/results/llamacpp_step), PY. Writes gapless_<FILE>_bB.log, llama.cpp_<FILE>_bB.log and table.md.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,11p "$0"; exit 2; }
BB=$(realpath "$1"); shift
files=(); for f in "$@"; do files+=("$(realpath "$f")"); done
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/llamacpp_step}
THREADS=${THREADS:-$(nproc)}
mkdir -p "$OUT"
echo "$(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores, $THREADS threads; commit $(git rev-parse --short HEAD)" | tee "$OUT/machine.txt"
for gguf in "${files[@]}"; do
  fmt=$(basename "$gguf" .gguf | grep -o '[^.]*$')
  for b in ${BATCH:-1 8 32}; do
    echo "$(date -u +%T) $fmt B=$b load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/machine.txt"
    PYTHONPATH=. "$PY" bench/experiments/cpu_step.py --model "$gguf" --batch "$b" --steps 32 --repeat 2 \
      --threads "$THREADS" 2>&1 | grep -v "^USDT\|Warning\|loading weights" | tee "$OUT/gapless_${fmt}_b$b.log"
    "$BB" -m "$gguf" -c 4096 -npp 34 -ntg 64 -npl "$b" -t "$THREADS" >"$OUT/llama.cpp_${fmt}_b$b.log" 2>&1
    grep "^|" "$OUT/llama.cpp_${fmt}_b$b.log" | tail -1
  done
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/table.md"
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("gapless_*_b*.log")):
    fmt, b = re.match(r"gapless_(.+)_b(\d+)\.log", f.name).groups()
    g = re.search(r"\(([\d.]+) tok/s\)", f.read_text())
    table = [ln for ln in (out / f"llama.cpp_{fmt}_b{b}.log").read_text().splitlines() if ln.startswith("|")]
    cells = [c.strip() for c in table[-1].strip("|").split("|")] if len(table) > 2 else []
    ll = float(cells[7]) if len(cells) > 7 else None  # S_TG t/s
    rows.setdefault(fmt, {})[int(b)] = (float(g[1]) if g else None, ll)
bs = sorted({b for r in rows.values() for b in r})
print("| file: gapless vs llama.cpp, decode tok/s | " + " | ".join(f"{b} sequences" for b in bs) + " |")
print("|---|" + "---:|" * len(bs))
for fmt, r in rows.items():
    cells = []
    for b in bs:
        g, ll = r.get(b, (None, None))
        cells.append("-" if not g or not ll else f"{g:.1f} vs {ll:.1f} = {g / ll:.2f}x")
    print(f"| {fmt} | " + " | ".join(cells) + " |")
PY
