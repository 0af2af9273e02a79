"""A checkpoint built as each rank of a tensor-parallel group, in one process, for tests of what each rank
holds: `TPGroup` only says which piece a layer loads; no collective runs while building."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gapless.model import loader, parallel

CPU = torch.device("cpu")


def load_as_ranks(path: str | Path, size: int = 2, quantization: str | None = None) -> tuple[Any, list[Any]]:
    """The model at `path` loaded whole, then as rank 0 .. `size` - 1 of `size` (float32, CPU;
    `quantization` as `--quantization`)."""
    whole = loader.load_model(path, torch.float32, CPU, quantization=quantization)
    ranks = []
    try:
        for rank in range(size):
            parallel.use(parallel.TPGroup(rank=rank, size=size))
            ranks.append(loader.load_model(path, torch.float32, CPU, quantization=quantization))
    finally:
        parallel.use(parallel.SINGLE)
    return whole, ranks


def assert_experts_cut(whole: Any, ranks: list[Any]) -> None:
    """Each rank's experts, dequantized, are its share of the whole layer's: gate/up rows and down
    columns (`gapless.model.moe.Experts`, `cpu_weights` the float weights the CPU holds: the reference
    path's, `GAPLESS_INT4_KERNEL=triton`)."""
    assert whole.cpu_weights is not None
    w13, w2 = whole.cpu_weights
    inter = w13.shape[1] // 2
    gate, up = w13[:, :inter], w13[:, inter:]
    n = len(ranks)
    for r, part in enumerate(ranks):
        assert part.cpu_weights is not None
        mine = torch.cat([gate.chunk(n, dim=1)[r], up.chunk(n, dim=1)[r]], dim=1)
        torch.testing.assert_close(part.cpu_weights[0], mine, rtol=0, atol=0)
        torch.testing.assert_close(part.cpu_weights[1], w2.chunk(n, dim=2)[r], rtol=0, atol=0)
