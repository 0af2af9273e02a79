"""The mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): a router picks `top_k` of `E`
expert MLPs per token, and the token's output is their routing-weighted sum (plus, in Qwen2-MoE, a
shared expert behind a sigmoid gate).

Routing is transformers' own: softmax over the router logits in fp32, top-k, renormalised to sum 1 where
the config asks (`norm_topk_prob`; Mixtral always), then cast to the model's dtype (Qwen, OLMoE) or kept
in fp32 (Mixtral), which decides where a bf16 product rounds.

Two ways to run the experts, with the same weights ([E, 2I, H] gate/up, [E, H, I] down, loaded from the
checkpoint's per-expert tensors):
- `reference_experts`: transformers' loop over the experts that got tokens, on the CPU (it gathers each
  expert's tokens with host-side indices, which on a GPU would wait for the device);
- `gapless.model.moe_triton.fused_experts`: tokens sorted by expert and one grouped-GEMM Triton kernel,
  with no host reads, on CUDA.

Quantized experts (`WeightQuant`): fp8 (e4m3 with float32 scales, a checkpoint's or `--quantization fp8`;
W8A8, the activations rounded to e4m3 per row and group of columns as the dense FP8 layers round them)
and int4/int8 weight-only (an AWQ, GPTQ or compressed-tensors checkpoint's, packed as
`gapless.model.quant.int4_experts.install_experts` stacks them); the grouped GEMM takes e4m3 tiles as they are
and dequantizes integer ones, and on the CPU the reference loop multiplies with the weights dequantized
once at load (fp8: x rounded as the kernel rounds it), or (int4 in groups of 32-256, int8 per row) runs
each expert's torch CPU kernel (`ExpertWeights`).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gapless.model import parallel
from gapless.model.config import ModelConfig
from gapless.model.layers import GATED_ACTIVATIONS, ReplicatedLinear, new_weight, set_weight_loader
from gapless.model.quant.base import WeightKernel

# per-expert checkpoint tensors: `...mlp.experts.3.gate_proj.weight` (Qwen, OLMoE) or
# `...block_sparse_moe.experts.3.w1.weight` (Mixtral: w1 gate, w3 up, w2 down), and an fp8 checkpoint's
# `weight_scale` beside each (the loader renames fp8's `weight_scale_inv` so)
_EXPERT_NAME = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale)$")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class WeightQuant(NamedTuple):
    """How one stacked expert weight is quantized, as the grouped GEMM reads it. e4m3 (bits 0): W [E, rows,
    K] with float32 `scales` [E, rows, column blocks] of `group` columns (group K: per row), its inputs
    rounded to e4m3 per row and `act_group` columns (W8A8; 0: `fp8.activation_group` of `group`, or of
    none where it spans K). int4/int8
    (`bits`): W [E, K / P, rows] int32 words, P = 32 / bits values packed along K (value k at bits
    `bits * (k % P)`), `scales` and `zeros` [E, K / group, rows] in the model's dtype, W[e, row, k] =
    (q - zero) * scale: each expert as `gapless.model.quant.int4_triton`'s layout; with `levels` (a
    codebook's, float32 [2^bits]) `levels[q] * scale`, no zeros. `order` (act-order: int32 [E, K]): expert
    e's column k reads input `order[e, k]`, its groups contiguous in that order; None: input k."""

    scales: torch.Tensor
    group: int
    zeros: torch.Tensor | None = None
    bits: int = 0
    levels: torch.Tensor | None = None
    act_group: int = 0
    order: torch.Tensor | None = None


def checkpoint_target(name: str) -> tuple[str, Any] | None:
    """Where a checkpoint tensor of an MoE layer goes: (parameter name, shard id) for one expert's
    projection, the renamed router for Mixtral's `block_sparse_moe.gate`; None for any other tensor."""
    m = _EXPERT_NAME.match(name)
    if m and m.group(3) in _PROJ:
        prefix, expert, proj = m.group(1), int(m.group(2)), _PROJ[m.group(3)]
        param = ("down" if proj == "down" else "gate_up") + ("_proj" if m.group(4) == "weight" else "_scale")
        return f"{prefix}.mlp.experts.{param}", (expert, proj)
    if ".block_sparse_moe." in name:
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [T, top_k], from router logits [T, E], as transformers routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), ids


# a projection's weights for the CPU's loop: every expert's stacked [E, out, in] (float), or each expert's
# kernel (torch's CPU ones: `gapless.model.quant.int4_kernels.library_kernel`)
ExpertWeights = torch.Tensor | list[WeightKernel]


def _project(x: torch.Tensor, w: torch.Tensor | WeightKernel, act_group: int) -> torch.Tensor:
    """x W^T; `act_group` (e4m3 experts, W8A8): x rounded to e4m3 per row and that many columns first, as
    the grouped GEMM rounds it, times the float32 dequantized W (`fp8.reference_linear`)."""
    if not isinstance(w, torch.Tensor):
        return w(x).to(x.dtype)
    if act_group:
        from gapless.model.quant.fp8 import reference_linear

        return reference_linear(x, w, act_group, None)
    return F.linear(x, w)


def reference_experts(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: Any = None,
    act_groups: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The experts as transformers runs them: for each expert with tokens, in order, its MLP on its
    tokens, times their routing weights, added into the output in the model's dtype (`w13`, `w2`: the
    stacked float weights, or each expert's kernel). `lora`: the layer's resident adapters
    (`gapless.lora.table.ExpertLoRA`), each projection's delta added to its output (reading its input
    unrounded). `act_groups`: e4m3 experts' (W8A8) gate/up's and down's inputs rounded per that many
    columns (`_project`)."""
    out = torch.zeros_like(x)
    act = GATED_ACTIVATIONS["silu"]
    entry_slots = lora.entry_slots(ids) if lora is not None else None
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        xe = x[token]
        slots = entry_slots[token * ids.shape[1] + slot] if entry_slots is not None else None
        gate_up = _project(xe, w13[expert], act_groups[0])
        if slots is not None:
            gate_up = lora.add("gate_up_proj", gate_up, xe, slots)
        h = act(gate_up)
        y = _project(h, w2[expert], act_groups[1])
        if slots is not None:
            y = lora.add("down_proj", y, h, slots)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


class Experts(nn.Module):
    """All experts' weights of one layer, stacked: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]
    (int4/int8: packed, `WeightQuant`'s layout). Each checkpoint tensor of expert e loads into its slice
    (shard id (e, "gate" | "up" | "down"))."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        # tensor parallelism splits every expert by its width, as a dense MLP: each rank holds its piece
        # of every expert's gate/up rows and down columns, and the experts' output is all-reduced
        self.tp = parallel.current()
        inter //= self.tp.size
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = set_weight_loader(new_weight(num_experts, 2 * inter, hidden), self.load_shard)
        self.down_proj = set_weight_loader(new_weight(num_experts, hidden, inter), self.load_shard)
        self.use_triton: bool | None = None  # None: by device (CUDA: fused Triton); tests force either
        # the experts' resident LoRA adapters (`gapless.lora.table.ExpertLoRA`), when LoRA is enabled
        self.lora: Any = None
        # fp8 (`quantize_fp8`, `prepare_fp8`): e4m3 weights' float32 scales, [E, rows, column blocks]
        # (one block of all K: per row) with the blocks' width, and (on the CPU) the float32 weights the
        # reference path multiplies with
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        self.scale_cols = (0, 0)  # gate_up's, down's columns per scale block
        # gate_up's, down's activation columns per dynamic e4m3 scale (W8A8: `fp8.activation_group`)
        self.act_groups = (0, 0)
        self.scale_block: tuple[int, int] | None = None  # a checkpoint's [rows, cols] scale blocks
        self.quant_label = ""
        self.quant_method = ""  # (int experts': their format's family, as a linear method's `quant_method`)
        # (on the CPU) what the reference loop multiplies with: gate/up's and down's weights dequantized at
        # load, or each expert's kernel (`hold_int`)
        self.cpu_weights: tuple[ExpertWeights, ExpertWeights] | None = None
        # int4/int8 (`hold_int`): gate/up's and down's quantization, the parameters then packed words
        self.int_quant: tuple[WeightQuant, WeightQuant] | None = None
        # int act-order experts (`hold_int`): [E, I] int64, the whole intermediate's column j being the
        # checkpoint's column inter_order[e, j] (gate/up rows and down columns taken so at load); LoRA's
        # expert adapters are taken in it (`gapless.lora.shard`). None: the checkpoint's order
        self.inter_order: torch.Tensor | None = None

    def checkpoint_shards(self, param: str) -> list[tuple[int, str]]:
        """The shard ids that together fill `param` (the loader checks that none is missing)."""
        projs = ("down",) if param.startswith("down") else ("gate", "up")
        return [(e, p) for e in range(self.num_experts) for p in projs]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, proj = shard_id
        target = param.data[expert]
        if proj != "down":
            target = target.narrow(0, 0 if proj == "gate" else self.inter, self.inter)
        if param is self.gate_up_scale or param is self.down_scale:
            loaded = self._scale_rows(loaded, proj, target.shape)
        loaded = self.tp.part(loaded, self.tp.size, dim=1 if proj == "down" else 0)
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} {proj} weight {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def _scale_rows(self, loaded: torch.Tensor, proj: str, local: torch.Size) -> torch.Tensor:
        """A checkpoint scale of one expert's projection as one row per weight row of the whole
        projection, [rows, column blocks] float32 (a per-tensor scale repeated; a block scale's rows
        repeated per block), for the rank's cut; a one-line error where its shape fits nothing."""
        from gapless.model.quant.formats import QuantFormatError

        rows = local[0] * (1 if proj == "down" else self.tp.size)
        cols = local[1] * (self.tp.size if proj == "down" else 1)
        s = loaded.float().reshape(loaded.shape[0] if loaded.dim() else 1, -1)
        if self.scale_block is None and (s.numel() == 1 or s.shape == (rows, 1)):
            return s.expand(rows, cols).contiguous()  # per tensor, per row: one column block
        br = self.scale_block[0] if self.scale_block is not None else 0
        if not br or s.shape != (-(-rows // br), cols):
            raise QuantFormatError(
                f"expert {proj} scale of shape {tuple(loaded.shape)} fits no per-tensor, per-row or block "
                f"scale of this model's {rows}-row expert weights"
            )
        return s.repeat_interleave(br, 0)[:rows].contiguous()

    def prepare_fp8(self, block: tuple[int, int] | None, label: str) -> None:
        """Before an fp8 checkpoint loads: e4m3 weight parameters and their scales', [E, rows, column
        blocks] (`block` [rows, cols]: each block's scale repeated over its rows; None: one per row or
        tensor), loaded per expert as the weights are. Refuses, in one line, blocks that tensor
        parallelism's cut would split."""
        from gapless.model.quant.formats import QuantFormatError

        e, hidden, inter = self.num_experts, self.gate_up_proj.shape[2], self.inter
        bc = block[1] if block is not None else 0  # (a power of two >= 16: `QuantSpec`)
        if block is not None and self.tp.size > 1 and (inter % block[0] or inter % bc):
            raise QuantFormatError(
                f"fp8 experts: {inter} columns per rank split the checkpoint's {block[0]}x{bc} scale blocks"
            )
        dev, self.scale_block = self.gate_up_proj.device, block
        for name, (rows, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
            weight = nn.Parameter(
                torch.empty(e, rows, k, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False
            )
            setattr(self, f"{name}_proj", set_weight_loader(weight, self.load_shard))
            cols = -(-k // bc) if bc else 1
            scale = nn.Parameter(
                torch.empty(e, rows, cols, dtype=torch.float32, device=dev), requires_grad=False
            )
            setattr(self, f"{name}_scale", set_weight_loader(scale, self.load_shard))
        self.scale_cols = (bc or hidden, bc or inter)
        self._w8a8(bc, label)

    def _w8a8(self, block_cols: int, label: str) -> None:
        """e4m3 experts' activation groups (each projection's, of its own inputs) and label."""
        from gapless.model.quant.fp8 import activation_group

        k13, k2 = self.gate_up_proj.shape[2], self.down_proj.shape[2]
        self.act_groups = (activation_group(k13, block_cols), activation_group(k2, block_cols))
        self.quant_label = f"{label} experts"

    def finish_fp8(self) -> None:
        """After the e4m3 weights are in: on the CPU, the float32 dequantized weights the reference path
        multiplies with."""
        if self.gate_up_proj.device.type != "cpu":
            return
        assert self.gate_up_scale is not None and self.down_scale is not None
        pairs = (
            (self.gate_up_proj, self.gate_up_scale, self.scale_cols[0]),
            (self.down_proj, self.down_scale, self.scale_cols[1]),
        )
        dq = []
        for w, s, bc in pairs:
            full = s.repeat_interleave(bc, 2)[..., : w.shape[2]]
            dq.append(w.float() * full)
        self.cpu_weights = (dq[0], dq[1])

    def hold_int(
        self,
        packed: tuple[torch.Tensor, torch.Tensor],
        quant: tuple[WeightQuant, WeightQuant],
        cpu_weights: tuple[ExpertWeights, ExpertWeights] | None,
        label: str,
        method: str = "",
        inter_order: torch.Tensor | None = None,
    ) -> None:
        """Hold int4/int8 experts (`gapless.model.quant.int4_experts.install_experts` makes them): gate/up's
        and down's packed words (`WeightQuant`'s layout) in place of the float weights, and on the CPU what
        the reference loop multiplies with (`cpu_weights`: the dequantized float weights, or each expert's
        kernel); `method`: their format's family (`quant_method`); `inter_order`: the intermediate's order
        where act-order reordered it (`inter_order`)."""
        self.gate_up_proj, self.down_proj = (nn.Parameter(w, requires_grad=False) for w in packed)
        self.int_quant, self.cpu_weights, self.quant_label = quant, cpu_weights, f"{label} experts"
        self.quant_method, self.inter_order = method, inter_order

    @property
    def weight_format(self) -> str | None:
        """The experts' weight format for the start-up line when it is not the model's dtype."""
        return self.quant_label or None

    def side_tensors(self) -> list[torch.Tensor]:
        """The tensors held beside the parameters: int scales and zeros (or levels), the CPU's weights or
        kernels'."""
        quant = [
            t for q in self.int_quant or () for t in (q.scales, q.zeros, q.levels, q.order) if t is not None
        ]
        held: list[torch.Tensor] = []
        for w in self.cpu_weights or ():
            held += [w] if isinstance(w, torch.Tensor) else [t for k in w for t in k.tensors()]
        return quant + held

    def quantize_fp8(self, label: str) -> None:
        """Hold the weights in e4m3 with one float32 scale per expert row (`--quantization fp8` at load,
        after tensor parallelism's cut: each rank scales its own rows), half the bytes of bf16, run W8A8
        as a checkpoint's; on the CPU the reference path multiplies with the dequantized weights, kept
        beside."""
        from gapless.model.quant.fp8 import quantize_rows

        scales = []
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name).data
            q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
            setattr(self, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            scales.append(nn.Parameter(s.view(*w.shape[:2], 1), requires_grad=False))
        self.gate_up_scale, self.down_scale = scales
        self.scale_cols = (self.gate_up_proj.shape[2], self.down_proj.shape[2])
        self._w8a8(0, label)
        self.finish_fp8()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        use_triton = x.is_cuda if self.use_triton is None else self.use_triton
        if use_triton:
            from gapless.model.moe_triton import fused_experts

            scales = self.int_quant
            if self.gate_up_scale is not None and self.down_scale is not None:
                scales = (
                    WeightQuant(self.gate_up_scale, self.scale_cols[0], act_group=self.act_groups[0]),
                    WeightQuant(self.down_scale, self.scale_cols[1], act_group=self.act_groups[1]),
                )
            out = fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.lora, scales)
        else:
            w13, w2 = self.cpu_weights or (self.gate_up_proj, self.down_proj)
            out = reference_experts(x, w13, w2, weights, ids, self.lora, self.act_groups)
        return self.tp.all_reduce(out)


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert, given by the decoder as a dense MLP)."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"mixture-of-experts with hidden_act={cfg.hidden_act!r} is not supported")
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.fp32_weights = cfg.moe == "mixtral"
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.fp32_weights)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
