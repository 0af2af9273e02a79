"""The reference backend against a naive per-request softmax attention over gathered K/V."""

from __future__ import annotations

import pytest
import torch

from gapless.attention.base import AttentionMetadata
from gapless.attention.torch_ref import TorchRefBackend


def naive(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, scale, window=None, cap=None):
    """Per request: scores, soft-capped (cap * tanh(s / cap)) if `cap`, causal and, with `window`, only
    the last `window` positions up to the query's own."""
    outs, start = [], 0
    for row, pre, ext in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = table[row, : pre + ext].long()
        k, v = k_cache[slots].float(), v_cache[slots].float()  # [S, kvh, d]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        qq = q[start : start + ext].float()  # [E, h, d]
        scores = torch.einsum("ehd,shd->hes", qq, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        key_pos, q_pos = torch.arange(pre + ext)[None, :], (pre + torch.arange(ext))[:, None]
        causal = (key_pos <= q_pos) & (key_pos > q_pos - (window or pre + ext + 1))
        scores = scores.masked_fill(~causal[None], float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v))
        start += ext
    return torch.cat(outs)


# plain; a sliding window shorter than most contexts (prefixes 13 and 30 start their queries' windows
# inside the cached prefix); Gemma 2's soft-capping; both
@pytest.mark.parametrize(("window", "cap"), [(None, None), (8, None), (None, 2.0), (8, 2.0)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_matches_naive_attention(heads, kv_heads, mode, window, cap):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, slots_total, max_ctx = 16, 512, 64
    k_cache = torch.randn(slots_total, kv_heads, d, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, d, generator=g)
    rows = torch.tensor([3, 0, 5, 1])
    prefix_lens = torch.tensor([0, 13, 7, 30])  # empty prefix and prefixes not aligned to any page
    extend_lens = torch.tensor([9, 1, 17, 4]) if mode == "extend" else torch.ones(4, dtype=torch.long)
    table = torch.zeros(8, max_ctx, dtype=torch.int32)
    perm = torch.randperm(slots_total - 1, generator=g) + 1  # scattered slots, never the padding slot 0
    for i, row in enumerate(rows.tolist()):
        n = int(prefix_lens[i] + extend_lens[i])
        table[row, :n] = perm[i * max_ctx : i * max_ctx + n].int()
    q = torch.randn(int(extend_lens.sum()), heads, d, generator=g)
    meta = AttentionMetadata(
        rows=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        q_start=torch.cumsum(extend_lens, 0) - extend_lens,
        req_table=table,
        max_extend_len=int(extend_lens.max()),
        max_seq_len=int((prefix_lens + extend_lens).max()),
        is_decode=mode == "decode",
    )
    backend = TorchRefBackend()
    state = backend.prepare(meta)
    out = backend.forward(q, k_cache, v_cache, state, d**-0.5, window=window, softcap=cap)
    ref = naive(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, d**-0.5, window, cap)
    if window is not None:  # the window changes the answer here (so the comparison tests it)
        full = backend.forward(q, k_cache, v_cache, state, d**-0.5, softcap=cap)
        assert not torch.allclose(full, ref, atol=1e-3)
    assert out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
