"""One decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Granite, Gemma 2 and 3,
and the mixture-of-experts Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE), switched by `ModelConfig` where the
families differ: q/k norm per head (Qwen3, Gemma 3) or over all heads (OLMo 2, OLMoE), where the norms sit
(`NORM_PLACES`), Granite's multipliers, Gemma's `1 + weight` norms, GeGLU, embedding scale, soft-capping,
sliding-window layers with their own RoPE base (Gemma 3), and a mixture of experts in place of the MLP
(`gapless.model.moe`).

The model sees a flat, ragged batch of tokens (all requests' new tokens concatenated) and a
`ForwardContext` passed down as an argument: where to store each token's K/V and how to attend.
Module names mirror Hugging Face's so checkpoint names map one to one (q/k/v and gate/up are fused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gapless.attention.base import AttentionBackend, softcap
from gapless.memory.kv_pool import KVPool
from gapless.model.config import NORM_PLACES, ModelConfig
from gapless.model.layers import (
    GATED_ACTIVATIONS,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    make_rms_norm,
)
from gapless.model.moe import SparseMoE


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    kv_pool: KVPool
    backend: AttentionBackend
    attn_state: Any  # backend.prepare(metadata)

    @classmethod
    def prepared(
        cls,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        kv_pool: KVPool,
        backend: AttentionBackend,
        meta: Any,
    ) -> ForwardContext:
        """The context of a flat batch placed by `meta` (`AttentionMetadata`), the backend's per-batch work
        done: one way to build it for every model that runs on a pool (the target's, a draft's)."""
        return cls(positions, out_slots, kv_pool, backend, backend.prepare(meta))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}, bias=cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # per head (over head_dim) or over all heads' features at once (q_size, kv_size)
            per_head = cfg.qk_norm == "head"
            q_dim, k_dim = (cfg.head_dim, cfg.head_dim) if per_head else (cfg.q_size, cfg.kv_size)
            self.q_norm = make_rms_norm(q_dim, cfg.rms_norm_eps, cfg.norm_kind)
            self.k_norm = make_rms_norm(k_dim, cfg.rms_norm_eps, cfg.norm_kind)
        self.rope = rope
        self.scale = cfg.attention_scale
        # what the backend is asked for beyond plain causal attention (Gemma 2); none: its plain call
        self.extra: dict[str, Any] = {}
        if cfg.window_layers[layer_id]:
            self.extra["window"] = cfg.sliding_window
        if cfg.attn_logit_softcapping is not None:
            self.extra["softcap"] = cfg.attn_logit_softcapping

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if cfg.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, q.shape[-1] // cfg.head_dim, cfg.head_dim)
        k = k.view(-1, k.shape[-1] // cfg.head_dim, cfg.head_dim)
        v = v.view(-1, v.shape[-1] // cfg.head_dim, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(ctx.positions, q, k)
        ctx.kv_pool.store(self.layer_id, ctx.out_slots, k, v)
        out = ctx.backend.forward(
            q,
            ctx.kv_pool.k[self.layer_id],
            ctx.kv_pool.v[self.layer_id],
            ctx.attn_state,
            self.scale,
            **self.extra,
        )
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the width (default: the config's; Qwen2-MoE's shared expert has its own)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"gate": inter, "up": inter}, bias=cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream, with RMSNorms where the family puts them
    (`NORM_PLACES`): on each sublayer's input (Llama), its output (OLMo 2) or both (Gemma 2). Granite
    scales each sublayer's output by `residual_multiplier` before the add."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rope)
        self.mlp = _mlp(cfg, layer_id)
        self.norm_names = NORM_PLACES[cfg.norms]
        for name in self.norm_names:
            if name is not None:
                self.add_module(name, make_rms_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_kind))
        self.residual_multiplier = cfg.residual_multiplier

    def _norm(self, place: int, x: torch.Tensor) -> torch.Tensor:
        name = self.norm_names[place]
        return x if name is None else self.get_submodule(name)(x)

    def _residual(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self._residual(self._norm(1, self.self_attn(self._norm(0, x), ctx)))
        return x + self._residual(self._norm(3, self.mlp(self._norm(2, x))))


def _mlp(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """The layer's MLP: dense, or the mixture of experts (with Qwen2-MoE's shared expert, a dense MLP)."""
    if not cfg.moe_layers[layer_id]:
        return MLP(cfg)
    shared = cfg.shared_expert_intermediate_size
    return SparseMoE(cfg, MLP(cfg, shared) if shared else None)


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local_rope = rope  # Gemma 3's window layers rotate with a base of their own
        if cfg.local_rope_theta is not None:
            local_rope = RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.local_rope_theta, cfg.local_rope_scaling
            )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, local_rope if cfg.window_layers[i] else rope) for i in range(cfg.num_layers)
        )
        self.norm = make_rms_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_kind)
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite's; 1.0 elsewhere
        # Gemma's sqrt(hidden), which transformers rounds to the model's dtype before multiplying
        self.normalizer = cfg.hidden_size**0.5 if cfg.embedding_normalizer else None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.normalizer is not None:
            x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `logits` projects only the rows asked for,
    so a prefill computes the vocabulary projection for its last token alone."""

    # checkpoint name fragment -> (fused parameter fragment, shard id); a checkpoint that already fuses
    # them (Phi-3's qkv_proj, gate_up_proj) is split into the same shards at load
    fused_weights = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        """`max_positions`: the positions RoPE's table covers (default: the model's
        `max_position_embeddings`; more only where the engine was told to run past it)."""
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:  # Granite divides, in the model's dtype, as transformers does
            logits = logits / self.cfg.logits_scaling
        return softcap(logits, self.cfg.final_logit_softcapping).float()
