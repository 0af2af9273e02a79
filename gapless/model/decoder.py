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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from gapless.attention.base import AttentionBackend, softcap
from gapless.memory.kv_pool import KVPool
from gapless.model import parallel
from gapless.model.config import NORM_PLACES, ModelConfig
from gapless.model.kv_scales import KVScales
from gapless.model.layers import (
    GATED_ACTIVATIONS,
    MergedColumnParallelLinear,
    MRotaryEmbedding,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Linear,
    make_rms_norm,
)
from gapless.model.moe import SparseMoE
from gapless.model.quant.base import PendingNorm
from gapless.model.vision.base import VisionEncoder

# `DecoderBody.compiled_layers` (`gapless.engine.cpu_compile.CompiledLayers`): (body, x, ctx) -> hidden
LayersCall = Callable[["DecoderBody", torch.Tensor, "ForwardContext"], torch.Tensor]


class ImageRows(NamedTuple):
    """Rows of a vision encoder's output that stand for tokens of the batch: `rows[i]` is the input
    embedding of flat token `flat[i]` (`gapless.engine.vision`)."""

    flat: torch.Tensor  # [N] int64
    rows: torch.Tensor  # [N, hidden]


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64 (M-RoPE: [3, T] in an extend with images)
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    kv_pool: KVPool
    backend: AttentionBackend
    attn_state: Any  # backend.prepare(metadata)
    images: ImageRows | None = None  # image embeddings that replace tokens' (vision-language models)
    is_decode: bool = False  # one new token a request (the compiled CPU decode takes only these)

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
        return cls(positions, out_slots, kv_pool, backend, backend.prepare(meta), is_decode=meta.is_decode)


class Attention(nn.Module):
    fused: Any = None  # the fused-kernels module when the model runs them (`gapless.model.fused`)

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.tp = tp = parallel.current()
        # KV heads fewer than ranks are replicated: `kv_parts` pieces, each shared by size // parts ranks
        self.kv_parts = parallel.kv_parts(cfg, tp.size)
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            bias=cfg.qkv_bias,
            shard_parts={"k": self.kv_parts, "v": self.kv_parts},
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
        return self.output(self.attend(self.project(x, ctx), ctx))

    def project(self, x: torch.Tensor | PendingNorm, ctx: ForwardContext) -> torch.Tensor:
        """The queries of `x` [T, heads, d] (or of the norm qkv takes as its input), its keys and values
        stored in this layer's KV: the part before the attention itself, which reads only `ctx`'s
        positions, slots and pool."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if cfg.qk_norm == "all":
            q, k = self._norm_all_heads(q, k)
        q = q.view(-1, q.shape[-1] // cfg.head_dim, cfg.head_dim)
        k = k.view(-1, k.shape[-1] // cfg.head_dim, cfg.head_dim)
        v = v.view(-1, v.shape[-1] // cfg.head_dim, cfg.head_dim)
        return self.rotate_and_store(ctx.positions, q, k, v, ctx.kv_pool, ctx.out_slots)

    def attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The attention of queries `q` [T, heads, d] over this layer's KV, placed by `ctx`'s batch (an
        fp8 pool's k/v scales passed along)."""
        k_scale, v_scale = ctx.kv_pool.layer_scales(self.layer_id)
        return ctx.backend.forward(
            q,
            ctx.kv_pool.k[self.layer_id],
            ctx.kv_pool.v[self.layer_id],
            ctx.attn_state,
            self.scale,
            **self.extra,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's `out` ([T, heads, d] or [T, heads * d])."""
        return self.o_proj(out.reshape(out.shape[0], -1))

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: KVPool,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The per-head q/k norm (Qwen3, Gemma 3), RoPE, and the store of k and v into `slots` of this
        layer's KV: one fused kernel when the model runs them (`gapless.model.fused`), else torch. Returns
        the rotated q [T, heads, d]."""
        per_head = self.cfg.qk_norm == "head"
        if self.fused is not None and positions.dim() == 1:  # (M-RoPE's [3, T] positions: torch's)
            norm = None
            if per_head:
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.kind)
            k_cache, v_cache = kv_pool.k[self.layer_id], kv_pool.v[self.layer_id]
            return self.fused.qk_norm_rope_store(
                positions, q, k, v, self.rope.cos_sin, k_cache, v_cache, slots, norm,
                *kv_pool.layer_scales(self.layer_id),
            )  # fmt: skip
        if per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        kv_pool.store(self.layer_id, slots, k, v)
        return q

    def _norm_all_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's q/k norms, over all heads' features at once: under tensor parallelism each rank
        gathers the whole q and k, norms them with the whole weights, and keeps its own heads again."""
        tp = self.tp
        if tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        q = tp.part(self.q_norm(tp.gather_parts(q, tp.size)), tp.size, dim=-1)
        k = tp.part(self.k_norm(tp.gather_parts(k, self.kv_parts)), self.kv_parts, dim=-1)
        return q, k


class MLP(nn.Module):
    fused: Any = None  # the fused-kernels module when the model runs them (`gapless.model.fused`)

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the width (default: the config's; Qwen2-MoE's shared expert has its own)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"gate": inter, "up": inter}, bias=cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act
        self.act_and_mul = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """The MLP of `x` (or of the norm gate/up takes as its input, `PendingNorm`)."""
        h = self.gate_up_proj(x)
        if self.fused is None:
            return self.down_proj(self.act_and_mul(h))
        down, rows = self.down_proj, h.numel() // h.shape[-1]
        if down.takes_gated(rows):  # (the FP8 GEMV makes act(gate) * up as it loads x: no launch here)
            return down(h, gated=self.act)
        group = down.input_rounding(rows)  # (x rounded for FP8, or in act-order's column order, as written)
        return down(self.fused.act_and_mul(h, self.act, group, down.input_order()))


class DecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream, with RMSNorms where the family puts them
    (`NORM_PLACES`): on each sublayer's input (Llama), its output (OLMo 2) or both (Gemma 2). Granite
    scales each sublayer's output by `residual_multiplier` before the add.

    The residual stream travels beside the sublayer outputs, as in vLLM: a layer takes the previous
    sublayer's output `x` not yet added to `residual`, and each add is done by the input norm that
    follows it (`RMSNorm(x, residual)`, one fused pass where the kernels run); the final norm does the
    last layer's. In torch the adds and norms are the same ops, in the same order, as before."""

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

    def _output(self, place: int, h: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: its output norm, Granite's multiplier."""
        h = self._norm(place, h)
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def _add_norm(
        self, place: int, x: torch.Tensor, residual: torch.Tensor | None, feeds: _Linear | None
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """(the input norm at `place` of residual + x, that sum); the first layer's residual is x.
        `feeds`: the layer the norm's output goes to (`RMSNorm`'s: for FP8 rounding, or the norm left to
        that layer, a `PendingNorm`)."""
        name = self.norm_names[place]
        if name is None:
            if residual is None:
                return x, x
            residual = x + residual
            return residual, residual
        norm = self.get_submodule(name)
        if residual is None:
            return norm(x, None, feeds), x
        return norm(x, residual, feeds)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added)."""
        q, residual = self.before_attention(x, residual, ctx)
        return self.after_attention(self.self_attn.attend(q, ctx), residual)

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention: (the queries, the residual stream), its K/V stored. With
        `after_attention`, what `forward` runs around the attention (`gapless.engine.piecewise_graph`
        captures each side, the attention between them runs as it comes)."""
        h, residual = self._add_norm(0, x, residual, self.self_attn.qkv_proj)
        return self.self_attn.project(h, ctx), residual

    def after_attention(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's output `attn` on: (its MLP output, the residual stream)."""
        feeds = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None  # (a mixture's: none rounded)
        h, residual = self._add_norm(2, self._output(1, self.self_attn.output(attn)), residual, feeds)
        return self._output(3, self.mlp(h)), residual


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
        if cfg.mrope_section is not None:  # Qwen2.5-VL's positions over time, height and width
            rope = MRotaryEmbedding(
                cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.mrope_section
            )
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
        # `run_layers` compiled for decode batches (`--cpu-compile`, `gapless.engine.cpu_compile`), called
        # with this body as its first argument (so it holds no reference to it)
        self.compiled_layers: LayersCall | None = None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        if ctx.images is not None:  # (after the family's scaling: transformers scatters them unscaled)
            x = x.index_copy(0, ctx.images.flat, ctx.images.rows.to(x.dtype))
        if ctx.is_decode and self.compiled_layers is not None:
            return self.compiled_layers(self, x, ctx)
        return self.run_layers(x, ctx)

    def run_layers(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers and the final norm over the embedded batch `x`."""
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.finish(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled as the family scales them."""
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.normalizer is not None:
            x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        return x

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states: the last layer's output added to the residual stream, normed."""
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)


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
    # an FP8 KV cache's per-layer scales from the checkpoint (1.0 where none), set by the loader, and the KV
    # cache format the checkpoint names, which `--kv-cache-dtype auto` takes (`declared.checkpoint_kv_cache`)
    kv_cache_scales: KVScales | None = None
    kv_cache_format: str | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        """`max_positions`: the positions RoPE's table covers (default: the model's
        `max_position_embeddings`; more only where the engine was told to run past it)."""
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.vision: VisionEncoder | None = None  # a vision-language model's encoder (set by the loader)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of `hidden`'s rows, in the model's dtype, as transformers computes them before
        it upcasts them. Not upcast here: a greedy batch takes the argmax of these as they are (the same
        token as of their fp32 copy), and the sampler makes the step's one fp32 copy only where it needs
        one (`gapless.sampling.sampler`), as logprobs do for themselves."""
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:  # Granite divides, in the model's dtype, as transformers does
            logits = logits / self.cfg.logits_scaling
        return softcap(logits, self.cfg.final_logit_softcapping)
