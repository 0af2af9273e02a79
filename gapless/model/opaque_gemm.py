"""GEMMs whose weight a compiled graph cannot hold, called from `torch.compile`'d code as one opaque op.

oneDNN's packed weight (`gapless.model.cpu_gemm.PackedLinear`) and fbgemm's packed parameters
(`gapless.model.quant.gguf_cpu.Int8DynamicLinearMethod`) are layouts inductor neither lowers nor traces
(a blocked tensor it did not pack itself; a TorchScript object). Under `--cpu-compile`
(`gapless.engine.cpu_compile`) such a GEMM reaches the graph as the custom op `gapless::opaque_gemm`,
which names its owner by a handle (a scalar tensor, which a graph takes as an input) and runs the
owner's own kernel; eagerly the owner's kernel is called directly, with no custom op's dispatch in
between. The handles refer to their owners weakly: a closed engine's weights are not kept alive here.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch


class OpaqueGemm(Protocol):
    """A layer's GEMM over rows `x` [M, K] -> [M, out_features] with a weight only it can read."""

    handle: torch.Tensor  # from `register`
    out_features: int

    def gemm(self, x: torch.Tensor) -> torch.Tensor: ...


_LIVE: weakref.WeakValueDictionary[int, OpaqueGemm] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register(owner: OpaqueGemm) -> torch.Tensor:
    """A new handle for `owner` (which keeps it as `owner.handle`): an int64 scalar tensor, so that a
    graph takes it as an input rather than a constant, and the same model compiles to the same graph
    (inductor's on-disk cache hits) whatever handles its layers drew."""
    handle = next(_HANDLES)
    _LIVE[handle] = owner
    return torch.tensor(handle)


# defined through `torch.library.Library` rather than `custom_op`: a `custom_op` call cost ~37 us here
# (a one-row decode step of the default model, ~90 of them, 3.4 ms slower), this one ~3 us (a loop of calls)
_LIB = torch.library.Library("gapless", "FRAGMENT")
_LIB.define("opaque_gemm(Tensor x, Tensor handle, int out_features) -> Tensor")
_LIB.impl("opaque_gemm", lambda x, handle, out_features: _LIVE[int(handle)].gemm(x), "CPU")


@torch.library.register_fake("gapless::opaque_gemm", lib=_LIB)
def _(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_OP = torch.ops.gapless.opaque_gemm.default


def call(owner: OpaqueGemm, x: torch.Tensor) -> torch.Tensor:
    """`owner.gemm(x)`: directly, or through the custom op while torch.compile traces."""
    return _OP(x, owner.handle, owner.out_features) if torch.compiler.is_compiling() else owner.gemm(x)
