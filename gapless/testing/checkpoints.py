"""Small random-weight Hugging Face checkpoints of every supported family, for tests and benchmarks.

They are written by `gapless.default_model.checkpoint` (transformers' own config classes and
`save_pretrained`, weights spread so greedy decoding has clear winners), as the default model is.

The tiny configs are chosen so that together they cover the features the engine must get right:
grouped-query and multi-query attention, a head_dim that is not hidden/heads, llama3 RoPE scaling,
attention bias (Qwen2), q/k norm per head (Qwen3) and over all heads (OLMo 2), fused q/k/v and gate/up
checkpoint weights (Phi-3), post-norms (OLMo 2), Granite's multipliers, Gemma 2's sliding window and
soft-caps, Gemma 3's window layers with a RoPE base of their own, mixtures of experts (Qwen2-MoE's
shared expert, Qwen3-MoE's dense layer among sparse ones, Mixtral's always-renormalised router, OLMoE's
q/k norm over all heads), and tied and untied lm_heads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from gapless.default_model.checkpoint import (
    QWEN3_TINY,
    TINY,
    build_atomically,
    cache_dir,
    random_config,
    recipe,
    shape,
    write_checkpoint,
)

ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "olmo2",
    "granite",
    "gemma2",
    "gemma3_text",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
)
MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
SIZES = ("tiny", "overlap", "bench", "qwen3-0.6b")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "phi3": Phi3Config,
    "olmo2": Olmo2Config,
    "granite": GraniteConfig,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "olmoe": OlmoeConfig,
}
# the tiny mixtures: 8 experts of width 32, 2 per token
_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# Per-arch tiny configs. Between them: GQA (4 q / 2 kv heads), MQA (mistral: 1 kv head), head_dim 32
# != 64/4 (qwen3, the default model's config), llama3 RoPE scaling whose thresholds split head_dim 16's
# frequencies into all three bands (unchanged, smoothed, divided by `factor`), and tied (qwen*) / untied
# (llama, mistral) lm_heads. Qwen2's q/k/v bias and Qwen3's q/k RMSNorm come with their config classes.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,
)
_TINY: dict[str, dict[str, Any]] = {
    "llama": dict(TINY, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE),
    "qwen2": dict(TINY, tie_word_embeddings=True),
    "qwen3": QWEN3_TINY,
    "mistral": dict(TINY, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False),
    # Phi-3 writes q/k/v and gate/up fused; OLMo 2 norms q and k over all heads and the sublayers'
    # outputs; Granite's multipliers are all != 1 (attention_multiplier 0.2 != 1/sqrt(16)), so a
    # forgotten one changes the output.
    "phi3": dict(TINY, sliding_window=None, tie_word_embeddings=False),
    "olmo2": dict(TINY, tie_word_embeddings=False),
    "granite": dict(
        TINY,
        tie_word_embeddings=True,
        embedding_multiplier=2.0,
        residual_multiplier=1.5,
        attention_multiplier=0.2,
        logits_scaling=1.25,
    ),
    # Gemma 2: layer 0 slides a 24-token window (prompts run to 90 tokens, chunks of 16 cross its edge,
    # shared 48-token prefixes are hit from inside it), layer 1 is global; soft-caps that bite on these
    # weights' scores and logits, query_pre_attn_scalar != head_dim.
    "gemma2": dict(
        TINY,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=24,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
        tie_word_embeddings=False,  # tied, the sqrt(hidden)-scaled embedding would predict its own token
    ),
    # Gemma 3: the same window on layer 0, whose RoPE base (10^4) differs from the global layer's (10^6,
    # linearly scaled by 2); q/k norms; no attention soft-cap (transformers' Gemma 3 has none)
    "gemma3_text": dict(
        TINY,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=24,
        final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=False,
    ),
    # Qwen2-MoE: a shared expert behind its sigmoid gate, top-k weights not renormalised
    "qwen2_moe": dict(
        TINY, num_experts=8, shared_expert_intermediate_size=48, tie_word_embeddings=False, **_EXPERTS
    ),
    # Qwen3-MoE: renormalised top-k; layer 1 a dense MLP (`mlp_only_layers`)
    "qwen3_moe": dict(
        TINY, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False, **_EXPERTS
    ),
    "mixtral": dict(
        TINY, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False
    ),
    "olmoe": dict(
        TINY, num_experts=8, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False
    ),
}

# Shapes for the larger sizes; they replace the tiny shape but keep each arch's features (rope,
# tying, bias) unless they set them. They are meant for qwen3 first; the other archs accept them too.
_SHAPES: dict[str, dict[str, Any]] = {
    # Small enough that host-side scheduling time is a visible share of a step.
    "overlap": shape(128, 384, 2, 4, 2, head_dim=32),
    # Big enough that CPU forward time dominates, for throughput benchmarks.
    "bench": shape(512, 1536, 8, 8, 4, head_dim=64, max_position_embeddings=4096),
    # Qwen3-0.6B's own shape, for the GPU benchmark (`gapless.bench.gpu`): the values of the published
    # Qwen/Qwen3-0.6B config.json (hidden 1024, 28 layers, 16 q / 8 kv heads of head_dim 128 != 1024/16,
    # vocab 151936, 40960 positions, rope_theta 1e6, eps 1e-6, tied lm_head), with random weights.
    # ~596M parameters (155M of them the tied embedding): 1.2 GB in bf16, and 112 KiB of bf16 KV per
    # token (28 layers x 2 x 8 heads x 128). Too big for tests; only the GPU benchmark builds it. Meant
    # for qwen3 (the other archs take the shape but not Qwen3's q/k norm).
    "qwen3-0.6b": shape(
        1024,
        3072,
        28,
        16,
        8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def model_config(arch: str, size: str = "tiny", **overrides: Any) -> PretrainedConfig:
    """The transformers config for `arch` at `size`, with token ids and vocab from the built-in tokenizer."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    return random_config(_CONFIG_CLASSES[arch], _TINY[arch], _SHAPES.get(size, {}), overrides)


def make_checkpoint(
    path: str | Path,
    arch: str,
    *,
    size: str = "tiny",
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of `model_config(arch, size, **config_overrides)` to `path`
    (`shards` and `dtype` as `write_checkpoint` takes them)."""
    config = model_config(arch, size, **config_overrides)
    return write_checkpoint(path, config, seed=seed, shards=shards, dtype=dtype)


def cached_checkpoint(arch: str, size: str = "tiny", **kw: Any) -> Path:
    """A checkpoint from `make_checkpoint(arch, size=size, **kw)`, built once and kept in the cache.

    The directory name hashes every argument plus the recipe (resolved config, init constants,
    tokenizer), so different requests never share a directory and a changed recipe never reuses a
    stale one.
    """
    overrides = {k: v for k, v in kw.items() if k not in ("seed", "shards", "dtype")}
    key = dict(
        args={"arch": arch, "size": size, **kw},
        config=model_config(arch, size, **overrides).to_dict(),
        **recipe(),
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{arch}-{size}-{digest}"
    return build_atomically(target, lambda tmp: make_checkpoint(tmp, arch, size=size, **kw))
