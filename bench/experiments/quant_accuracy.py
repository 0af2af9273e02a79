"""What the GPU's quantized formats (issue 36) cost in accuracy, on a real model, measured on the CPU: the
default model (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized to a float32 checkpoint by transformers)
against itself quantized in each format gapless serves, and with an FP8 KV cache.

    PYTHONPATH=. .venv/bin/python bench/experiments/quant_accuracy.py [--work DIR] [--only WORDS ...]

Each row is one engine on the CPU (float32 activations), scored as `gguf_quality.py` scores a GGUF type:
perplexity of its fixed text, and greedy agreement over 64 new tokens of its 8 prompts against the float32
model (the first divergence per prompt, and the float model's top-2 logit gap there: small is a near-tie).
The CPU runs each format's reference path: FP8 W8A8 rounds the activations as the CUDA kernel does and
multiplies by the dequantized weight; int4/int8 run the dequantized weights (their rounding is the
checkpoint's own, here round-to-nearest by `gapless.testing.quant_checkpoints`, not GPTQ's or AWQ's
calibrated one, so it is the worst case of each layout); NVFP4 (`gapless.testing.nvfp4_checkpoints`,
weight-only as on Hopper) and bitsandbytes (`gapless.testing.bnb_checkpoints`: 4-bit codes the nearest
level of each block of 64, double-quantized scales; 8-bit per row) likewise, on the engine's CPU default
(bitsandbytes' fused 4-bit kernel where it runs); and the int rows torch's CPU kernels take (4 or 8 bits
in groups of 32-256 or per row) again on those kernels, the engine's default on the CPU, which round the
activations, scales and zeros to bfloat16 (`GAPLESS_INT4_KERNEL=auto` against `triton`). The FP8 KV
caches store e4m3 (or e5m2) keys and values with scales 1.0 (the checkpoint has none).
lm-evaluation-harness's tasks need their datasets, which this machine cannot download: the perplexity
stands in for them. `--only`
runs the rows whose label holds any of its words (the float32 reference always).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from gguf_quality import PROMPTS, TEXT, run  # (the script beside this one)
from safetensors.torch import save_file

from gapless.default_model.smollm2 import smollm2_path
from gapless.model.quant.int4_kernels import cpu_runs
from gapless.testing.bnb_checkpoints import write_bnb
from gapless.testing.fp8_checkpoints import write_fp8_checkpoint
from gapless.testing.nvfp4_checkpoints import write_nvfp4
from gapless.testing.quant_checkpoints import write_quantized


def float_checkpoint(dst: Path) -> Path:
    """The default model's GGUF dequantized by transformers, written as a float32 safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    tensors = {
        k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # (transformers' record of the GGUF it read)
    cfg |= {"torch_dtype": "float32", "architectures": ["LlamaForCausalLM"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(dst))
    return dst


def formats(work: Path) -> dict[str, tuple[Path, dict[str, object]]]:
    """Each row's label -> (its checkpoint, written under `work`, and its engine options, among them
    `GAPLESS_INT4_KERNEL` as "int4_kernel", and other variables as "env"); float32 first."""
    base = float_checkpoint(work / "float32")
    rows: dict[str, tuple[Path, dict[str, object]]] = {
        "float32": (base, {}),
        "fp8 per-channel (--quantization fp8)": (base, {"quantization": "fp8"}),
        "fp8 KV cache (float32 weights)": (base, {"kv_cache_dtype": "fp8"}),
        "fp8_e5m2 KV cache (float32 weights)": (base, {"kv_cache_dtype": "fp8_e5m2"}),
        # the "FP8 KV against bf16 KV": both in bfloat16, the KV cache the one difference
        "bfloat16 weights and KV cache": (base, {"dtype": "bfloat16"}),
        "fp8 KV cache (bfloat16 weights)": (base, {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}),
    }
    for layout, label in (("fp8", "fp8 block 128x128"), ("ct-tensor", "compressed-tensors fp8 per-tensor")):
        rows[label] = (write_fp8_checkpoint(base, work / layout, layout)[0], {})
    ints = (("gptq", 4, 64, True), ("awq", 4, 64, False), ("gptq", 8, 64, True), ("gptq", 8, -1, True))
    for layout, bits, group, sym in ints:
        out = work / f"{layout}{bits}g{group}"
        out = write_quantized(base, out, layout, bits=bits, group=group, sym=sym)[0]
        label = f"{layout} int{bits} {'channel' if group < 0 else f'g{group}'} ({'sym' if sym else 'asym'})"
        rows[f"{label}, reference path"] = (out, {"int4_kernel": "triton"})
        if cpu_runs(bits, group if group > 0 else 576, 576):  # (the model's hidden size)
            rows[f"{label}, torch's CPU kernels"] = (out, {"int4_kernel": "auto"})
    for kind in ("nf4", "fp4", "int8"):  # (4-bit: blocks of 64, their absmax double-quantized)
        rows[f"bitsandbytes {kind}"] = (write_bnb(base, work, kind)[0], {})
    rows["bitsandbytes nf4 at load (--quantization bitsandbytes)"] = (base, {"quantization": "bitsandbytes"})
    for bits, group in ((8, 64), (4, 64)):  # (the model's 576 inputs: no whole groups of vLLM's default 128)
        rtn = {"quantization": "rtn", "env": {"RTN_NUM_BITS": str(bits), "RTN_GROUP_SIZE": str(group)}}
        rows[f"rtn int{bits} g{group} at load (--quantization rtn), reference path"] = (
            base,
            {**rtn, "int4_kernel": "triton"},
        )
        rows[f"rtn int{bits} g{group} at load (--quantization rtn), torch's CPU kernels"] = (base, rtn)
    rows["nvfp4 (ModelOpt: e2m1 codes, e4m3 scales g16)"] = (write_nvfp4(base, work, "modelopt")[0], {})
    mxfp4 = write_nvfp4(base, work, "mxfp4")[0]
    rows["mxfp4 (compressed-tensors: e2m1 codes, e8m0 scales g32)"] = (mxfp4, {})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python bench/experiments/quant_accuracy.py")
    p.add_argument("--work", help="where the checkpoints are written (default: a temporary directory)")
    p.add_argument("--only", nargs="+", help="the rows whose label holds any of these (default: all)")
    args = p.parse_args()
    rows = formats(Path(args.work or tempfile.mkdtemp(prefix="quant_accuracy-")))
    if args.only:
        rows = {k: v for k, v in rows.items() if k == "float32" or any(w in k for w in args.only)}
    base = rows["float32"][0]
    print(f"the default model's Q4_1 GGUF dequantized to float32 ({base}); the fixed text: {len(TEXT)} chars")
    ref_ppl, ref_tokens, ref_top, _ = run(str(base))
    for label, (path, options) in rows.items():
        options = dict(options)
        os.environ["GAPLESS_INT4_KERNEL"] = str(options.pop("int4_kernel", "auto"))
        os.environ.update(options.pop("env", {}))  # type: ignore[arg-type]
        ppl, tokens = (ref_ppl, ref_tokens) if label == "float32" else run(str(path), **options)[:2]
        first = [
            next((i for i, (a, b) in enumerate(zip(q, f)) if a != b), None)
            for q, f in zip(tokens, ref_tokens)
        ]
        gaps = [None if i is None else round(t[i][0][1] - t[i][1][1], 3) for i, t in zip(first, ref_top)]
        print(
            f"{label}: perplexity {ppl:.4f} ({(ppl / ref_ppl - 1) * 100:+.2f}%), greedy identical "
            f"{first.count(None)}/{len(PROMPTS)}, first divergence {first}, float's top-2 gap there {gaps}",
            flush=True,
        )


if __name__ == "__main__":
    main()
