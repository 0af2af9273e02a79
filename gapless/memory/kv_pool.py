"""The physical KV cache: per layer, one K and one V tensor indexed directly by slot id.

The cache holds the model's dtype, or float8 (`--kv-cache-dtype fp8`/`fp8_e4m3`: e4m3, or `fp8_e5m2`:
e5m2, as vLLM's): then each layer has a per-tensor k and v scale (fp32 device tensors, 1.0 unless the
checkpoint brings them), the store writes `saturate(x / scale)` in the fp8 type and every reader multiplies
back by the scale. One byte an element, so the same memory holds twice the tokens of bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gapless.config import E4M3_KV_CACHE_DTYPES, E5M2_KV_CACHE_DTYPE, UNQUANTIZED_KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = 448.0  # e4m3's largest finite value: the store saturates there
E5M2_MAX = 57344.0  # e5m2's
# the fp8 caches' element types: how the start-up line and the benchmarks name each, and where its store
# saturates
FP8_NAMES = {FP8: "fp8_e4m3", E5M2: "fp8_e5m2"}
_FP8_MAX = {FP8: FP8_MAX, E5M2: E5M2_MAX}
FP8_DTYPES = tuple(FP8_NAMES)


def kv_cache_dtype(name: str, model_dtype: torch.dtype, checkpoint: str | None = None) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype` `name` (vLLM's names): "auto" is the checkpoint's own
    KV format where it names one (`checkpoint`: `declared.checkpoint_kv_cache`, ModelOpt's FP8), else the
    model's dtype; "bfloat16" or "bf16" (vLLM's and SGLang's names for an unquantized cache, whatever the
    checkpoint says) the model's dtype; "fp8"/"fp8_e4m3" float8 e4m3; "fp8_e5m2" float8 e5m2; anything
    else is refused by name."""
    if name == "auto" and checkpoint is not None:
        name = checkpoint
    if name == "auto" or name in UNQUANTIZED_KV_CACHE_DTYPES:
        return model_dtype
    if name in E4M3_KV_CACHE_DTYPES:
        return FP8
    if name == E5M2_KV_CACHE_DTYPE:
        return E5M2
    raise ValueError(f"kv_cache_dtype={name!r}: must be auto, bfloat16, bf16, fp8, fp8_e4m3 or fp8_e5m2")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 cache's element type (e4m3 or e5m2): where its store saturates."""
    return _FP8_MAX[dtype]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """`x / scale` (in fp32), saturated to `dtype`'s range and rounded to nearest even, as `dtype` (e4m3 or
    e5m2)."""
    top = fp8_max(dtype)
    return (x.float() / scale).clamp_(-top, top).to(dtype)


class AttentionShape(Protocol):
    """What a pool's shape comes from (a model's config: `gapless.model.config.ModelConfig`)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class Scales(Protocol):
    """Each layer's k and v scale (a checkpoint's: `gapless.model.kv_scales.KVScales`)."""

    @property
    def k(self) -> Sequence[float]: ...
    @property
    def v(self) -> Sequence[float]: ...


class KVPool:
    """Per-layer K and V storage of shape ``[num_pages * page_size, num_kv_heads, head_dim]``.

    Slot ids (``page * page_size + offset``) index the first dimension directly, so attention
    kernels gather with the request table and never translate addresses. Each side is one
    allocation (``k_buffer``/``v_buffer``, ``[num_layers, slots, kvh, hd]``); ``k[layer]`` and
    ``v[layer]`` are views of it, for kernels that want a single base pointer. ``k_scale[layer]`` and
    ``v_scale[layer]`` ([1] fp32 views of one device tensor each) are an fp8 pool's dequantization
    scales, set in place (`set_scales`) so captured CUDA graphs read the new values.
    """

    @classmethod
    def for_model(
        cls,
        cfg: AttentionShape,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: Scales | None = None,
    ) -> KVPool:
        """A pool for `cfg`'s attention layers; an fp8 one takes the checkpoint's `scales` if it has them."""
        pool = cls(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        if pool.quantized and scales is not None:
            pool.set_scales(scales.k, scales.v)
        return pool

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = num_pages * page_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        # Zeros, not empty: padding tokens and masked-out reads touch slot 0 and unwritten slots, and a
        # NaN there would survive a zero attention weight (0 * NaN = NaN).
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = list(self.k_buffer.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_buffer.unbind(0))
        self.scales = torch.ones(2, num_layers, 1, dtype=torch.float32, device=self.device)
        self.k_scale: list[torch.Tensor] = list(self.scales[0].unbind(0))
        self.v_scale: list[torch.Tensor] = list(self.scales[1].unbind(0))

    @property
    def quantized(self) -> bool:
        """Whether the pool stores fp8 (scaled: e4m3 or e5m2) rather than the model's dtype."""
        return self.dtype in FP8_DTYPES

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Each layer's k and v dequantization scale (positive and finite), copied in place."""
        for name, values in (("k_scale", k_scales), ("v_scale", v_scales)):
            if len(values) != self.num_layers:
                raise ValueError(f"{name}: {len(values)} values for {self.num_layers} layers")
            bad = [s for s in values if not 0 < s < float("inf")]
            if bad:
                raise ValueError(f"{name}: scales must be positive and finite, got {bad[0]}")
        self.scales.copy_(torch.tensor([k_scales, v_scales], dtype=torch.float32).unsqueeze(-1))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`layer`'s (k_scale, v_scale) as the store kernel and attention backends take them: an fp8
        pool's, else (None, None)."""
        if not self.quantized:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def summary(self, ranks: int = 1) -> str:
        """The pool's element type and bytes per token (all layers, K and V), for the start-up lines:
        "fp8_e4m3, 57344 B/token"; under tensor parallelism (`ranks` > 1) a rank's pool, its heads'
        bytes: "fp8_e4m3, 28672 B/token on each of 2 ranks"."""
        name = FP8_NAMES.get(self.dtype) or str(self.dtype).removeprefix("torch.")
        per_token = self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        return f"{name}, {per_token} B/token{f' on each of {ranks} ranks' if ranks > 1 else ''}"

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token costs across all layers (K and V), for sizing the pool from free memory."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, kvh, hd]``) into ``slots`` (int64 ``[n]``, on the pool's device) in place,
        quantized with the layer's scales in an fp8 pool.

        Enqueued in stream order like any kernel, so a forward already in flight never sees it.
        """
        if not self.quantized:
            self.k[layer].index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.dtype))
            return
        # through uint8 views: torch has no fp8 index_copy on CPU; the bytes are the same
        k8 = quantize_fp8(k, self.k_scale[layer], self.dtype)
        v8 = quantize_fp8(v, self.v_scale[layer], self.dtype)
        self.k[layer].view(torch.uint8).index_copy_(0, slots, k8.view(torch.uint8))
        self.v[layer].view(torch.uint8).index_copy_(0, slots, v8.view(torch.uint8))
