"""The CPU torch LoRA path before (one GEMM pair per adapter) and after (two batched GEMMs over the batch's
adapters), alternating in one run on one engine: `gapless.bench.lora`'s workload, each round running the
base model and 16 adapters under the old path, then the same under the new one. The old path is the
module as it was at commit 4e4789d (`git show 4e4789d:gapless/lora/ops.py > /tmp/old_ops.py`), swapped in
where `gapless.lora.table` calls it. Ratios only: the machine is shared.

    PYTHONPATH=. python bench/results/lora_cpu/before_after.py /tmp/old_ops.py --rounds 6
"""

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

import gapless.lora.ops as new_ops
import gapless.lora.table as table
from gapless import LLM, SamplingParams
from gapless.bench import cli
from gapless.bench.lora import make_adapters

p = argparse.ArgumentParser()
p.add_argument("old_ops")
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--tokens", type=int, default=16)
args = p.parse_args()
spec = importlib.util.spec_from_file_location("old_ops", args.old_ops)
old_ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_ops)
# the old function has no `blocks` argument (each fused layer's B apart): it expands the whole B
impls = {
    "old": (lambda y, x, a, b, seg, blocks=None: old_ops.add_lora_torch(y, x, a, b, seg), old_ops.segments),
    "new": (new_ops.add_lora_torch, new_ops.segments),
}
torch.set_num_threads(1)
margs = argparse.ArgumentParser()
cli.add_model_args(margs, "bench", ("tiny", "bench", "qwen3-0.6b"))
path, _ = cli.model_path(margs.parse_args([]), "float32")
print(" ".join(["python", *sys.argv]))
print(cli.machine_line(cli.machine("cpu")))
with tempfile.TemporaryDirectory() as tmp:
    loras = make_adapters(path, Path(tmp), 16, 16)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_running_requests=16,
        max_loras=16,
        max_lora_rank=16,
        cpu_worker="inline",
        overlap=False,
        device_threads=1,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, llm.engine.vocab_size, (args.tokens,), generator=g).tolist() for _ in range(16)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    modes = {
        "base": [None] * 16,
        "1 adapter": [loras[0]] * 16,
        "4 adapters": [loras[i % 4] for i in range(16)],
        "16 adapters": [loras[i] for i in range(16)],
    }
    totals = {(impl, m): [0, 0.0] for impl in impls for m in modes}
    outs = {}
    for r in range(args.rounds + 1):  # round 0: warm-up, not counted
        for impl, (add, segments) in impls.items():
            table.add_lora_torch, table.segments = add, segments
            for m, mode in modes.items():
                t = time.perf_counter()
                o = llm.generate(prompts, params, use_tqdm=False, lora_request=mode)
                dt = time.perf_counter() - t
                outs.setdefault(m, {})[impl] = [x.token_ids for x in o]
                if r:
                    totals[(impl, m)][0] += sum(len(x.token_ids) for x in o)
                    totals[(impl, m)][1] += dt
        assert all(v["old"] == v["new"] for v in outs.values()), "old and new paths differ"
        if r:
            rates = (f"{i} {m} {totals[(i, m)][0] / totals[(i, m)][1]:.1f}" for i, m in totals)
            print(f"round {r}: " + ", ".join(rates))
    llm.shutdown()
print(
    f"batch 16 x {args.tokens} prompt tokens, {args.tokens} output tokens each, rank 16 on q/k/v/o and "
    f"gate/up/down, bench-size random qwen3, float32, inline, no overlap, 1 thread, {args.rounds} rounds"
)
print("| rows run | old tok/s | old vs base | new tok/s | new vs base |")
print("|---|---:|---:|---:|---:|")
for m in modes:
    o, n = (totals[(i, m)][0] / totals[(i, m)][1] for i in ("old", "new"))
    ob, nb = (totals[(i, "base")][0] / totals[(i, "base")][1] for i in ("old", "new"))
    print(f"| {m} | {o:.1f} | {o / ob:.2f}x | {n:.1f} | {n / nb:.2f}x |")
