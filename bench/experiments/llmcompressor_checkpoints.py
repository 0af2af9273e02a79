"""Checkpoints llm-compressor itself writes, read by gapless: a tiny llama (hidden 256, so groups of 128
fit) quantized by llm-compressor's presets (`QuantizationModifier`, no calibration data: round to nearest),
saved compressed; beside each, a float checkpoint whose projections are compressed-tensors' own
`fake_quantize` of the quantized model's weights, the weights the compressed file must give back.

llm-compressor pins its own transformers (5.17 for 0.14), so the writing runs in a venv of its own, the
reading in the project's:

    python -m venv /tmp/lcv && /tmp/lcv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    PYTHONPATH=. .venv/bin/python bench/experiments/llmcompressor_checkpoints.py source /tmp/lcw/src
    /tmp/lcv/bin/python bench/experiments/llmcompressor_checkpoints.py write /tmp/lcw/src /tmp/lcw/out \
        W4A16 W4A16_ASYM W8A16 W8A8 FP8_DYNAMIC FP8_BLOCK NVFP4A16
    PYTHONPATH=. .venv/bin/python bench/experiments/llmcompressor_checkpoints.py read /tmp/lcw/out \
        W4A16 W4A16_ASYM W8A16 W8A8 FP8_DYNAMIC FP8_BLOCK NVFP4A16

`read` loads each on the CPU's reference path (float32, `GAPLESS_INT4_KERNEL=triton`) and prints the
largest difference between each quantized projection's weight as gapless holds it and the reference's
(0: bit for bit), then gapless's greedy tokens against transformers' on the reference (the FP8 rows round
their activations, as the format does, so they may part at a near-tie).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def source(dst: Path) -> None:
    from gapless.testing.checkpoints import make_checkpoint

    print(
        make_checkpoint(dst, "llama", hidden_size=256, intermediate_size=256, head_dim=64, rope_scaling=None)
    )


def write(src: Path, out: Path, schemes: list[str]) -> None:
    import compressed_tensors
    import llmcompressor
    import transformers
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"llmcompressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}, "
        f"transformers {transformers.__version__}"
    )
    for scheme in schemes:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        held = {}
        for name, m in model.named_modules():
            weights = getattr(getattr(m, "quantization_scheme", None), "weights", None)
            if weights is None:
                continue
            kw = dict(scale=m.weight_scale, zero_point=getattr(m, "weight_zero_point", None), args=weights)
            if hasattr(m, "weight_global_scale"):
                kw["global_scale"] = m.weight_global_scale
            held[f"{name}.weight"] = fake_quantize(m.weight.detach(), **kw).float()
        qdir, rdir = out / scheme, out / f"{scheme}-reference"
        model.save_pretrained(str(qdir), save_compressed=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(qdir))
        shutil.copytree(src, rdir, dirs_exist_ok=True)
        tensors = load_file(str(src / "model.safetensors")) | held
        save_file(tensors, str(rdir / "model.safetensors"), metadata={"format": "pt"})
        fmt = json.loads((qdir / "config.json").read_text())["quantization_config"].get("format")
        print(f"{scheme}: {fmt}, {len(held)} projections")


def _held(m: torch.nn.Module) -> torch.Tensor | None:
    """A loaded layer's weight as gapless holds it, float32 (int4/int8/NVFP4: dequantized; FP8: e4m3 times
    its scale, per tensor, row or block)."""
    method = getattr(m, "linear_method", None)
    if callable(getattr(method, "dequantized", None)):
        return method.dequantized(torch.float32)
    if not hasattr(m, "weight_scale"):
        return None
    w, s = m.weight.float(), m.weight_scale.float()
    if s.numel() > 1:
        s = s.reshape(s.shape[0], -1)
        s = s.repeat_interleave(w.shape[0] // s.shape[0], 0)
        s = s.repeat_interleave(-(-w.shape[1] // s.shape[1]), 1)[:, : w.shape[1]]
    return w * s


def read(out: Path, schemes: list[str]) -> None:
    os.environ["GAPLESS_INT4_KERNEL"] = "triton"  # (the reference path: float32, exact)
    from transformers import AutoModelForCausalLM

    from gapless import LLM, SamplingParams
    from gapless.model import loader
    from gapless.model.quant import weights_held
    from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts

    prompts = make_prompts(1000, n=4, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for scheme in schemes:
        qdir, rdir = out / scheme, out / f"{scheme}-reference"
        model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
        reference = load_file(str(rdir / "model.safetensors"))
        worst, count = 0.0, 0
        for name, m in model.named_modules():
            w = _held(m)
            if w is None:
                continue
            offsets = getattr(m, "checkpoint_offsets", None) or {None: (0, w.shape[0])}
            for shard, (at, rows) in offsets.items():
                fused = name.rsplit(".", 1)[1]
                key = f"{name if shard is None else name.replace(fused, f'{shard}_proj')}.weight"
                worst = max(worst, (w[at : at + rows] - reference[key].float()).abs().max().item())
                count += 1
        print(
            f"{scheme}: {weights_held(model)[0]}; {count} projections, max |gapless - reference| {worst:.3g}"
        )
        with LLM(str(qdir), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
            ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        hf = AutoModelForCausalLM.from_pretrained(str(rdir), dtype=torch.float32).eval()
        notes = [check_greedy(o, hf_greedy(hf, p, 8), tol=1.0) for o, p in zip(ours, prompts)]
        print(f"{scheme}: greedy against transformers on the reference:", [n or "same" for n in notes])


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "source":
        source(Path(args[0]))
    elif command == "write":
        write(Path(args[0]), Path(args[1]), args[2:])
    else:
        read(Path(args[0]), args[1:])
