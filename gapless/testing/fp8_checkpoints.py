"""Tiny FP8 checkpoints for tests: a float checkpoint's decoder projections quantized to e4m3 in one of the
layouts gapless reads (`LAYOUTS`), written beside a float32 copy holding the same weights dequantized
(the reference the fp8 model is compared with)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gapless.model.quant.fp8 import FP8_MAX, quantize_blocks, quantize_rows

# layout -> (quantization_config maker, how weights are scaled); block sizes come from `block`
LAYOUTS = ("fp8", "ct-tensor", "ct-channel", "ct-block")
_PROJ = re.compile(r"model\.layers\.\d+\..*\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$")


def _ct_config(strategy: str, block: tuple[int, int] | None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    weights |= {"group_size": None, "block_structure": list(block) if block else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quant_config(layout: str, block: tuple[int, int]) -> dict:
    """The config.json `quantization_config` of `layout`."""
    if layout == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    strategy = layout.removeprefix("ct-")
    return _ct_config(strategy, block if strategy == "block" else None)


def _quantize(w: torch.Tensor, layout: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as the layout stores it)."""
    if layout in ("fp8", "ct-block"):
        return quantize_blocks(w, block)
    if layout == "ct-channel":
        return quantize_rows(w)
    scale = w.float().abs().max().clamp_min(1e-12) / FP8_MAX  # ct-tensor: one scale, shape [1]
    scale = scale.bfloat16().float()  # stored in bfloat16, as llm-compressor writes it for bf16 models
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(1)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, layout: str, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    if layout in ("fp8", "ct-block"):
        s = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    else:
        s = scale.reshape(-1, 1).expand(n, k)
    return q.float() * s.float()


def write_fp8_checkpoint(
    src: Path, dst: Path, layout: str, block: tuple[int, int] = (128, 128)
) -> tuple[Path, Path]:
    """`src`'s projections quantized in `layout` at `dst`, and (the second path) a float32 checkpoint of
    the same weights dequantized, at `dst` with a `-dequantized` suffix. Other tensors are copied as float."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown fp8 layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    ref = dst.with_name(dst.name + "-dequantized")
    for out in (dst, ref):
        shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    quantized: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    scale_name = "weight_scale_inv" if layout == "fp8" else "weight_scale"
    for file in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(file)).items():
            if not _PROJ.search(name):
                quantized[name] = w.contiguous()
                floats[name] = w.float().contiguous()
                continue
            q, scale = _quantize(w, layout, block)
            quantized[name] = q.contiguous()
            stored = scale.bfloat16() if layout == "ct-tensor" else scale.float()
            quantized[name[: -len("weight")] + scale_name] = stored.contiguous()
            floats[name] = _dequantized(q, stored, layout, block).contiguous()
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}, indent=2))
    cfg["quantization_config"] = quant_config(layout, block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref
