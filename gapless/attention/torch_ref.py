"""Reference attention in plain torch: the CPU path, and the yardstick the GPU kernels are tested against.

The ragged batch is padded to `[B, max_extend_len]` queries and `[B, max_seq_len]` keys gathered from the
KV pool through the request table, then one `scaled_dot_product_attention` call per layer handles all
requests, extend and decode alike. The index tensors and the mask are built once per batch (a
sliding-window layer's mask once per window size); a query with a bound (`AttentionMetadata.q_limits`)
sees the keys up to it rather than up to itself. A decode batch (one query per request, so the flat
batch is already `[B, 1]`) skips the two gathers that pad queries and unpad outputs, and a lone decode
request, whose keys are all valid, attends without a mask: on a CPU, where a small model's decode step is
many small ops, those are a visible share of the step. Soft-capped scores (Gemma 2) cannot go through
`scaled_dot_product_attention`, so those layers compute the scores, cap, mask and softmax explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gapless.attention.base import AttentionMetadata
from gapless.attention.base import softcap as apply_softcap


@dataclass
class _State:
    slots: torch.Tensor  # [B * S] int64 KV slots, row-major (padding -> slot 0, masked out)
    batch: int
    seq: int
    q_index: torch.Tensor  # [B, Q] index into the flat token dimension (padding -> 0)
    mask: torch.Tensor  # [B, 1, Q, S] bool, True = may attend
    q_start: torch.Tensor  # [B]
    q_pos: torch.Tensor  # [B, Q] absolute position of each query (for sliding windows)
    padding: torch.Tensor  # [B, 1, Q, S] bool: a padding query's one allowed key (key 0)
    decode: bool  # one query per request: the flat batch is the padded one, token b = request b
    # a lone decode request whose keys are exactly its sequence (S = its length, not a graph's capacity)
    lone: bool
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, Q, S]
    # (request, query offset) [T] of each flat token; made by the first layer, which knows T
    out_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


class TorchRefBackend:
    def prepare(self, meta: AttentionMetadata) -> _State:
        dev = meta.rows.device
        S, Q = meta.max_seq_len, meta.max_extend_len
        key_pos = torch.arange(S, device=dev)
        q_off = torch.arange(Q, device=dev)
        seq_lens = meta.seq_lens
        q_valid = q_off[None, :] < meta.extend_lens[:, None]
        q_index = torch.where(q_valid, meta.q_start[:, None] + q_off[None, :], 0)
        q_pos = meta.prefix_lens[:, None] + q_off[None, :]  # absolute position of each query
        # the last key each query sees: itself (causal), or its bound (`q_limits`: an image's last token)
        limit = q_pos if meta.q_limits is None else torch.where(q_valid, meta.q_limits[q_index], q_pos)
        mask = (key_pos[None, None, :] <= limit[:, :, None]) & (
            key_pos[None, None, :] < seq_lens[:, None, None]
        )
        # padding queries attend to key 0 only, so softmax never sees an all-masked row (NaN)
        padding = ~q_valid[:, :, None] & (key_pos == 0)[None, None, :]
        mask = mask | padding
        slots = meta.req_table[meta.rows, :S].long()
        slots = torch.where(key_pos[None, :] < seq_lens[:, None], slots, 0)
        return _State(
            slots=slots.reshape(-1),
            batch=meta.batch_size,
            seq=S,
            q_index=q_index,
            mask=mask.unsqueeze(1),
            q_start=meta.q_start,
            q_pos=q_pos,
            padding=padding.unsqueeze(1),
            decode=meta.is_decode and Q == 1,
            lone=meta.is_decode and Q == 1 and meta.batch_size == 1 and not meta.static,
        )

    @staticmethod
    def _mask(state: _State, window: int | None) -> torch.Tensor:
        """The batch's mask, narrowed for a sliding-window layer to keys at positions > q_pos - window
        (each query sees the last `window` tokens, itself included, as transformers' window mask)."""
        if window is None:
            return state.mask
        if window not in state.window_masks:
            key_pos = torch.arange(state.seq, device=state.q_pos.device)
            recent = (key_pos[None, None, :] > state.q_pos[:, :, None] - window).unsqueeze(1)
            state.window_masks[window] = (state.mask & recent) | state.padding
        return state.window_masks[window]

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
        qp = q.unsqueeze(2) if state.decode else q[state.q_index].transpose(1, 2)  # [B, H, Q, d]
        # a decode's batch read off its tensor (a token a request), so that a compiled decode
        # (`gapless.engine.cpu_compile`) keeps it a symbol rather than a constant it must recompile for
        B, S = qp.shape[0] if state.decode else state.batch, state.seq
        # index_select on a flat index: ~3x faster than advanced indexing with a [B, S] index on CPU
        k = (
            k_cache.index_select(0, state.slots).view(B, S, *k_cache.shape[1:]).transpose(1, 2)
        )  # [B, KVH, S, d]
        v = v_cache.index_select(0, state.slots).view(B, S, *v_cache.shape[1:]).transpose(1, 2)
        if k.dtype != q.dtype:  # an fp8 cache: the gathered keys and values dequantized, in fp32
            k, v = _dequantize(k, k_scale, q.dtype), _dequantize(v, v_scale, q.dtype)
        mask = self._mask(state, window)
        if softcap is None:
            # a lone decode request's keys are exactly its sequence: nothing to mask
            bare = state.lone and window is None
            out = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=None if bare else mask, scale=scale, enable_gqa=qp.shape[1] != k.shape[1]
            )
        else:
            out = _softcapped_attention(qp, k, v, mask, scale, softcap)
        if state.decode:
            return out.squeeze(2)  # [B, H, d]: token b is request b
        if state.out_index is None:
            state.out_index = _token_coords(state.q_start, q.shape[0])
        # integer gather, not a `[q_valid]` mask: boolean-mask indexing counts the mask on the host (a sync)
        return out.transpose(1, 2)[state.out_index]  # [T, H, d]


def _dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 cache's `x` times its `scale` ([1] fp32, on the device: no sync), in `dtype`."""
    if scale is None:
        raise ValueError(f"a {x.dtype} KV cache needs its k_scale and v_scale")
    return (x.float() * scale).to(dtype)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 computes it: scores scaled, then
    capped, then masked, softmax in fp32 and cast back. q: [B, H, Q, d]; k, v: [B, KVH, S, d]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = apply_softcap(torch.matmul(q, k.transpose(2, 3)) * scale, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _token_coords(q_start: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, offset) of each flat token: token t belongs to the last request b with q_start[b] <= t
    (requests are contiguous and in order), at offset t - q_start[b]."""
    t = torch.arange(num_tokens, device=q_start.device)
    b = torch.searchsorted(q_start, t, right=True) - 1
    return b, t - q_start[b]
