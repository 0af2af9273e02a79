"""The Triton attention backend: `gapless.attention.triton_kernels` behind the `AttentionBackend` protocol.

The kernels read the metadata tensors directly, so `prepare` only makes them contiguous, once per batch;
the decode split count and its scratch (the splits' fp32 outputs, their arrival counters) are settled by
the first layer's `forward` and reused by the rest, since every layer of a batch has the same shapes.

Triton itself is imported only when a `TritonBackend` is made, so importing `gapless.attention` works
without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gapless import env
from gapless.attention.base import AttentionMetadata
from gapless.tensors import map_tensors

_CPU_SM_STANDIN = 8  # for the interpreter's split heuristic: a few splits, not one per key block


def interpret_requested() -> bool:
    return env.TRITON_INTERPRET.get()


@dataclass
class _State:
    meta: AttentionMetadata  # with contiguous tensors, as the kernels index them
    scratch: dict[tuple, Any] = field(default_factory=dict)  # decode: `DecodeScratch` by shape


class TritonBackend:
    def __init__(
        self, num_splits: int | None = None, decode_tuning: Any = None, extend_tuning: Any = None
    ) -> None:
        """`num_splits` fixes the decode split count (tests); by default it follows the batch.
        `decode_tuning`, `extend_tuning`: the kernels' knobs (`triton_kernels.DecodeTuning`,
        `ExtendTuning`; None: their defaults, the decode kernel's registers and stages as
        `GAPLESS_DECODE_MAX_REGISTERS` and `GAPLESS_DECODE_STAGES` say)."""
        import gapless.attention.triton_kernels as triton_kernels

        self._k = triton_kernels
        self.num_splits = num_splits
        self.decode_tuning = decode_tuning or triton_kernels.default_decode_tuning()
        self.extend_tuning = extend_tuning if extend_tuning is not None else triton_kernels.DEFAULT_EXTEND
        self._sms: dict[torch.device, int] = {}

    @property
    def interpreted(self) -> bool:
        """Whether the kernels were built for Triton's interpreter (CPU tensors) rather than the GPU."""
        return self._k.INTERPRET

    def _num_sms(self, device: torch.device) -> int:
        if device not in self._sms:
            if device.type == "cuda":
                self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._sms[device] = _CPU_SM_STANDIN
        return self._sms[device]

    def prepare(self, meta: AttentionMetadata) -> _State:
        return _State(map_tensors(meta, self._k.last_dim_contiguous))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: _State,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`AttentionBackend.forward`: sliding windows, soft-capping and fp8 caches included."""
        scales = (k_scale, v_scale)
        if q.device.type == "cpu" and not self.interpreted:
            raise RuntimeError(
                "Triton kernels got CPU tensors but were not built for the interpreter: set "
                "TRITON_INTERPRET=1 before gapless.attention.triton_kernels is first imported"
            )
        if not state.meta.is_decode:
            return self._k.extend_attention(
                q, k_cache, v_cache, state.meta, scale, window, softcap, self.extend_tuning, scales
            )
        scratch = self._decode_scratch(state, q, k_cache)
        return self._k.decode_attention(
            q,
            k_cache,
            v_cache,
            state.meta,
            scratch.splits,
            scale,
            scratch,
            window,
            softcap,
            self.decode_tuning,
            scales,
        )

    def _decode_scratch(self, state: _State, q: torch.Tensor, k_cache: torch.Tensor) -> Any:
        """The batch's decode split count and scratch (`triton_kernels.DecodeScratch`), made by its first
        layer and shared by the rest."""
        batch, heads, d = state.meta.batch_size, q.shape[1], q.shape[2]
        key = (heads, k_cache.shape[1], d, q.device)
        if key not in state.scratch:
            splits = self.num_splits or self._k.decode_num_splits(
                batch, k_cache.shape[1], state.meta.max_seq_len, self._num_sms(q.device), self.decode_tuning
            )
            state.scratch[key] = self._k.DecodeScratch.make(
                batch, heads, k_cache.shape[1], d, splits, q.device
            )
        return state.scratch[key]
