"""A start-up check of a kernel backend against the torch reference, on the model's own shapes.

`attention_backend="auto"` picks the Triton kernels on CUDA. Should they fail to compile on this GPU or
Triton version, or compute something else than the reference, serving with them would be wrong or
would not start. So before "auto" commits to them, two small ragged extend batches (with prefixes,
unaligned to pages; one with image spans that see ahead, `SPANS`) and one decode batch long enough to
use several splits run through both backends;
on any error or disagreement, "auto" falls back to the reference backend and logs why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from gapless.attention.base import AttentionBackend, AttentionMetadata
from gapless.attention.torch_ref import TorchRefBackend
from gapless.memory.kv_pool import FP8_DTYPES, quantize_fp8

# relative error bound of the output (max abs error / max abs reference): bf16/fp16 keep ~3 digits
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# the batches checked: name -> (prefix lens, extend lens); a decode long enough for several splits
# an fp8 probe's k scale (v: 0.75 of it): randn / scale stays inside e4m3's range (448), and e5m2's
_FP8_SCALE = torch.tensor([2.0**-5])
CASES = {"extend": ([0, 5, 37], [4, 1, 9]), "image": ([0, 6], [12, 9]), "decode": ([1, 40, 700], [1, 1, 1])}
# a case's flat token spans whose tokens see the span's last (`AttentionMetadata.q_limits`: Gemma 3's images)
SPANS = {"image": ((2, 8), (13, 5))}


class LayerOptions(TypedDict, total=False):
    """The per-layer options of `AttentionBackend.forward` a layer passes: only those it has."""

    window: int
    softcap: float


@dataclass(frozen=True)
class Probe:
    """The attention shapes of the model to check the backend with."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int | None = None  # the model's sliding window, if any layer has one: checked with it
    softcap: float | None = None  # the model's attention soft-capping, if any: checked with it
    kv_dtype: torch.dtype | None = None  # the KV cache's, where not `dtype` (an fp8 cache): checked in it

    def layer(self) -> LayerOptions:
        """The options a layer passes `AttentionBackend.forward`, as the decoder does: only those it has."""
        options = LayerOptions()
        if self.window is not None:
            options["window"] = self.window
        if self.softcap is not None:
            options["softcap"] = self.softcap
        return options

    def kv_scales(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The k/v scales `batch` quantizes an fp8 cache with, as `forward` takes them; {} for another."""
        if self.kv_dtype not in FP8_DTYPES:
            return {}
        return {"k_scale": _FP8_SCALE.to(device), "v_scale": (_FP8_SCALE * 0.75).to(device)}


def batch(
    probe: Probe,
    prefix_lens: list[int],
    extend_lens: list[int],
    device: torch.device,
    seed: int,
    spans: tuple[tuple[int, int], ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random batch; `spans`: (flat start, length) runs whose tokens each see the run's last."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    slots_needed = sum(seq_lens)
    kv = (slots_needed + 1, probe.kv_heads, probe.head_dim)
    k = torch.randn(kv, generator=g)
    v = torch.randn(kv, generator=g)
    # each request's tokens in scattered slots (slot 0 is padding and stays unused)
    perm = (torch.randperm(slots_needed, generator=g) + 1).split(seq_lens)
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32)
    for b, slots in enumerate(perm):
        table[b, : len(slots)] = slots.to(torch.int32)
    ext = torch.tensor(extend_lens)
    q = torch.randn(int(ext.sum()), probe.heads, probe.head_dim, generator=g)
    meta = AttentionMetadata(
        rows=torch.arange(len(seq_lens), device=device),
        prefix_lens=torch.tensor(prefix_lens, device=device),
        extend_lens=ext.to(device),
        q_start=(torch.cumsum(ext, 0) - ext).to(device),
        req_table=table.to(device),
        max_extend_len=max(extend_lens),
        max_seq_len=max(seq_lens),
        is_decode=all(e == 1 for e in extend_lens),
    )
    if spans:
        pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
        limits = pos.clone()
        for start, n in spans:
            limits[start : start + n] = pos[start + n - 1]
        meta.q_limits = limits.to(device)
    to = lambda t: t.to(device=device, dtype=probe.dtype)  # noqa: E731
    scales = probe.kv_scales(torch.device("cpu"))
    if scales:  # as the KV pool stores them: k / scale in the fp8 type
        assert probe.kv_dtype is not None
        k8 = quantize_fp8(k, scales["k_scale"], probe.kv_dtype)
        v8 = quantize_fp8(v, scales["v_scale"], probe.kv_dtype)
        return to(q), k8.to(device), v8.to(device), meta
    return to(q), to(k), to(v), meta


def dequantized(probe: Probe, cache: torch.Tensor, name: str) -> torch.Tensor:
    """A cache of `batch`'s in fp32: an fp8 one times its scale (`name`: k_scale or v_scale)."""
    scales = probe.kv_scales(cache.device)
    return cache.float() * scales[name] if scales else cache.float()


def disagreement(backend: AttentionBackend, probe: Probe, device: torch.device) -> str | None:
    """None if `backend` matches the torch reference on an extend and a decode batch; else why not."""
    reference = TorchRefBackend()
    scale = probe.head_dim**-0.5
    for seed, (name, (prefix_lens, extend_lens)) in enumerate(CASES.items()):
        q, k, v, meta = batch(probe, prefix_lens, extend_lens, device, seed, SPANS.get(name, ()))
        layer = probe.layer()
        try:
            out = backend.forward(q, k, v, backend.prepare(meta), scale, **layer, **probe.kv_scales(device))
        except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
            return f"{name} batch failed: {type(e).__name__}: {e}"
        k32, v32 = dequantized(probe, k, "k_scale"), dequantized(probe, v, "v_scale")
        want = reference.forward(q.float(), k32, v32, reference.prepare(meta), scale, **layer)
        if out.shape != want.shape:
            return f"{name} batch: output shape {tuple(out.shape)}, reference {tuple(want.shape)}"
        if not bool(torch.isfinite(out).all()):
            return f"{name} batch: non-finite output"
        err = float((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))
        if err > _TOLERANCE.get(probe.dtype, 3e-2):
            return f"{name} batch: relative error {err:.2e} against the reference"
    return None
