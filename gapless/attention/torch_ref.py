"""Reference attention in plain torch: the CPU path, and the yardstick the GPU kernels are tested against.

The ragged batch is padded to `[B, max_extend_len]` queries and `[B, max_seq_len]` keys gathered from the
KV pool through the request table, then one `scaled_dot_product_attention` call per layer handles all
requests, extend and decode alike. The index tensors and the mask are built once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gapless.attention.base import AttentionMetadata


@dataclass
class _State:
    slots: torch.Tensor  # [B * S] int64 KV slots, row-major (padding -> slot 0, masked out)
    batch: int
    seq: int
    q_index: torch.Tensor  # [B, Q] index into the flat token dimension (padding -> 0)
    mask: torch.Tensor  # [B, 1, Q, S] bool, True = may attend
    q_start: torch.Tensor  # [B]
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
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < seq_lens[:, None, None]
        )
        # padding queries attend to key 0 only, so softmax never sees an all-masked row (NaN)
        mask = mask | (~q_valid[:, :, None] & (key_pos == 0)[None, None, :])
        slots = meta.req_table[meta.rows, :S].long()
        slots = torch.where(key_pos[None, :] < seq_lens[:, None], slots, 0)
        return _State(
            slots=slots.reshape(-1),
            batch=meta.batch_size,
            seq=S,
            q_index=q_index,
            mask=mask.unsqueeze(1),
            q_start=meta.q_start,
        )

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, state: _State, scale: float
    ) -> torch.Tensor:
        B, S = state.batch, state.seq
        qp = q[state.q_index].transpose(1, 2)  # [B, H, Q, d]
        # index_select on a flat index: ~3x faster than advanced indexing with a [B, S] index on CPU
        k = (
            k_cache.index_select(0, state.slots).view(B, S, *k_cache.shape[1:]).transpose(1, 2)
        )  # [B, KVH, S, d]
        v = v_cache.index_select(0, state.slots).view(B, S, *v_cache.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=state.mask, scale=scale, enable_gqa=qp.shape[1] != k.shape[1]
        )
        if state.out_index is None:
            state.out_index = _token_coords(state.q_start, q.shape[0])
        # integer gather, not a `[q_valid]` mask: boolean-mask indexing counts the mask on the host (a sync)
        return out.transpose(1, 2)[state.out_index]  # [T, H, d]


def _token_coords(q_start: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, offset) of each flat token: token t belongs to the last request b with q_start[b] <= t
    (requests are contiguous and in order), at offset t - q_start[b]."""
    t = torch.arange(num_tokens, device=q_start.device)
    b = torch.searchsorted(q_start, t, right=True) - 1
    return b, t - q_start[b]
