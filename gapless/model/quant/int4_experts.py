"""A mixture's int4/int8 experts (`...experts.3.gate_proj.qweight`, Mixtral's `w1`/`w3`/`w2`): each
expert's projections, unpacked as any layer's (`gapless.model.quant.int4_layouts`), cut for tensor
parallelism, stacked and packed into the layer's `Experts` (`moe.WeightQuant`'s layout), which the grouped
GEMM (`gapless.model.moe_triton`) unpacks on CUDA; the CPU runs each expert's CPU kernel where one takes it,
else multiplies with them dequantized at load.
"""

from __future__ import annotations

from typing import Any

import torch

from gapless.model.quant import int4_kernels
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
    beside."""
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

    if any(w.order is not None for w in shards.values()):
        raise QuantFormatError(f"{where}: experts with act-order (g_idx) are not built")

    def mine(e: int, proj: str) -> Unpacked:
        w = shards[(e, proj)]
        if tp.size > 1 and proj == "down":
            return split_columns(w, tp, f"{where}: expert {e} down's")
        return w.map(lambda t: tp.part(t, tp.size)) if tp.size > 1 else w

    def stacked(e: int, projs: tuple[str, ...]) -> Unpacked:
        parts = [mine(e, p) if cut else shards[(e, p)] for p in projs]
        q, scale, zero = map(torch.cat, zip(*(p.tensors for p in parts)))
        return Unpacked(q, scale, zero, levels=parts[0].levels)

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
    for sp, ws, group, lv, (projs, shape), kernel in zip(specs, held_ws, groups, levels, projections, kinds):
        qs, scales, zeros, floats, kernels = [], [], [], [], []
        zero_dtype = zeros_dtype([w.zero for w in ws], dtype)
        for e, w in enumerate(ws):
            if w.q.shape != shape:
                raise QuantFormatError(
                    f"{where}: expert {e} {'/'.join(projs)} weight {tuple(w.q.shape)} does not fit {shape}"
                )
            # scales and zeros as held, so the CPU's weights are the kernel's
            held = Unpacked(w.q, w.scale.to(dtype), w.zero.to(zero_dtype), levels=lv)
            if not kernels_alone:
                qs.append(pack_int32(w.q.t(), sp.bits, dim=0))
            scales.append(held.scale.t().contiguous())
            zeros.append(held.zero.t().contiguous())
            if kernel == int4_kernels.CPU_KERNEL:
                kernels.append(int4_kernels.library_kernel(kernel, w, sp.bits, dtype, device, sp.label))
            elif cpu:
                floats.append(
                    held._replace(scale=held.scale.float(), zero=held.zero.float()).dequantize().to(dtype)
                )
        packed.append(torch.stack(qs) if qs else torch.empty(0, dtype=torch.int32, device=device))
        held_levels = None if lv is None else lv.float().to(device)
        held_zeros = torch.stack(zeros) if lv is None else None  # (a codebook's are 0: not held)
        quants.append(WeightQuant(torch.stack(scales), group, held_zeros, sp.bits, held_levels))
        cpu_weights.append(kernels or (torch.stack(floats) if cpu else None))
    label = spec.label if specs[1] == spec else f"{spec.label}, down {specs[1].label}"
    label += f" ({int4_kernels.CPU_KERNEL})" if kernels_alone else ""
    experts.hold_int(
        (packed[0], packed[1]),
        (quants[0], quants[1]),
        tuple(cpu_weights) if cpu else None,
        label,
        spec.method,
    )
