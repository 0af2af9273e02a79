"""`--quantization rtn` (vLLM's and SGLang's name): a float checkpoint's weights rounded to int8 or int4 at
load, weight-only, by round-to-nearest, as vLLM's `rtn` does: `RTN_NUM_BITS` bits (8, the default, or 4) and
one scale per `RTN_GROUP_SIZE` inputs of a row (128, the default; -1: one a row). Each group's scale is
twice its largest |w| over 2^bits - 1, and `q = clamp(round(w / scale) + 2^(bits-1), 0, 2^bits - 1)`, so
`W = (q - 2^(bits-1)) * scale`: a symmetric GPTQ layer's form (zeros 2^(bits-1)), computed in the weight's
dtype as vLLM does.

Every linear layer but the routers (the LM head is none) and every mixture's experts are rounded as each
becomes whole (the loader's online rounding, as `--quantization fp8`), each tensor-parallel rank its own
piece, and held on the int4/int8 path as a checkpoint's would be (`int4.hold`,
`int4_experts.install_experts`): tinygemm and gapless's Triton GEMM on CUDA, torch's CPU kernels or the
reference path on a CPU. A layer whose inputs (this rank's) are no multiple of the group is refused by name
before any weight is read.

`--quantization experts_int8` (vLLM's) rounds a mixture's experts alone, as vLLM's does: int8 with one
scale a row (this rank's piece of it), its largest |w| over 127, `q = clamp(round(w / scale), -127, 127)`,
held as `q + 128` less a zero of 128 (`EXPERTS_INT8`); a model with no mixture is refused by name."""

from __future__ import annotations

import logging
from collections.abc import Collection
from functools import partial
from typing import Any

import torch
from torch import nn

from gapless import env
from gapless.model.quant import int4, int4_experts, int4_kernels
from gapless.model.quant.formats import QuantFormatError, QuantSpec
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked

log = logging.getLogger(__name__)

SCALE_NAMES: tuple[str, ...] = ()  # (a float checkpoint: nothing in it marks a layer)
usual_targets = int4.usual_targets


def settings() -> tuple[int, int]:
    """(bits, group; -1 a row) from vLLM's variables `RTN_NUM_BITS` and `RTN_GROUP_SIZE`, or a one-line
    QuantFormatError naming the one that is out of range."""
    bits, group = env.RTN_NUM_BITS.get(), env.RTN_GROUP_SIZE.get()
    if bits not in (4, 8):
        raise QuantFormatError(f"--quantization rtn: RTN_NUM_BITS={bits}; 4 or 8")
    if group != -1 and (group < 32 // bits or group & (group - 1)):
        raise QuantFormatError(
            f"--quantization rtn: RTN_GROUP_SIZE={group}; a power of two from {32 // bits}, or -1 (one a row)"
        )
    return bits, group


EXPERTS_INT8 = "experts_int8"  # (vLLM's name; `QuantSpec.name` of the experts-only rounding)


def _spec(spec: QuantSpec) -> Int4Spec:
    assert spec.rtn is not None
    bits, group = spec.rtn
    return Int4Spec(spec.name, bits, group, sym=True)


def quantized_modules(model: nn.Module, spec: QuantSpec, targets: set[str]) -> list[str]:
    """`usual_targets`, each one's inputs (this rank's) in whole groups, else a one-line QuantFormatError
    naming the layer."""
    from gapless.model.moe import Experts

    assert spec.rtn is not None
    modules = usual_targets(model)
    if spec.name == EXPERTS_INT8:
        modules = [n for n in modules if isinstance(model.get_submodule(n), Experts)]
        if not modules:
            raise QuantFormatError(
                "--quantization experts_int8: the model has no mixture of experts to round"
            )
    bits, group = spec.rtn
    whole = group if group > 0 else 32 // bits  # (a row's values, packed 32 // bits to a word)
    what = f"RTN_GROUP_SIZE {group}" if group > 0 else f"{whole} ({bits}-bit values to a word)"
    int4.check_inputs(model, modules, whole, spec.name, what)
    return modules


def prepare(model: nn.Module, spec: QuantSpec, modules: list[str]) -> None:
    """Each linear layer told the int4 GEMMs the model's int4 layers run (`int4_kernels.for_model`, weighed
    on them all); their float weights load as they are, `finish_module` rounds them."""
    layers: list[Any] = [model.get_submodule(n) for n in modules]
    linear = [m for m in layers if int4.is_quantized_linear(m)]
    if not linear:
        return
    numel = sum(m.weight.numel() for m in linear)
    kernel = int4_kernels.for_model(numel, _spec(spec).bits, linear[0].weight.dtype, linear[0].weight.device)
    for m in linear:
        m.rtn_kernel = kernel


def rounded(w: torch.Tensor, bits: int, group: int) -> Unpacked:
    """`w` [N, K] rounded as the module says (in its dtype), as the int4 path's form, a few million values
    at a time."""
    n, k = w.shape
    g = k if group < 0 else group
    half, top = 1 << (bits - 1), (1 << bits) - 1
    q = torch.empty(n, k, dtype=torch.int16, device=w.device)
    scale = torch.empty(n, k // g, dtype=torch.float32, device=w.device)
    step = max(1, (1 << 22) // k)
    for r in range(0, n, step):
        blocks = w[r : r + step].reshape(-1, k // g, g)
        most = torch.maximum(blocks.amin(-1, keepdim=True).abs(), blocks.amax(-1, keepdim=True).abs())
        s = most * 2.0 / top
        # (an all-zero group: 0 / 0 in vLLM's arithmetic; here its zero, value 0)
        scaled = torch.where(s > 0, blocks / s, torch.zeros_like(blocks))
        q[r : r + step] = (scaled.round() + half).clamp(0, top).reshape(-1, k).to(torch.int16)
        scale[r : r + step] = s.squeeze(-1).float()
    return Unpacked(q, scale, torch.full_like(scale, half))


def experts_int8(w: torch.Tensor) -> Unpacked:
    """`w` [N, K] rounded as vLLM's `experts_int8` rounds an expert's projection (the module's docstring),
    in its dtype, as the int8 path's form."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scaled = torch.where(scale > 0, w / scale, torch.zeros_like(w))  # (an all-zero row: its zero)
    q = scaled.round().clamp(-127, 127) + 128
    return Unpacked(q.to(torch.int16), scale.float(), torch.full_like(scale, 128, dtype=torch.float32))


def finish_module(layer: Any, spec: QuantSpec) -> None:
    """`layer`'s float weight (a mixture's experts', each expert's projections) rounded and held on the
    int4/int8 path, the float weight freed."""
    from gapless.model.moe import Experts

    int4_spec = _spec(spec)
    bits, group = spec.rtn or (0, 0)
    round_weight = experts_int8 if spec.name == EXPERTS_INT8 else partial(rounded, bits=bits, group=group)
    if not isinstance(layer, Experts):
        w = layer.weight.data
        kernel = getattr(layer, "rtn_kernel", int4_kernels.chosen())
        int4.hold(layer, round_weight(w), int4_spec, w.dtype, kernel)
        return
    shards: dict[tuple[int, str], Unpacked] = {}
    for e in range(layer.num_experts):
        both = round_weight(layer.gate_up_proj.data[e])  # (gate's rows, then up's)
        shards[(e, "gate")] = both.map(lambda t: t[: layer.inter])
        shards[(e, "up")] = both.map(lambda t: t[layer.inter :])
        shards[(e, "down")] = round_weight(layer.down_proj.data[e])
    int4_experts.install_experts(
        layer, shards, int4_spec, layer.gate_up_proj.dtype, f"{spec.name} experts", cut=False
    )


def finish(model: nn.Module, spec: QuantSpec, modules: list[str], done: Collection[str] = ()) -> None:
    """After loading: `finish_module` on each of `modules` not `done` (the loader's rounding finishes each
    as it becomes whole); how many were rounded logged."""
    for name in modules:
        if name not in done:
            finish_module(model.get_submodule(name), spec)
    log.info("%s: %d linear layers and mixtures' experts rounded at load", spec.label, len(modules))
