"""An adapter's weights cut for one tensor-parallel rank, as the layer it adapts is cut.

A column-parallel layer (q/k/v, gate/up: output split over the ranks) keeps A whole and B's rows for its
own output pieces, each fused shard cut as the layer cuts its weight (KV heads fewer than ranks: the piece
its queries read, shared). A row-parallel layer (o, down: input split) keeps A's columns for its input
piece and B whole: each rank's delta B (A_rank x_rank) is a partial sum, added before the layer's
all-reduce, which sums it with the other ranks' exactly once. With one rank nothing is cut.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gapless.lora.adapter import AdapterWeights, LayerShape, ModuleDelta
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
    where that rank's fused weight holds them."""
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


def rank_adapter(weights: AdapterWeights, linears: dict[tuple[int, str], object]) -> AdapterWeights:
    """`weights` cut for this rank: each module's delta as `rank_delta` cuts it for its layer."""
    deltas = [rank_delta(d, linears[(d.layer, d.name)]) for d in weights.deltas]
    return weights._replace(deltas=deltas)
