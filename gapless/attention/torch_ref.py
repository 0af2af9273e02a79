"""Reference attention in plain torch: the CPU path, and the yardstick the GPU kernels are tested against.

The ragged batch is padded to `[B, max_extend_len]` queries and `[B, max_seq_len]` keys gathered from the
KV pool through the request table, then one `scaled_dot_product_attention` call per layer handles all
requests, extend and decode alike. The index tensors and the mask are built once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gapless.attention.base import AttentionMetadata


@dataclass
class _State:
    slots: torch.Tensor  # [B * S] int64 KV slots, row-major (padding -> slot 0, masked out)
    batch: int
    seq: int
    q_index: torch.Tensor  # [B, Q] index into the flat token dimension (padding -> 0)
    q_valid: torch.Tensor  # [B, Q] bool
    mask: torch.Tensor  # [B, 1, Q, S] bool, True = may attend


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
            q_valid=q_valid,
            mask=mask.unsqueeze(1),
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
        return out.transpose(1, 2)[state.q_valid]  # [T, H, d]
