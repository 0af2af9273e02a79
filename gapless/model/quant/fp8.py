"""FP8 e4m3 weights, W8A8: the layers' linear method and how their weights and scales load.

These layouts come in (`gapless.model.quant.formats` names them), all held as one: the layer's `weight`
in e4m3 [N, K] and a float32 `weight_scale` [N / rows_per_scale, K / k_group], w = q * scale:

- `quant_method: fp8` (Hugging Face's FineGrainedFP8, DeepSeek's and Qwen's `*-FP8` layout): a
  `weight_scale_inv` per [128, 128] block (the name notwithstanding, a multiplier);
- compressed-tensors `float-quantized`: `weight_scale` per tensor ([1] or a scalar), per output row
  ([N, 1]), per `block_structure` block, or per group of inputs ([N, K / G]: a [1, G] block);
  `quant_method: fp8` without blocks (vLLM's and AutoFP8's) and ModelOpt's FP8 alike (ModelOpt's blocks
  stored [N / 128, 1, K / 128, 1]: `checkpoint_scale`);
- MXFP8 (compressed-tensors' `mxfp8-quantized`, ModelOpt's `quant_algo: MXFP8`): groups of 32 inputs,
  each scale an e8m0 power of two (uint8), made float32 as it loads (`mx_scale`);
- `--quantization fp8` of a float checkpoint: each row quantized at load, its scale its largest |w| / 448.

While loading, a scale's rows are expanded to one per weight row, so tensor parallelism and the fused
q/k/v and gate/up projections cut and place it exactly as its weight (the layer's own `load_shard`); a
per-tensor scale of a fused projection's shard becomes that shard's rows' scale. Once loaded, block scales
whose rows repeat per block are stored per block again (`Fp8LinearMethod`).

Activations are quantized at run time, per token and per `act_group` columns (the weight's block width,
else 128): a dynamic scale finer than per token. On CUDA (sm_89+) one Triton kernel does that and the GEMM
(`gapless.model.quant.fp8_kernel`). On the CPU, the reference (`reference_linear`): the same rounding of
x, times the weight dequantized once at load to float32 (a path for parity tests, not a saving: it holds
the float weight beside the e4m3 one). A static `input_scale` of a checkpoint is not read.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from gapless import env
from gapless.model.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    _Linear,
    default_weight_loader,
    set_weight_loader,
)
from gapless.model.quant.base import PendingNorm, rounding_of
from gapless.model.quant.formats import QuantFormatError, QuantSpec
from gapless.model.quant.fp8_kernel import FP8_MAX

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
ACT_GROUP = 128  # activation columns per dynamic scale where the weight has no block width
SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # a checkpoint's weight scale (fp8's, compressed-tensors')


def checkpoint_scale(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A checkpoint tensor under the name and shape its parameter loads it as: fp8's `weight_scale_inv` (a
    multiplier, the name notwithstanding) as `weight_scale`, ModelOpt's block scales [row blocks, 1,
    column blocks, 1] as [row blocks, column blocks], and MXFP8's e8m0 scales (uint8 biased exponents) as
    the powers of two they are (`mx_scale`); any other tensor as it is."""
    if name.endswith(".weight_scale_inv"):
        name = name[: -len("_inv")]
    if name.endswith(".weight_scale") and tensor.dim() == 4 and tensor.shape[1] == tensor.shape[3] == 1:
        tensor = tensor[:, 0, :, 0]
    if name.endswith(".weight_scale") and tensor.dtype in E8M0:
        tensor = mx_scale(tensor)
    return name, tensor


# an MX format's scale types: e8m0 as its bytes (how compressed-tensors and ModelOpt store it) or as torch's
E8M0 = tuple(t for t in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if t is not None)


def mx_scale(exponents: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (a power of two's exponent biased by 127; 255 is NaN, as the OCP MX format has it) as
    float32."""
    e = exponents.contiguous().view(torch.uint8).float()
    return torch.where(e == 255, float("nan"), torch.exp2(e - 127))


def activation_group(k: int, k_group: int) -> int:
    """Columns per dynamic activation scale of a layer with `k` inputs: the weight's block width (k_group;
    0: none, then `ACT_GROUP`), at most K rounded up to a power of two (>= 16, the kernel's smallest step)."""
    return min(k_group or ACT_GROUP, max(16, 1 << (k - 1).bit_length()))


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 q and float32 scales [M, ceil(K / group)], x ~ q * scale per row and `group`
    columns, scale = the group's largest |x| / 448 (the kernel's rounding, in torch)."""
    m, k = x.shape
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)
    scale = (xf.abs().amax(dim=-1).clamp_min(1e-12)) / FP8_MAX
    q = (xf / scale[..., None]).to(FP8).view(m, -1)[:, :k]
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, rows_per_scale: int, k_group: int) -> torch.Tensor:
    """The float32 weight of e4m3 `q` [N, K] and its `scale` (k_group 0: one column of scales for all K)."""
    n, k = q.shape
    s = scale.float().repeat_interleave(rows_per_scale, 0)[:n]
    s = s.expand(n, k) if k_group == 0 else s.repeat_interleave(k_group, 1)[:, :k]
    return q.float() * s


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as e4m3 and one float32 scale per row [N, 1] (its largest |w| / 448)."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as e4m3 and one float32 scale per `block` [ceil(N / rows), ceil(K / cols)]
    (a checkpoint's layout, for tests and benchmarks)."""
    n, k = w.shape
    br, bc = block
    wp = torch.nn.functional.pad(w.float(), (0, -k % bc, 0, -n % br))
    tiles = wp.view(wp.shape[0] // br, br, wp.shape[1] // bc, bc)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(wp.shape)[:n, :k].contiguous(), scale


def rounded_inputs(x: torch.Tensor, act_group: int) -> torch.Tensor:
    """x [..., K] through e4m3 and back (float32) as the kernels round it, per row and `act_group` columns."""
    q, s = quantize_groups(x.reshape(-1, x.shape[-1]), act_group)
    return dequantize(q, s, 1, act_group).view(x.shape)


def reference_linear(
    x: torch.Tensor, w: torch.Tensor, act_group: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """The CPU path: x rounded as the kernel rounds it, times the dequantized float32 weight `w`."""
    y = rounded_inputs(x, act_group).reshape(-1, x.shape[-1]) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


class Fp8LinearMethod:
    """`y = x W^T + b` with the layer's e4m3 `weight` and float32 `weight_scale` (see the module's
    docstring); the Triton kernel on CUDA, the reference on the CPU."""

    def __init__(
        self, layer: Any, spec: QuantSpec, rows_per_scale: int, k_group: int, act_group: int
    ) -> None:
        self.name, self.quant_method = spec.label, spec.name
        if layer.weight.device.type == "cuda" and env.FP8_DECODE.get() == "fp16":
            self.name += ", W8A16 at decode"  # (the start-up line says so: not the rows' W8A8 bits)
        self.rows_per_scale, self.k_group, self.act_group = rows_per_scale, k_group, act_group
        self.out_features = layer.weight.shape[0]
        self.dequantized: torch.Tensor | None = None
        if layer.weight.device.type == "cpu":
            self.dequantized = dequantize(layer.weight, layer.weight_scale, rows_per_scale, k_group)

    def apply(
        self, layer: Any, x: torch.Tensor, gated: str | None = None, norm: PendingNorm | None = None
    ) -> torch.Tensor:
        """`gated` (where `takes_gated`): x is a gated activation's input, [..., 2K] = [gate, up], and the
        layer's input act(gate) * up, which the GEMV makes as it loads it. `norm` (where `takes_norm`): x
        is `norm.x`, and the layer's input its RMSNorm, which the GEMV makes as it loads it."""
        bias = getattr(layer, "bias", None)
        if self.dequantized is not None:
            if gated is not None or norm is not None:
                raise ValueError("the CPU's FP8 reference takes x, not an activation's or norm's input")
            return reference_linear(x, self.dequantized, self.act_group, bias)
        from gapless.model.quant.fp8_kernel import fp8_gemm

        x2 = x.reshape(-1, x.shape[-1])
        rounded = rounding_of(x, self.act_group)  # (x rounded already by the kernel that wrote it)
        y = fp8_gemm(
            x2,
            layer.weight,
            layer.weight_scale,
            self.rows_per_scale,
            self.k_group,
            self.act_group,
            bias,
            None if rounded is None else rounded[:2],
            gated,
            norm,
        )
        return y.view(*x.shape[:-1], self.out_features)

    def takes_gated(self, layer: Any, rows: int) -> bool:
        """Whether `apply` takes x of `rows` rows as a gated activation's input (`fp8_kernel.takes_gated`:
        the one-row GEMV), so that no activation launch comes before the layer; not on the CPU."""
        if self.dequantized is not None:
            return False
        from gapless.model.quant.fp8_kernel import takes_gated

        return takes_gated(rows, *layer.weight.shape)

    def takes_norm(self, layer: Any, rows: int) -> bool:
        """Whether `apply` takes x of `rows` rows as an RMSNorm's input (`fp8_kernel.takes_norm`: the
        one-row GEMV), so that no norm launch comes before the layer; not on the CPU."""
        if self.dequantized is not None:
            return False
        from gapless.model.quant.fp8_kernel import takes_norm

        return takes_norm(rows, *layer.weight.shape)

    def input_rounding(self, layer: Any, rows: int) -> int:
        """`act_group` where the GEMM would round x of `rows` rows before its loop (`rounds_before`), for
        the kernel before the layer to do it instead; 0 elsewhere and on the CPU (the reference)."""
        if self.dequantized is not None:
            return 0
        from gapless.model.quant.fp8_kernel import rounds_before

        return self.act_group if rounds_before(rows, *layer.weight.shape) else 0

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.dequantized is None else [self.dequantized]  # weight and scale are parameters


def _whole_shape(layer: _Linear, shard: Any) -> tuple[int, int]:
    """(rows, columns) of the checkpoint weight that `shard` of `layer` fills, before tensor parallelism
    cuts it."""
    n, k = layer.weight.shape
    if isinstance(layer, MergedColumnParallelLinear):
        n = (
            layer.checkpoint_offsets[shard][1]
            if shard is not None
            else sum(layer.output_sizes) * layer.tp.size
        )
    elif isinstance(layer, ColumnParallelLinear):
        n *= layer.tp.size
    elif isinstance(layer, RowParallelLinear):
        k *= layer.tp.size
    return n, k


def _expand_scale(
    layer: _Linear, spec: QuantSpec, name: str, loaded: torch.Tensor, shard: Any
) -> torch.Tensor:
    """A checkpoint scale as [rows of its weight, column groups] float32, or a one-line error."""
    n, k = _whole_shape(layer, shard)
    if spec.weight_block is None:
        s = loaded.float().reshape(-1, 1)
        if s.shape[0] == 1:
            return s.expand(n, 1).contiguous()
        if s.shape[0] != n:
            raise QuantFormatError(
                f"{name}: scale of shape {tuple(loaded.shape)} fits no per-row or per-tensor scale "
                f"of a {n}x{k} weight"
            )
        return s
    br, bc = spec.weight_block
    want = (-(-n // br), -(-k // bc))
    if tuple(loaded.shape) != want:
        raise QuantFormatError(
            f"{name}: scale of shape {tuple(loaded.shape)}, expected {want} for a {n}x{k} weight "
            f"in {br}x{bc} blocks"
        )
    return loaded.float().repeat_interleave(br, 0)[:n].contiguous()


def _scale_param(layer: _Linear, spec: QuantSpec, module_name: str) -> nn.Parameter:
    n, k = layer.weight.shape
    cols = 1 if spec.weight_block is None else -(-k // spec.weight_block[1])
    param = nn.Parameter(
        torch.empty(n, cols, dtype=torch.float32, device=layer.weight.device), requires_grad=False
    )

    def load(p: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        full = _expand_scale(layer, spec, f"{module_name}.weight_scale", loaded, shard)
        if isinstance(layer, RowParallelLinear) and spec.weight_block is None:
            default_weight_loader(p, full)  # one scale per output row: every rank holds all rows
        else:
            layer.load_shard(p, full, shard)

    return set_weight_loader(param, load)


def usual_targets(model: nn.Module) -> list[str]:
    """The modules FP8 checkpoints quantize, and `--quantization fp8` does: every linear layer but the
    routers (and the LM head, which is no `_Linear`), and every mixture's experts; what `--load-format
    dummy` makes of an FP8 checkpoint's config, which has no tensors to say it."""
    from gapless.model.moe import Experts

    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, _Linear) and not isinstance(m, ReplicatedLinear) or isinstance(m, Experts)
    ]


def quantized_modules(model: nn.Module, spec: QuantSpec, targets: set[str]) -> list[str]:
    """The modules whose weights the load keeps in fp8: those the checkpoint gives scales for (`targets`,
    module names; a mixture's experts, `...experts.3.gate_proj`, as their layer's `Experts`), or with
    `online` every linear layer but the routers and every mixture's experts (the LM head stays float, as
    in vLLM). One line refuses a quantized LM head or embedding."""
    from gapless.model.moe import Experts

    experts = [name for name, m in model.named_modules() if isinstance(m, Experts)]
    if spec.online:
        return usual_targets(model)
    # the checkpoint's experts' scales: each mixture layer's experts, all of them, in fp8
    expert_targets = {t for t in targets if t in experts or ".experts." in t}
    targets = targets - expert_targets
    for name in sorted(targets):
        module = model.get_submodule(name)
        if isinstance(module, ParallelLMHead) or not isinstance(module, _Linear):
            raise QuantFormatError(
                f"quantization {spec.name}: {name} ({type(module).__name__}) in fp8 is not run"
            )
    if not targets and not expert_targets:
        raise QuantFormatError(
            f"quantization {spec.name}: the checkpoint has no weight scales ({', '.join(SCALE_NAMES)})"
        )
    return sorted(targets) + (experts if expert_targets else [])


def prepare(model: nn.Module, spec: QuantSpec, modules: list[str]) -> None:
    """Before loading: give each module of `modules` an e4m3 weight and a float32 `weight_scale`
    parameter, each loaded by the layer's rules (an online load keeps its float weight until `finish`);
    a mixture's experts theirs (`Experts.prepare_fp8`)."""
    from gapless.model.moe import Experts

    for name in modules:
        layer: Any = model.get_submodule(name)
        if spec.online:
            continue
        if isinstance(layer, Experts):
            layer.prepare_fp8(spec.weight_block, spec.label)
            continue
        n, k = layer.weight.shape
        if spec.weight_block is not None:
            bc = spec.weight_block[1]
            if isinstance(layer, RowParallelLinear) and layer.tp.size > 1 and k % bc:
                raise QuantFormatError(
                    f"quantization {spec.name}: {name}'s {k} input columns per rank split its "
                    f"{bc}-wide scale blocks"
                )
        weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=layer.weight.device), requires_grad=False)
        layer.weight = set_weight_loader(weight, layer.load_shard)
        layer.weight_scale = _scale_param(layer, spec, name)


def finish_module(layer: Any, spec: QuantSpec) -> None:
    """Quantize an online load's float weights by rows (freeing them), store block scales per block where
    their rows repeat, and install `Fp8LinearMethod`; a mixture's experts quantized by rows (online) or
    given their CPU reference's float weights."""
    from gapless.model.moe import Experts

    if isinstance(layer, Experts):
        if spec.online:
            layer.quantize_fp8(spec.label)
        else:
            layer.finish_fp8()
        return
    if spec.online:
        q, s = quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(s, requires_grad=False)
    rows_per_scale, k_group = 1, 0
    if spec.weight_block is not None:
        br, bc = spec.weight_block
        k_group = bc
        s = layer.weight_scale.data
        n = s.shape[0]
        if n % br == 0 and torch.equal(s.view(n // br, br, -1), s[::br, None].expand(n // br, br, -1)):
            layer.weight_scale = nn.Parameter(s[::br].contiguous(), requires_grad=False)
            rows_per_scale = br
    act_group = activation_group(layer.weight.shape[1], k_group)
    layer.linear_method = Fp8LinearMethod(layer, spec, rows_per_scale, k_group, act_group)


def finish(model: nn.Module, spec: QuantSpec, modules: list[str], done: Collection[str] = ()) -> None:
    """After loading: `finish_module` on each of `modules` but those `done` (an online load's loader
    finishes each layer as its last float tensor loads, so one layer's float weight is held at a time)."""
    from gapless.model.moe import Experts

    experts = 0
    for name in modules:
        layer: Any = model.get_submodule(name)
        experts += isinstance(layer, Experts)
        if name not in done:
            finish_module(layer, spec)
    log.info(
        "fp8 weights (%s) in %d layers and %d experts' layers", spec.label, len(modules) - experts, experts
    )
