"""An adapter's weights cut for one tensor-parallel rank, as the layer it adapts is cut.

A column-parallel layer (q/k/v, gate/up: output split over the ranks) keeps A whole and B's rows for its
own output pieces, each fused shard cut as the layer cuts its weight (KV heads fewer than ranks: the piece
its queries read, shared). A row-parallel layer (o, down: input split) keeps A's columns for its input
piece and B whole: each rank's delta B (A_rank x_rank) is a partial sum, added before the layer's
all-reduce, which sums it with the other ranks' exactly once. A mixture's experts are cut by their width
(each rank holds its piece of every expert's gate/up rows and down columns): their gate/up LoRA keeps A
whole and B's rows of this rank's gate and up pieces, their down LoRA A's columns of its piece and B
whole, summed by the experts' all-reduce. With one rank nothing is cut. Int act-order MLPs and experts
hold their intermediate width reordered (`_Linear.inter_order`, `Experts.inter_order`): their adapters'
down A columns and gate/up B rows are taken in that order first, on any number of ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gapless.lora.adapter import AdapterWeights, ExpertDelta, LayerShape, ModuleDelta
from gapless.model.layers import MergedColumnParallelLinear, RowParallelLinear


class RankShape(NamedTuple):
    """An adapted layer's widths on this rank: A [.., in_features], B [out_features, ..]."""

    in_features: int
    out_features: int


def rank_shape(shape: LayerShape, layer: object) -> RankShape:
    """The widths of `shape` (the whole layer's) on the rank of `layer` (its piece of the layer); the
    adapted layers are row-parallel or fused column-parallel ones, any other is held whole."""
    if isinstance(layer, RowParallelLinear):
        return RankShape(shape.in_features // layer.tp.size, shape.out_features)
    if isinstance(layer, MergedColumnParallelLinear):
        return RankShape(shape.in_features, sum(layer.output_sizes))
    return RankShape(shape.in_features, shape.out_features)


def rank_delta(d: ModuleDelta, layer: object) -> ModuleDelta:
    """`d` (a module's A and B on the whole layer) cut to what `layer`'s rank holds, its B rows placed
    where that rank's fused weight holds them; an int4 act-order MLP's in its reordered intermediate
    (`_Linear.inter_order`) first."""
    order = getattr(layer, "inter_order", None)
    if order is not None and isinstance(layer, RowParallelLinear):  # (down: A's columns)
        d = d._replace(a=d.a.index_select(1, order))
    elif order is not None and isinstance(layer, MergedColumnParallelLinear):  # (gate/up: each piece's rows)
        b = d.b.clone()
        for off, n in layer.checkpoint_offsets.values():
            if d.row <= off and off + n <= d.row + d.b.shape[0]:
                b[off - d.row : off - d.row + n] = d.b[off - d.row : off - d.row + n].index_select(0, order)
        d = d._replace(b=b)
    if isinstance(layer, RowParallelLinear):
        tp = layer.tp
        return d._replace(a=tp.part(d.a, tp.size, dim=1).contiguous()) if tp.size > 1 else d
    if isinstance(layer, MergedColumnParallelLinear):
        if layer.tp.size == 1:
            return d
        pieces: list[torch.Tensor] = []
        row: int | None = None
        end = d.row + d.b.shape[0]
        for name, (off, n) in layer.checkpoint_offsets.items():
            if off < d.row or off + n > end:  # a shard this module does not write
                continue
            pieces.append(layer.tp.part(d.b[off - d.row : off - d.row + n], layer.shard_parts[name]))
            row = layer.shard_offsets[name][0] if row is None else row
        assert row is not None, f"{d.name}: module rows [{d.row}, {end}) cover none of the layer's shards"
        return d._replace(row=row, b=torch.cat(pieces).contiguous())
    return d


def expert_rank_shape(shape: LayerShape, name: str, experts: Any) -> RankShape:
    """One expert's widths of stacked parameter `name` (gate_up_proj, down_proj) on the rank of `experts`."""
    size = experts.tp.size
    if name == "down_proj":
        return RankShape(shape.in_features // size, shape.out_features)
    return RankShape(shape.in_features, shape.out_features // size)


def rank_expert_delta(d: ExpertDelta, experts: Any) -> ExpertDelta:
    """`d` (every expert's A and B of the whole layer) cut to `experts`' rank: down's A columns, or gate/up
    B's rows of the gate and up pieces it writes, placed where the rank holds them; in the experts'
    intermediate order where act-order reordered it."""
    tp = experts.tp
    inter, local = experts.inter * tp.size, experts.inter  # the whole width, this rank's
    if experts.inter_order is not None:
        d = _in_inter_order(d, experts.inter_order, inter)
    if tp.size == 1:
        return d
    if d.name == "down_proj":
        return d._replace(a=tp.part(d.a, tp.size, dim=2).contiguous())
    pieces = []
    for off in range(d.row, d.row + d.b.shape[1], inter):  # its gate rows, its up rows (or one of them)
        pieces.append(tp.part(d.b[:, off - d.row : off - d.row + inter], tp.size, dim=1))
    return d._replace(row=d.row // inter * local, b=torch.cat(pieces, dim=1).contiguous())


def _in_inter_order(d: ExpertDelta, order: torch.Tensor, inter: int) -> ExpertDelta:
    """`d` with each expert's intermediate column j the checkpoint's `order[e, j]` ([E, I]): down's A
    columns, or each gate and up piece of B's rows."""
    if d.name == "down_proj":
        return d._replace(a=d.a.gather(2, order[:, None, :].expand_as(d.a)))
    pieces = [d.b[:, off - d.row : off - d.row + inter] for off in range(d.row, d.row + d.b.shape[1], inter)]
    return d._replace(b=torch.cat([p.gather(1, order[:, :, None].expand_as(p)) for p in pieces], dim=1))


def rank_adapter(
    weights: AdapterWeights, linears: dict[tuple[int, str], object], experts: dict[int, Any]
) -> AdapterWeights:
    """`weights` cut for this rank: each module's delta as `rank_delta` cuts it for its layer, each
    mixture layer's experts as `rank_expert_delta` cuts them."""
    deltas = [rank_delta(d, linears[(d.layer, d.name)]) for d in weights.deltas]
    stacked = [rank_expert_delta(x, experts[x.layer]) for x in weights.experts]
    return weights._replace(deltas=deltas, experts=stacked)
