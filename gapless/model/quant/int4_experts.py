"""A mixture's int4/int8 experts (`...experts.3.gate_proj.qweight`, Mixtral's `w1`/`w3`/`w2`): each
expert's projections, unpacked as any layer's (`gapless.model.quant.int4_layouts`), cut for tensor
parallelism, stacked and packed into the layer's `Experts` (`moe.WeightQuant`'s layout), which the grouped
GEMM (`gapless.model.moe_triton`) unpacks on CUDA; the CPU runs each expert's CPU kernel where one takes it,
else multiplies with them dequantized at load.

Act-order (GPTQ's `desc_act`, compressed-tensors' `actorder: group`) orders each projection's inputs by
group. Down's inputs are the expert's own intermediate width, which any order serves as long as gate/up
write it: so gate's and up's rows are taken in down's order at load, and down becomes a plain grouped weight
(no cost at run time, and tensor parallelism cuts whole groups as without act-order). Gate/up's inputs are
x, every expert's, so the grouped GEMM gathers each K step's columns of x in the expert's order
(`WeightQuant.order`), as the CPU's kernels gather x (`_Gathered`); gate and up of an expert must share it,
as act-order's quantizers give projections that read one input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gapless.model.quant import int4_kernels
from gapless.model.quant.base import WeightKernel
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4 import same_order, split_columns, zeros_dtype
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked, pack_int32


def install_experts(
    experts: Any,
    shards: dict[Any, Unpacked],
    spec: Int4Spec,
    dtype: torch.dtype,
    where: str,
    down_spec: Int4Spec | None = None,
    cut: bool = True,
) -> None:
    """Give a mixture's `Experts` its quantized weights from each expert's projections (shard id
    (expert, "gate" | "up" | "down") -> whole unpacked weight, in `spec`; down in `down_spec` where it
    differs): cut for this rank as the float experts are (gate/up by rows, down by columns: whole groups
    per rank; not `cut`: already this rank's), stacked, packed (`moe.WeightQuant`'s layout), zeros held as
    `zeros_dtype` says, and on the CPU, for the reference loop, each expert's torch CPU kernel where `auto`
    gives one (`int4_kernels.for_layer`: then the packed words are not kept), else the weights dequantized
    beside. Act-order is taken in first (`_in_expert_order`)."""
    from gapless.model.moe import WeightQuant

    tp, e_count, inter = experts.tp, experts.num_experts, experts.inter
    hidden = experts.gate_up_proj.shape[2]
    want = [s for p in ("gate_up_proj", "down_proj") for s in experts.checkpoint_shards(p)]
    missing = [s for s in want if s not in shards]
    if missing:
        raise QuantFormatError(
            f"{where}: the checkpoint quantizes only some experts' projections: {missing[:4]}"
        )
    if hidden % 16 or inter % 16:
        raise QuantFormatError(
            f"{where}: {spec.label} experts of {hidden} x {inter} inputs: not multiples of 16"
        )

    orders = _in_expert_order(shards, e_count, where)
    shards = orders.shards

    def mine(e: int, proj: str) -> Unpacked:
        w = shards[(e, proj)]
        if tp.size > 1 and proj == "down":
            return split_columns(w, tp, f"{where}: expert {e} down's")
        return w.map(lambda t: tp.part(t, tp.size)) if tp.size > 1 else w

    def stacked(e: int, projs: tuple[str, ...]) -> Unpacked:
        parts = [mine(e, p) if cut else shards[(e, p)] for p in projs]
        q, scale, zero = map(torch.cat, zip(*(p.tensors for p in parts)))
        return Unpacked(q, scale, zero, parts[0].order, parts[0].levels)  # (gate's order is up's)

    device = experts.gate_up_proj.device
    cpu = device.type == "cpu"
    specs = (spec, down_spec or spec)
    projections = ((("gate", "up"), (2 * inter, hidden)), (("down",), (hidden, inter)))
    # each projection's experts as this rank holds them, and their group (one a row where a rank's cut
    # splits a row's one group)
    held_ws = [[stacked(e, projs) for e in range(e_count)] for projs, _ in projections]
    # a codebook's (`Unpacked.levels`) the same for every expert's gate, up (and down) alike
    levels = [ws[0].levels for ws in held_ws]
    for projs, _ in projections:
        ws = [shards[(e, p)] for e in range(e_count) for p in projs]
        if not all(same_order(w.levels, ws[0].levels) for w in ws):
            raise QuantFormatError(f"{where}: its experts' {'/'.join(projs)} codebooks differ; one is built")
    groups = [shape[1] // ws[0].scale.shape[1] for ws, (_, shape) in zip(held_ws, projections)]
    choice = int4_kernels.chosen()
    kinds = [  # (no library takes a codebook)
        int4_kernels.for_layer(choice if lv is None else "triton", sp.bits, g, dtype, *s, device)
        for sp, g, lv, (_, s) in zip(specs, groups, levels, projections)
    ]
    kernels_alone = all(k == int4_kernels.CPU_KERNEL for k in kinds)  # (then no packed words are kept)
    packed, quants, cpu_weights = [], [], []
    held_orders = (None if orders.inputs is None else orders.inputs.to(device), None)
    for sp, ws, group, lv, (projs, shape), kernel, order in zip(
        specs, held_ws, groups, levels, projections, kinds, held_orders
    ):
        qs, scales, zeros, floats, kernels = [], [], [], [], []
        zero_dtype = zeros_dtype([w.zero for w in ws], dtype)
        for e, w in enumerate(ws):
            if w.q.shape != shape:
                raise QuantFormatError(
                    f"{where}: expert {e} {'/'.join(projs)} weight {tuple(w.q.shape)} does not fit {shape}"
                )
            # scales and zeros as held, so the CPU's weights are the kernel's
            held = Unpacked(w.q, w.scale.to(dtype), w.zero.to(zero_dtype), w.order, lv)  # (floats: x's order)
            if not kernels_alone:
                qs.append(pack_int32(w.q.t(), sp.bits, dim=0))
            scales.append(held.scale.t().contiguous())
            zeros.append(held.zero.t().contiguous())
            if kernel == int4_kernels.CPU_KERNEL:  # (act-order: x's columns gathered in the weight's order)
                k = int4_kernels.library_kernel(kernel, w, sp.bits, dtype, device, sp.label)
                kernels.append(k if w.order is None else _Gathered(k, w.order.to(device)))
            elif cpu:
                floats.append(
                    held._replace(scale=held.scale.float(), zero=held.zero.float()).dequantize().to(dtype)
                )
        packed.append(torch.stack(qs) if qs else torch.empty(0, dtype=torch.int32, device=device))
        held_levels = None if lv is None else lv.float().to(device)
        held_zeros = torch.stack(zeros) if lv is None else None  # (a codebook's are 0: not held)
        quants.append(WeightQuant(torch.stack(scales), group, held_zeros, sp.bits, held_levels, order=order))
        cpu_weights.append(kernels or (torch.stack(floats) if cpu else None))
    label = spec.label if specs[1] == spec else f"{spec.label}, down {specs[1].label}"
    label += f" ({int4_kernels.CPU_KERNEL})" if kernels_alone else ""
    experts.hold_int(
        (packed[0], packed[1]),
        (quants[0], quants[1]),
        tuple(cpu_weights) if cpu else None,
        label,
        spec.method,
        orders.inter,
    )


class _Gathered:
    """An act-order expert's CPU kernel (`WeightKernel`, its weight's columns in the expert's order): x's
    columns gathered in that order first, as an act-order layer gathers them."""

    def __init__(self, kernel: WeightKernel, order: torch.Tensor) -> None:
        self.kernel, self.order = kernel, order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.index_select(1, self.order))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.kernel.tensors(), self.order]


class _Orders(NamedTuple):
    """What `_in_expert_order` made of the experts' act-orders."""

    shards: dict[Any, Unpacked]  # gate/up's rows in down's order, down's with none
    inputs: torch.Tensor | None  # gate/up's [E, H] int32: expert e's column k reads x[:, inputs[e, k]]
    inter: torch.Tensor | None  # [E, I] int64: the intermediate's column j is the checkpoint's inter[e, j]


def _in_expert_order(shards: dict[Any, Unpacked], e_count: int, where: str) -> _Orders:
    """The experts' act-orders taken in (the module's docstring): each expert's down order moved onto its
    gate and up rows; gate/up's own (over x) returned stacked, refused in one line where an expert's gate
    and up differ. Each None where no expert has one."""
    out, inputs, inter = dict(shards), [], []
    for e in range(e_count):
        gate, up, down = (shards[(e, p)] for p in ("gate", "up", "down"))
        if not same_order(gate.order, up.order):
            raise QuantFormatError(
                f"{where}: expert {e}'s gate and up act-orders (g_idx) differ; one order an expert is built"
            )
        rows = down.order
        if rows is not None:
            out[(e, "gate")], out[(e, "up")] = gate.rows_in(rows), up.rows_in(rows)
            out[(e, "down")] = down._replace(order=None)
        inputs.append((gate.order, gate.q.shape[1]))
        inter.append((rows, down.q.shape[1]))

    def stacked(orders: list[tuple[torch.Tensor | None, int]], dtype: torch.dtype) -> torch.Tensor | None:
        if all(o is None for o, _ in orders):
            return None
        return torch.stack([torch.arange(k) if o is None else o.cpu() for o, k in orders]).to(dtype)

    return _Orders(out, stacked(inputs, torch.int32), stacked(inter, torch.int64))
