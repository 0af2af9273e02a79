"""An FP8 KV cache's per-layer k/v scales, as checkpoints carry them (the names vLLM reads).

- `model.layers.N.self_attn.k_scale` / `.v_scale`: FP8 checkpoints (`quant_method: fp8`, llm-compressor);
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale`: compressed-tensors'
  `kv_cache_scheme` (per-tensor), and AMD Quark's `kv_cache_group`;
- `model.layers.N.self_attn.k_proj.k_scale` / `v_proj.v_scale`: NVIDIA ModelOpt;
- `model.layers.N.self_attn.kv_scale`: the older single scale (AutoFP8), for both k and v.

Each is the dequantization scale: the cache stores `x / scale` in e4m3 and reads back `fp8 * scale`. A
layer the checkpoint gives none gets 1.0, as vLLM. The loader hands every such tensor here
(`KVScaleReader.take`) rather than to a parameter; a bf16 KV cache ignores them (as vLLM does).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\."
    r"(?:(k|v|kv)_scale|([kv])_proj\.output_scale|([kv])_proj\.([kv])_scale|q_scale|prob_scale"
    r"|q_proj\.output_scale|prob_output_scale)$"
)


class KVScales(NamedTuple):
    """Each layer's k and v dequantization scale (1.0 where the checkpoint has none)."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    from_checkpoint: int  # how many layers' scales the checkpoint gave


class KVScaleReader:
    """Collects a checkpoint's KV-cache scale tensors while the loader walks its weights."""

    def __init__(self) -> None:
        self._found: dict[tuple[int, str], float] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is a KV-cache scale (or a q/prob scale of FP8 attention, which gapless does not
        use); a k/v one is kept. A scale of more than one element is refused by name."""
        m = _NAME.match(name)
        if m is None:
            return False
        layer_s, kind, out, mo_proj, mo_kind = m.groups()
        if mo_proj is not None and mo_proj != mo_kind:
            return False  # k_proj.v_scale: not a name any format writes
        kind = kind or out or mo_kind
        if kind is None:  # q_scale, prob_scale: FP8 attention's, not the cache's
            return True
        if tensor.numel() != 1:
            raise ValueError(
                f"checkpoint KV-cache scale {name!r} has {tensor.numel()} elements; only per-tensor "
                "(one scale a layer) is supported"
            )
        value = float(tensor.float().item())
        if not 0 < value < float("inf"):
            raise ValueError(f"checkpoint KV-cache scale {name!r} is {value}: must be positive and finite")
        for k in ("k", "v") if kind == "kv" else (kind,):
            self._found[(int(layer_s), k)] = value
        return True

    def scales(self, num_layers: int) -> KVScales:
        """The scales found, 1.0 for the layers without; a layer past `num_layers` is refused."""
        extra = sorted({layer for layer, _ in self._found if layer >= num_layers})
        if extra:
            raise ValueError(
                f"checkpoint has KV-cache scales for layer {extra[0]} of a {num_layers}-layer model"
            )
        k = tuple(self._found.get((i, "k"), 1.0) for i in range(num_layers))
        v = tuple(self._found.get((i, "v"), 1.0) for i in range(num_layers))
        return KVScales(k, v, len({layer for layer, _ in self._found}))
