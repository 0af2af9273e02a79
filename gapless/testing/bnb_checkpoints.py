"""Tiny bitsandbytes checkpoints for tests: a float checkpoint's decoder projections quantized as Hugging
Face's bitsandbytes integration stores them (`gapless.model.quant.bnb` describes the 4-bit tensors,
`gapless.model.quant.int4_layouts` the 8-bit ones), beside a float checkpoint holding the same weights
dequantized (the reference a quantized model must equal). Written here, not by bitsandbytes: its
codebooks (`bnb.TABLES`) and blocks are the format's, the quantizer a plain nearest-value rounding."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gapless.model.quant.bnb import TABLES
from gapless.testing.quant_checkpoints import write_pair

KINDS = ("nf4", "fp4", "int8")


def _nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each value's code: the index of the nearest table entry."""
    return (x.unsqueeze(-1) - table).abs().argmin(-1)


def _four_bit(w: torch.Tensor, kind: str, nested: bool, block: int = 64) -> dict[str, torch.Tensor]:
    """One weight's tensors (by suffix after `weight`, "" the codes), and "reference": W dequantized."""
    table = torch.tensor(TABLES[kind], dtype=torch.float32)
    flat = w.float().flatten()
    absmax = flat.view(-1, block).abs().amax(-1).clamp(min=1e-12)
    codes = _nearest(flat.view(-1, block) / absmax[:, None], table).flatten().to(torch.uint8)
    out = {"": ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1), ".quant_map": table}
    dtype = str(w.dtype).removeprefix("torch.")
    state: dict[str, object] = {
        "quant_type": kind,
        "blocksize": block,
        "dtype": dtype,
        "shape": list(w.shape),
    }
    held = absmax
    if nested:  # the scales themselves as uint8 codes, 256 to a scale, around their mean
        offset, nested_block = float(absmax.mean()), 256
        centered = absmax - offset
        pad = -len(centered) % nested_block
        groups = torch.cat([centered, centered.new_zeros(pad)]).view(-1, nested_block)
        nested_absmax = groups.abs().amax(-1).clamp(min=1e-12)
        nested_map = torch.linspace(-1, 1, 256)
        scale_codes = _nearest(groups / nested_absmax[:, None], nested_map).flatten()[: len(absmax)]
        out |= {
            ".absmax": scale_codes.to(torch.uint8),
            ".nested_absmax": nested_absmax,
            ".nested_quant_map": nested_map,
        }
        state |= {"nested_blocksize": nested_block, "nested_dtype": "float32", "nested_offset": offset}
        held = nested_map[scale_codes] * nested_absmax.repeat_interleave(nested_block)[: len(absmax)] + offset
    else:
        out[".absmax"] = absmax
    out[f".quant_state.bitsandbytes__{kind}"] = torch.tensor(
        list(json.dumps(state).encode()), dtype=torch.uint8
    )
    out["reference"] = (table[codes.long()].view(-1, block) * held[:, None]).view(w.shape)
    return out


def _eight_bit(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One weight's tensors as `_four_bit`'s: int8 rows, each scaled by its absolute maximum (`SCB`)."""
    scb = w.float().abs().amax(1).clamp(min=1e-12)
    q = torch.round(w.float() * 127 / scb[:, None]).clamp(-127, 127).to(torch.int8)
    return {
        "": q,
        "_format": torch.tensor(0, dtype=torch.uint8),  # (`weight_format`: row-major)
        "SCB": scb,
        "reference": q.float() * (scb[:, None] / 127),
    }


def quantization_config(kind: str, nested: bool = True) -> dict[str, object]:
    """The `quantization_config` transformers writes for a bitsandbytes checkpoint of `kind`."""
    four = kind != "int8"
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": four,
        "load_in_8bit": not four,
        "bnb_4bit_quant_type": kind if four else "fp4",
        "bnb_4bit_use_double_quant": four and nested,
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": None,
        "llm_int8_threshold": 6.0,
        "llm_int8_has_fp16_weight": False,
    }


def write_bnb(src: Path, dst: Path, kind: str, nested: bool = True) -> tuple[Path, Path]:
    """(the bitsandbytes checkpoint of `kind` (one of KINDS; 4-bit ones double-quantized where `nested`),
    its float32 reference) written under `dst` from the one-file float checkpoint `src`: every decoder
    projection quantized, everything else kept in float."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    qdir, refdir = dst / f"bnb-{kind}", dst / f"bnb-{kind}-reference"

    def quantized(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        parts = _eight_bit(t) if kind == "int8" else _four_bit(t, kind, nested)
        held, module = parts.pop("reference"), name.removesuffix(".weight")
        return {f"{module}.{s}" if s == "SCB" else f"{name}{s}": v for s, v in parts.items()}, held

    write_pair(src, qdir, refdir, quantized)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(kind, nested)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, refdir
