"""Peak host memory (RSS) of loading a model on the CPU, one load a process, for the quantized loads
`gapless.model.layers.deferred_weights` and `gapless.model.int4_loading` change.

    PYTHONPATH=. python bench/experiments/load_memory.py make DIR     # DIR/float, DIR/q/awq, DIR/moe-awq,
                                                                      # DIR/m.Q4_0.gguf
    PYTHONPATH=. python bench/experiments/load_memory.py measure CKPT {file|dummy|gguf-int4} [QUANTIZATION]

`make` writes a random float32 Qwen3 of 8 layers (hidden 1024, MLP 3072, 16 heads of 128, 32,000 tokens),
its AWQ int4 g128 twin and its Q4_0 GGUF, and a Qwen3 mixture (4 layers, 64 experts of 256) whose config
names AWQ int4 g128, for random weights in that form. `measure` prints the process's peak RSS after
`load_model` (float32, CPU) of CKPT's weights (`file`), random ones in its form (`dummy`, `--load-format
dummy`) or a GGUF file's projections on the int4/int8 path, as a GPU reads them (`gguf-int4`,
`gapless.model.quant.gguf_int4`), with QUANTIZATION as `--quantization`, and the bytes the model holds
(`weights_held`). On a CPU a float
weight never written takes no memory (its pages are not touched), so what a GPU load saves shows here
only where the old load wrote float weights (random ones, or an online FP8 load's); the allocator's own
pattern moves the rest by ~100 MB (glibc's dynamic mmap threshold: `MALLOC_MMAP_THRESHOLD_` fixed takes
it out).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def make(d: Path) -> None:
    from gapless.testing.checkpoints import make_checkpoint
    from gapless.testing.quant_checkpoints import write_quantized

    shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16)
    shape |= dict(num_key_value_heads=8, head_dim=128, vocab_size=32000)
    src = make_checkpoint(d / "float", "qwen3", **shape)
    print(src, write_quantized(src, d / "q", "awq", bits=4, group=128)[0])
    moe = dict(shape, intermediate_size=256, moe_intermediate_size=256, num_experts=64, num_hidden_layers=4)
    make_checkpoint(d / "moe-awq", "qwen3_moe", **moe, num_experts_per_tok=4)
    cfg = json.loads((d / "moe-awq" / "config.json").read_text())
    cfg["quantization_config"] = dict(
        quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"
    )
    (d / "moe-awq" / "config.json").write_text(json.dumps(cfg))
    from gapless.testing.gguf_files import write_gguf

    print(write_gguf(src, d / "m.Q4_0.gguf", "Q4_0"))


def measure(path: str, mode: str, quantization: str | None) -> None:
    import torch

    from gapless.model import loader
    from gapless.model.loader import load_model
    from gapless.model.quant import weights_held

    if mode == "gguf-int4":  # (the GPU's path, on the CPU)
        loader.gguf_kept = lambda p, device: "int4"  # type: ignore[assignment]

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    model = load_model(
        path, torch.float32, torch.device("cpu"), quantization=quantization, dummy=mode == "dummy"
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (KiB on Linux)
    print(
        f"{Path(path).name} {mode} {quantization or ''}: peak RSS {peak / 1024:.0f} MiB (before the load "
        f"{before / 1024:.0f}), load {time.time() - t:.1f} s, held {weights_held(model)[1] / 2**20:.1f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        make(Path(sys.argv[2]))
    else:
        measure(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
