"""Tiny AMD Quark checkpoints for tests: a float checkpoint's decoder projections quantized in one of
Quark's schemes (`SCHEMES`, named as Quark's `LLMTemplate` names them) and written as Quark's
`export_safetensors` writes them (`gapless.model.quant.quark_configs` describes the layouts; the tensors'
names, dtypes and shapes and the config's keys are those of Quark 0.13's own exports), beside a float
checkpoint holding the same weights dequantized (the reference the quantized model must equal)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gapless.model.quant.fp8 import quantize_rows
from gapless.model.quant.int4_layouts import pack_int32
from gapless.testing.nvfp4_checkpoints import quantized as fp4_quantized
from gapless.testing.quant_checkpoints import awq_pack, quantize, write_pair

# `+kv`: with Quark's FP8 KV cache (the k/v projections' output scales); `@order`: `pack_method: order`
SCHEMES = (
    "fp8",
    "fp8+kv",
    "ptpc_fp8",
    "int8",
    "uint4_wo_32",
    "uint4_wo_32@order",
    "int4_wo_32",
    "uint4_wo_per_channel",
    "int4_wo_per_channel",
    "mxfp4",
)
KV_SCALE = 0.0625  # each layer's k/v output scale (+kv)


def tensor_config(
    dtype: str,
    qscheme: str,
    *,
    group_size: int | None = None,
    ch_axis: int | None = None,
    symmetric: bool | None = True,
    dynamic: bool = False,
    scale_format: str | None = None,
) -> dict[str, Any]:
    """One tensor's scheme as Quark writes it (every key Quark 0.13 writes)."""
    observer = {"per_tensor": "PerTensorMinMaxObserver", "per_channel": "PerChannelMinMaxObserver"}
    return {
        "block_size": None,
        "ch_axis": ch_axis,
        "dtype": dtype,
        "enable_buffer_reuse": False,
        "group_size": group_size,
        "is_dynamic": dynamic,
        "is_scale_quant": False,
        "max_input_numel": 4194304,
        "mx_element_dtype": None,
        "observer_cls": observer.get(qscheme, "PerGroupMinMaxObserver"),
        "qscheme": qscheme,
        "round_method": "half_even",
        "scale_calculation_mode": "even" if scale_format else None,
        "scale_format": scale_format,
        "scale_type": "float",
        "symmetric": symmetric,
        "zero_point_type": "int32",
    }


def _base(scheme: str) -> str:
    """A scheme's name without its `+kv` and `@order` (what its layers hold)."""
    return scheme.split("+")[0].split("@")[0]


def layer_config(scheme: str) -> dict[str, Any]:
    """`scheme`'s `global_quant_config`: its weight's and its activations' schemes."""
    fp8 = tensor_config("fp8_e4m3", "per_tensor")
    mx: dict[str, Any] = dict(group_size=32, ch_axis=-1, symmetric=None, scale_format="e8m0")
    weight, act = {
        "fp8": (fp8, fp8),
        "ptpc_fp8": (
            tensor_config("fp8_e4m3", "per_channel", ch_axis=0),
            tensor_config("fp8_e4m3", "per_channel", ch_axis=1, dynamic=True),
        ),
        "int8": (tensor_config("int8", "per_tensor"), tensor_config("int8", "per_tensor")),
        "uint4_wo_32": (
            tensor_config("uint4", "per_group", group_size=32, ch_axis=-1, symmetric=False),
            None,
        ),
        "int4_wo_32": (tensor_config("int4", "per_group", group_size=32, ch_axis=-1), None),
        "uint4_wo_per_channel": (tensor_config("uint4", "per_channel", ch_axis=0, symmetric=False), None),
        "int4_wo_per_channel": (tensor_config("int4", "per_channel", ch_axis=0), None),
        "mxfp4": (
            tensor_config("fp4", "per_group", **mx),
            tensor_config("fp4", "per_group", dynamic=True, **mx),
        ),
    }[_base(scheme)]
    return {
        "bias": None,
        "input_tensors": act,
        "output_tensors": None,
        "target_device": None,
        "weight": weight,
    }


def quantization_config(scheme: str) -> dict[str, Any]:
    """The config.json `quantization_config` Quark writes for `scheme`."""
    kv = scheme.endswith("+kv")
    global_config = layer_config(scheme)
    kv_layer = {**global_config, "output_tensors": tensor_config("fp8_e4m3", "per_tensor")}
    kv_layers = {"*k_proj": kv_layer, "*v_proj": kv_layer} if kv else {}
    return {
        "algo_config": None,
        "exclude": ["lm_head"],
        "export": {
            "kv_cache_group": ["*k_proj", "*v_proj"] if kv else [],
            "min_kv_scale": 0.0,
            "pack_method": "order" if scheme.endswith("@order") else "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
        "global_quant_config": global_config,
        "kv_cache_post_rope": False,
        "kv_cache_quant_config": kv_layers,
        "layer_quant_config": kv_layers,
        "layer_type_quant_config": {},
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "softmax_quant_spec": None,
        "version": "0.13",
    }


def _pack(columns: torch.Tensor, reorder: bool) -> torch.Tensor:
    """[R, C] nibbles -> [R, C / 8] int32s along C, interleaved as AWQ's (`reorder`) or in order."""
    return awq_pack(columns) if reorder else pack_int32(columns, 4, dim=1)


def quantized(w: torch.Tensor, scheme: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`w` [N, K]'s tensors in `scheme` (by the suffix after the module's name) and the float32 weight they
    hold."""
    name, w = _base(scheme), w.float()
    if name in ("fp8", "ptpc_fp8"):  # (per tensor: the weight's elements as one row)
        q, scale = quantize_rows(w if name == "ptpc_fp8" else w.reshape(1, -1))
        q = q.view(w.shape)
        stored = {"weight": q, "weight_scale": scale.reshape(-1) if name == "ptpc_fp8" else scale.reshape(())}
        if name == "fp8":  # (a calibrated activation scale, which gapless does not read)
            stored["input_scale"] = torch.tensor(0.02)
        return stored, q.float() * scale
    if name == "int8":
        scale = w.abs().amax().clamp_min(1e-12) / 127
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        zero = torch.zeros((), dtype=torch.int8)
        stored = {"weight": q, "weight_scale": scale.reshape(()), "weight_zero_point": zero}
        stored |= {"input_scale": torch.tensor(0.05), "input_zero_point": zero.clone()}
        return stored, q.float() * scale
    if name == "mxfp4":
        tensors, reference = fp4_quantized(w, "mxfp4")
        return {"weight": tensors["weight_packed"], "weight_scale": tensors["weight_scale"]}, reference
    channel, sym = name.endswith("per_channel"), name.startswith("int4")
    unpacked = quantize(w, 4, -1 if channel else 32, sym=sym)
    reorder = not scheme.endswith("@order")
    if sym:  # two's complement nibbles (unsigned - 8), the zero points stored 0
        values, zeros = unpacked.q ^ 8, torch.zeros_like(unpacked.zero, dtype=torch.int16)
    else:
        values, zeros = unpacked.q, unpacked.zero.to(torch.int16)
    if channel:  # [N, K / 8] along the inputs, a scale a row, the zero points [N / 8]
        stored = {
            "weight": _pack(values, reorder),
            "weight_scale": unpacked.scale.reshape(-1),
            "weight_zero_point": _pack(zeros.reshape(1, -1), reorder).reshape(-1),
        }
    else:  # AWQ's: [K, N / 8] along the outputs, scales and zero points [K / G, N (/ 8)]
        stored = {
            "weight": _pack(values.t(), reorder),
            "weight_scale": unpacked.scale.t().contiguous(),
            "weight_zero_point": _pack(zeros.t(), reorder),
        }
    return stored, unpacked.dequantize()


def write_quark(src: Path, dst: Path, scheme: str) -> tuple[Path, Path]:
    """(the Quark checkpoint, its float32 reference) written under `dst` from the one-file float checkpoint
    `src`: every decoder projection (each expert's too) quantized in `scheme`, the rest kept in float; with
    `+kv`, each layer's k and v projections' output scale (`KV_SCALE`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown Quark scheme {scheme!r}; one of {SCHEMES}")
    qdir, refdir = dst / f"quark-{scheme}", dst / f"quark-{scheme}-reference"

    def by_name(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, held = quantized(t, scheme)
        module = name.removesuffix(".weight")
        if scheme.endswith("+kv") and module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            tensors["output_scale"] = torch.tensor(KV_SCALE)
        return {f"{module}.{suffix}": v for suffix, v in tensors.items()}, held

    write_pair(src, qdir, refdir, by_name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, refdir
