"""Which implementation of the decoder's elementwise steps a model runs: fused Triton kernels or torch.

The steps are the residual add + RMSNorm, the per-head q/k norm + RoPE + KV store, and the gated
activation (`gapless.model.fused.triton_kernels`). Their torch reference is the model code itself
(`RMSNorm.normalize`, `RotaryEmbedding`, `KVPool.store`, `GATED_ACTIVATIONS`): the CPU path, and the
yardstick. `use_fused_kernels` sets the choice on every module that has one (`fused`, None = torch).

"auto" picks the kernels on CUDA, but only after they agree with torch on the model's own modules and
shapes (`disagreement`: a norm with and without a residual, layer 0's q/k norm + RoPE + store into a
scratch KV pool, the model's activation), so a Triton version or GPU on which they fail to compile or
compute something else falls back to torch, with a logged reason, instead of serving wrong tokens.
Nothing here imports Triton before a choice needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import cast

import torch

from gapless.memory.kv_pool import E5M2, FP8, KVPool
from gapless.model.decoder import MLP, Attention, CausalLM, DecoderLayer
from gapless.model.layers import GATED_ACTIVATIONS, RMSNorm, _Linear
from gapless.model.quant.base import PendingNorm

log = logging.getLogger(__name__)

FUSED_KERNELS = ("auto", "torch", "triton")
# relative error bound (max abs error / max abs reference): one rounding step of the dtype, with room
# (an fp8 cache: one e4m3 step, where a rotated k one rounding apart lands on the other side of a step;
# e5m2's steps are twice e4m3's)
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3, FP8: 7e-2, E5M2: 1.4e-1}


def _kernels() -> ModuleType:
    import gapless.model.fused.triton_kernels as kernels

    return kernels


def set_fused(model: CausalLM, kernels: ModuleType | None) -> None:
    """Run `kernels` (the Triton module) in every norm, attention and MLP of `model`; None: torch."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.fused = kernels


def use_fused_kernels(
    model: CausalLM, name: str, device: torch.device, kv_dtype: torch.dtype | None = None
) -> str:
    """Choose the implementation `name` asks for ("auto", "torch" or "triton", as
    `gapless.attention.make_backend` chooses attention), set it on `model`, and return which one runs.
    `kv_dtype`: the KV pool's, where not the model's (fp8): "auto" checks the store into it."""
    if name not in FUSED_KERNELS:
        raise ValueError(f"fused_kernels={name!r}: must be one of {FUSED_KERNELS}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        set_fused(model, None)
        return "torch"
    try:
        kernels = _kernels()
    except ImportError as e:
        if name == "triton":
            why = f"{type(e).__name__}: {e}"
            raise RuntimeError(f"fused_kernels='triton' needs the triton package ({why})") from e
        log.warning("fused kernels: triton does not import (%s); using torch", e)
        return "torch"
    if name == "triton":
        if device.type == "cpu" and not kernels.INTERPRET:
            raise RuntimeError(
                "fused_kernels='triton' runs on CUDA devices; on CPU it needs Triton's interpreter (set "
                "TRITON_INTERPRET=1 before Triton is first imported, slow, meant for tests) - or use 'torch'"
            )
        set_fused(model, kernels)
        return "triton"
    return checked(model, kernels, device, kv_dtype)


def checked(
    model: CausalLM, kernels: ModuleType, device: torch.device, kv_dtype: torch.dtype | None = None
) -> str:
    """Set `kernels` on `model` if they agree with torch on its shapes (`disagreement`), else torch with
    a warning saying why; return which one runs."""
    why = disagreement(model, kernels, device, kv_dtype)
    if why is not None:
        log.warning("fused kernels: %s; using torch", why)
        return "torch"
    set_fused(model, kernels)
    return "triton"


def disagreement(
    model: CausalLM, kernels: ModuleType, device: torch.device, kv_dtype: torch.dtype | None = None
) -> str | None:
    """None if `kernels` match torch on `model`'s own modules (a few ragged rows of its shapes, the KV
    store into a pool of `kv_dtype`); else why not. Leaves `model` on torch."""
    set_fused(model, None)
    name = "setting up the check"
    try:
        for name, run in _probes(model, device, kv_dtype).items():
            want = run()
            set_fused(model, kernels)
            try:
                got = run()
            finally:
                set_fused(model, None)
            why = _compare(name, got, want)
            if why is not None:
                return why
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"{name} failed: {type(e).__name__}: {e}"
    return None


def _compare(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{name}: {tuple(g.shape)} {g.dtype}, torch {tuple(w.shape)} {w.dtype}"
        if not bool(torch.isfinite(g.float()).all()):  # (float: no isfinite for fp8)
            return f"{name}: non-finite output"
        err = float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6))
        if err > _TOLERANCE.get(w.dtype, 2e-2):
            return f"{name}: relative error {err:.2e} against torch"
    return None


def _probes(
    model: CausalLM, device: torch.device, kv_dtype: torch.dtype | None = None
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """name -> a function running one step on fixed random inputs, returning its outputs (the KV store
    into a pool of `kv_dtype`, default the model's dtype; an fp8 one with scales not 1)."""
    cfg, body = model.cfg, model.model
    dtype = body.norm.weight.dtype
    g = torch.Generator().manual_seed(0)
    tokens = 7
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x, residual = rand(tokens, cfg.hidden_size), rand(tokens, cfg.hidden_size)
    attn = cast(Attention, body.layers[0].self_attn)  # (nn.ModuleList's items are typed as any Module)
    qkv = rand(tokens, cfg.q_size + 2 * cfg.kv_size)
    positions = torch.tensor([0, 1, 2, 9, 33, 100, 511], device=device) % attn.rope.cos_sin.shape[0]
    slots = torch.randperm(tokens, generator=g).add_(1).to(device)
    gate_up = rand(tokens, 2 * cfg.intermediate_size)

    def rope_store() -> list[torch.Tensor]:
        pool = KVPool(
            attn.layer_id + 1, tokens + 1, 1, cfg.num_kv_heads, cfg.head_dim, kv_dtype or dtype, device
        )
        pool.set_scales([0.5] * pool.num_layers, [0.25] * pool.num_layers)
        q, k, v = (t.view(tokens, -1, cfg.head_dim) for t in qkv.split(attn.qkv_proj.output_sizes, dim=-1))
        q = attn.rotate_and_store(positions, q, k, v, pool, slots)
        return [q, pool.k[attn.layer_id], pool.v[attn.layer_id]]

    def act() -> list[torch.Tensor]:
        fused = body.norm.fused  # as set for the model: the activation has no module of its own here
        if fused is None:
            return [GATED_ACTIVATIONS[cfg.hidden_act](gate_up)]
        return [fused.act_and_mul(gate_up, cfg.hidden_act)]

    probes = {
        "rms_norm": lambda: [body.norm(x)],
        "add_rms_norm": lambda: list(body.norm(x, residual)),
        "qk_norm_rope_store": rope_store,
        "act_and_mul": act,
    }
    layer = cast(DecoderLayer, body.layers[0])
    # from the norm before each: where FP8 layers' x is rounded by both; at one row, where the FP8 GEMV
    # takes the norm's (and the activation's) input itself and writes the new residual
    rows, proj = {"": (x, residual), "_one_row": (x[:1], residual[:1])}, attn.qkv_proj
    for suffix, (xs, res) in rows.items():
        probes[f"norm_into_qkv{suffix}"] = partial(_norm_into, layer, 0, proj, proj, xs, res)
        if isinstance(mlp := layer.mlp, MLP):
            probes[f"norm_into_mlp{suffix}"] = partial(_norm_into, layer, 2, mlp.gate_up_proj, mlp, xs, res)
    return probes


def _norm_into(
    layer: DecoderLayer,
    place: int,
    feeds: _Linear,
    then: Callable[[torch.Tensor | PendingNorm], torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor,
) -> list[torch.Tensor]:
    """[`then` of the layer's norm at `place` of x + residual, feeding `feeds`; the new residual]."""
    h, new = layer._add_norm(place, x, residual, feeds)
    return [then(h), new]  # (`then` first: the layer that takes the norm's input writes `new`)
