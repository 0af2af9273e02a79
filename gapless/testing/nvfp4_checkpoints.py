"""Tiny FP4 checkpoints for tests: a float checkpoint's decoder projections quantized to FP4 (e2m1) codes,
written as NVFP4 (groups of 16, float8_e4m3 group scales and a per-tensor float32 scale) in ModelOpt's
(`weight`, `weight_scale`, `weight_scale_2`; its `hf_quant_config.json`) or compressed-tensors'
`nvfp4-pack-quantized` (`weight_packed`, `weight_scale`, `weight_global_scale`) layout, or as
compressed-tensors' MXFP4 (`mxfp4-pack-quantized`: groups of 32, e8m0 power-of-two scales, `weight_packed`
and `weight_scale`) (`gapless.model.quant.int4_layouts` describes them), beside a float checkpoint holding
the same weights dequantized (the reference a quantized model must equal). The quantizer is a plain
nearest-value rounding, its NVFP4 scales chosen as ModelOpt's and llm-compressor's are (the tensor's
absolute maximum over 6 x 448, each group's over 6), its MXFP4 ones as the OCP MX format's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gapless.model.quant.int4_layouts import FP4_E2M1, MXFP4_GROUP, NVFP4_GROUP
from gapless.testing.quant_checkpoints import write_pair

LAYOUTS = ("modelopt", "compressed-tensors", "mxfp4")  # (mxfp4: compressed-tensors' MXFP4)
_E4M3_MAX, _E2M1_MAX = 448.0, 6.0


def quantized(w: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`w` [N, K]'s tensors in `layout` (by the suffix after the module's name) and the float32 weight
    they hold, computed as the loader reads them (the group scale in float32, times the code's value)."""
    n, k = w.shape
    table = torch.tensor(FP4_E2M1)
    if layout == "mxfp4":
        return _mxfp4(w, table)
    per_tensor = (w.float().abs().amax() / (_E2M1_MAX * _E4M3_MAX)).clamp_min(1e-12)  # ModelOpt's scale_2
    groups = w.float().view(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block = (groups.abs().amax(-1) / _E2M1_MAX / per_tensor).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    if layout == "modelopt":
        scale = block.float() * per_tensor
        whole = {"weight_scale_2": per_tensor.reshape(()), "input_scale": torch.tensor(1.0)}
    else:
        global_scale = (1.0 / per_tensor).reshape(1)
        scale = block.float() / global_scale
        whole = {"weight_global_scale": global_scale, "input_global_scale": torch.ones(1)}
    normalized = groups / scale.clamp_min(1e-30)[..., None]
    codes = (normalized.unsqueeze(-1) - table).abs().argmin(-1).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    reference = (table[codes.long()].view(n, -1, NVFP4_GROUP) * scale[..., None]).view(n, k)
    name = "weight" if layout == "modelopt" else "weight_packed"
    return {name: packed, "weight_scale": block, **whole}, reference


def _mxfp4(w: torch.Tensor, table: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`quantized` for MXFP4: each group of 32's scale a power of two, 2^(floor(log2 amax) - 2) (e2m1's
    largest exponent is 2, as the OCP MX format has it), stored as its biased exponent (e8m0)."""
    n, k = w.shape
    groups = w.float().view(n, k // MXFP4_GROUP, MXFP4_GROUP)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2**-100))) - 2
    biased = (exponent + 127).clamp(0, 254)
    scale = torch.exp2(biased - 127)
    codes = (
        (groups / scale[..., None]).unsqueeze(-1).sub(table).abs().argmin(-1).reshape(n, k).to(torch.uint8)
    )
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    reference = (table[codes.long()].view(n, -1, MXFP4_GROUP) * scale[..., None]).view(n, k)
    return {"weight_packed": packed, "weight_scale": biased.to(torch.uint8)}, reference


def quantization_config(layout: str) -> dict[str, object]:
    """The config a checkpoint of `layout` declares: ModelOpt's `hf_quant_config.json`'s `quantization`,
    or compressed-tensors' `quantization_config` (weights and activations NVFP4, the LM head left)."""
    if layout == "modelopt":
        return {"quant_algo": "NVFP4", "group_size": NVFP4_GROUP, "exclude_modules": ["lm_head"]}
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP}
    if layout == "mxfp4":  # (weights only: MXFP4A16)
        weights = {**fp4, "strategy": "group", "group_size": MXFP4_GROUP, "scale_dtype": "torch.uint8"}
        group = {"targets": ["Linear"], "weights": {**weights, "symmetric": True, "dynamic": False}}
        return {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": group},
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp4, "symmetric": True, "dynamic": False},
                "input_activations": {**fp4, "symmetric": True, "dynamic": "local"},
            }
        },
    }


def write_nvfp4(src: Path, dst: Path, layout: str) -> tuple[Path, Path]:
    """(the FP4 checkpoint, its float32 reference) written under `dst` from the one-file float
    checkpoint `src`: every decoder projection (each expert's too) quantized, the rest kept in float."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    qdir, refdir = dst / f"nvfp4-{layout}", dst / f"nvfp4-{layout}-reference"

    def by_name(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, held = quantized(t, layout)
        return {f"{name.removesuffix('.weight')}.{suffix}": v for suffix, v in tensors.items()}, held

    write_pair(src, qdir, refdir, by_name)
    if layout == "modelopt":
        record = {"producer": {"name": "modelopt"}, "quantization": quantization_config(layout)}
        (qdir / "hf_quant_config.json").write_text(json.dumps(record, indent=2))
    else:
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(layout)
        (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, refdir
