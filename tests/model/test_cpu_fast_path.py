"""The CPU fast path of the model step is exact: each rewritten layer equals the formula it replaces (the
one transformers computes), bit for bit where the rewrite only reorders work, in every dtype."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from gapless.attention.base import AttentionMetadata
from gapless.attention.torch_ref import TorchRefBackend
from gapless.model.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rope_matches_transformers_bit_for_bit(dtype: torch.dtype, scaling: dict | None) -> None:
    """q and k rotated together equal transformers' `apply_rotary_pos_emb` on each, exactly."""
    torch.manual_seed(0)
    d, T = 64, 7
    rope = RotaryEmbedding(d, 512, 10000.0, scaling)
    q, k = torch.randn(T, 9, d, dtype=dtype), torch.randn(T, 3, d, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 33, 34, 200, 511])
    # transformers' table: cat(freqs, freqs), cos/sin in fp32 then cast to the activations' dtype
    freqs = positions[:, None].float() * rope_inv_freq(d, 10000.0, scaling)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # transformers' layout: [batch, heads, T, d] and [batch, T, d]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("prefixes", [[37], [0, 13, 30]])
def test_decode_attention_fast_path_equals_general_path(prefixes: list[int], window: int | None) -> None:
    """A decode batch skips the query and output gathers, and a lone request the mask: the same output
    as the general (extend) path of the reference backend over the same batch, one request or several."""
    g = torch.Generator().manual_seed(len(prefixes))
    heads, kv_heads, d, slots = 9, 3, 64, 256
    k_cache, v_cache = (
        torch.randn(slots, kv_heads, d, generator=g),
        torch.randn(slots, kv_heads, d, generator=g),
    )
    B = len(prefixes)
    prefix_lens, extend_lens = torch.tensor(prefixes), torch.ones(B, dtype=torch.long)
    table = torch.zeros(B, 64, dtype=torch.int32)
    perm = torch.randperm(slots - 1, generator=g) + 1
    for b, pre in enumerate(prefixes):
        table[b, : pre + 1] = perm[b * 64 : b * 64 + pre + 1].int()
    q = torch.randn(B, heads, d, generator=g)

    def run(is_decode: bool) -> torch.Tensor:
        meta = AttentionMetadata(
            rows=torch.arange(B),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            q_start=torch.arange(B),
            req_table=table,
            max_extend_len=1,
            max_seq_len=max(prefixes) + 1,
            is_decode=is_decode,
        )
        backend = TorchRefBackend()
        state = backend.prepare(meta)
        assert state.decode == is_decode
        return backend.forward(q, k_cache, v_cache, state, d**-0.5, window=window)

    fast, general = run(True), run(False)
    assert fast.shape == general.shape == (B, heads, d)
    torch.testing.assert_close(fast, general, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_calls_the_gemm_bit_for_bit_as_f_linear(dtype: torch.dtype, bias: bool) -> None:
    """The 2-D fast path (mm / addmm on the transposed weight) is F.linear's own kernel: equal results."""
    torch.manual_seed(1)
    layer = ColumnParallelLinear(64, 48, bias=bias).to(dtype)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    for x in (
        torch.randn(1, 64, dtype=dtype),
        torch.randn(9, 64, dtype=dtype),
        torch.randn(2, 3, 64, dtype=dtype),
    ):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_exact_with_transformers(dtype: torch.dtype) -> None:
    """Llama's RMSNorm: the float32 path (no casts) and the cast path both equal transformers' exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    ours, hf = RMSNorm(96, 1e-5), LlamaRMSNorm(96, eps=1e-5)
    torch.nn.init.normal_(ours.weight)
    hf.weight.data.copy_(ours.weight.data)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = torch.randn(5, 96).to(dtype)
    assert torch.equal(ours(x), hf(x))
