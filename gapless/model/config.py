"""The model's shape, read straight from a Hugging Face `config.json`.

We parse the JSON ourselves instead of going through `transformers.AutoConfig`: the field names on
disk are stable across transformers releases (v4 writes `rope_theta` + `rope_scaling`, v5 writes
`rope_parameters`), while the in-memory config objects are not. Everything the decoder can't run
is refused here, at load, with an error that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gapless.model.generation_config import read_generation_config
from gapless.model.gguf import config_dict as gguf_config_dict
from gapless.model.gguf import is_gguf_file

# architecture -> per-family switches of the one decoder implementation:
#   qkv_bias: bias on q/k/v (None: the config's `attention_bias`, which then also puts one on o_proj)
#   qk_norm: None, "head" (Qwen3: RMSNorm over head_dim, per head) or "all" (OLMo 2: over all heads at once)
#   norms: where each layer's RMSNorms sit (`NORM_PLACES`): "pre" (on the sublayers' inputs), "post" (on
#     their outputs, OLMo 2) or "sandwich" (both, Gemma 2)
#   norm_kind: the RMSNorm's arithmetic (`ModelConfig.norm_kind`; Gemma's is "gemma")
#   multipliers: Granite's embedding/residual/attention multipliers and logits divisor are read
#   gemma: Gemma 2's `1 + weight` RMSNorm, sqrt(hidden) embedding scale, `query_pre_attn_scalar`,
#     attention and final logit soft-capping, and sliding-window layers (`layer_types`)
_PLAIN: dict[str, Any] = {
    "qkv_bias": None,
    "qk_norm": None,
    "norms": "pre",
    "norm_kind": "llama",
    "multipliers": False,
    "gemma": False,
}
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _PLAIN,
    "MistralForCausalLM": {**_PLAIN, "qkv_bias": False},
    "Qwen2ForCausalLM": {**_PLAIN, "qkv_bias": True},
    "Qwen3ForCausalLM": {**_PLAIN, "qk_norm": "head"},
    "Phi3ForCausalLM": {**_PLAIN, "qkv_bias": False},  # q/k/v and gate/up come fused in the checkpoint
    "Olmo2ForCausalLM": {**_PLAIN, "qk_norm": "all", "norms": "post", "norm_kind": "fp32"},
    "GraniteForCausalLM": {**_PLAIN, "multipliers": True},
    "Gemma2ForCausalLM": {**_PLAIN, "norms": "sandwich", "gemma": True},
}
# norm placement -> the checkpoint names of the norms on (attention input, attention output, MLP input,
# MLP output); None where a placement has none. Llama's "post_attention_layernorm" is the MLP's input norm.
NORM_PLACES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
# keys whose presence marks a checkpoint with more than a text decoder (vision or audio towers)
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_projector_type")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 via `attention_bias`)
    o_bias: bool
    mlp_bias: bool
    qk_norm: str | None  # RMSNorm on q and k before RoPE: "head" (Qwen3, per head) or "all" (OLMo 2)
    norms: str  # a key of NORM_PLACES: which of each sublayer's input and output are normed
    norm_kind: str  # RMSNorm's arithmetic: "llama", "fp32" (OLMo 2: weight times fp32, then cast) or
    # "gemma" (scale by 1 + weight, in fp32); see gapless.model.layers.RMS_NORMS
    hidden_act: str  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    embedding_normalizer: bool  # Gemma: embeddings times sqrt(hidden), rounded to the model's dtype first
    embedding_multiplier: float  # Granite: embeddings are scaled by it (1.0 elsewhere)
    residual_multiplier: float  # Granite: each sublayer's output is scaled by it before the residual add
    attention_scale: float  # softmax scale: head_dim**-0.5, or Granite's `attention_multiplier`
    logits_scaling: float  # Granite: logits are divided by it (1.0 elsewhere)
    attn_logit_softcapping: float | None  # Gemma 2: attention scores s -> cap * tanh(s / cap)
    final_logit_softcapping: float | None  # Gemma 2: logits z -> cap * tanh(z / cap)
    sliding_window: int | None  # window layers attend to the last `sliding_window` tokens (self included)
    window_layers: tuple[bool, ...]  # per layer: whether it is a sliding-window layer
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _optional_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _eos_ids(*candidates: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for c in candidates:
        if c is None:
            continue
        for x in c if isinstance(c, list) else [c]:
            if int(x) not in ids:
                ids.append(int(x))
    return tuple(ids)


def load_model_config(path: str | Path) -> ModelConfig:
    """Read and validate the config of a checkpoint directory (`config.json`, plus `generation_config.json`
    for EOS ids) or of a GGUF file (its metadata, as `gapless.model.gguf.config_dict` maps it)."""
    path = Path(path)
    if is_gguf_file(path):
        return model_config_from_dict(gguf_config_dict(path), str(path))
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
    gen_eos = read_generation_config(path).get("eos_token_id")
    return model_config_from_dict(json.loads(cfg_file.read_text()), str(cfg_file), gen_eos)


def _architecture(cfg: dict[str, Any], where: str) -> str:
    """The checkpoint's architecture if the decoder runs it; else an error that names what it is."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _FAMILIES:
        multimodal = [k for k in _MULTIMODAL_KEYS if cfg.get(k)]
        what = f" (multimodal: {', '.join(multimodal)}; gapless runs text only)" if multimodal else ""
        raise ValueError(
            f"unsupported architecture {arch!r} in {where}{what}; "
            f"gapless runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for moe_key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(moe_key):
            raise ValueError(f"{arch}: mixture-of-experts ({moe_key}={cfg[moe_key]}) is not supported")
    hidden_act = _hidden_act(cfg, arch)
    if hidden_act not in _ACTIVATIONS or (hidden_act != "silu") != _FAMILIES[arch]["gemma"]:
        raise ValueError(f"{arch}: hidden_act={hidden_act!r} is not supported")
    max_pos = int(cfg.get("max_position_embeddings", 2048))  # transformers' default when absent
    window = cfg.get("sliding_window")
    # Qwen2/Qwen3 switch the window with `use_sliding_window`; Mistral and Phi-3 apply any window they set
    windowed = window is not None and cfg.get("use_sliding_window", True) and int(window) < max_pos
    if windowed and not _FAMILIES[arch]["gemma"]:
        raise ValueError(
            f"{arch}: sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_pos}) is not supported"
        )
    return arch


def _hidden_act(cfg: dict[str, Any], arch: str) -> str:
    """Gemma names the activation `hidden_activation` (some configs carry a stale `hidden_act` too)."""
    if _FAMILIES[arch]["gemma"]:
        return str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    return str(cfg.get("hidden_act", "silu"))


def _window_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Gemma 2's sliding-window layers: as `layer_types` lists them, else every other one from the first
    (transformers' default for Gemma 2)."""
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types={types!r} is not supported")
    return tuple(t == "sliding_attention" for t in types)


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and scaling: v5 configs carry `rope_parameters` (rope_theta inside, and Phi-3's
    partial_rotary_factor), v4 ones `rope_theta` + `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type form; all our layers are full attention
        rope = dict(rope["full_attention"])
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={partial} is not supported")
    scaling = rope or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("longrope", "su"):
        # Phi-3's LongRoPE switches short/long factors by sequence length, which a batch of requests of
        # different lengths cannot follow token-exactly
        raise ValueError(f"{arch}: LongRoPE scaling (rope type {rope_type!r}) is not supported")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{arch}: rope scaling type {rope_type!r} is not supported (supported: {_ROPE_TYPES})"
        )
    return theta, ({**scaling, "rope_type": rope_type} if rope_type != "default" else None)


def model_config_from_dict(cfg: dict[str, Any], where: str, gen_eos: Any = None) -> ModelConfig:
    """Validate a `config.json` dict (from `where`, for messages); `gen_eos`: generation config's EOS ids."""
    arch = _architecture(cfg, where)
    fam = _FAMILIES[arch]
    theta, scaling = _rope(cfg, arch)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    attn_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attn_bias if fam["qkv_bias"] is None else fam["qkv_bias"]
    o_bias = attn_bias if fam["qkv_bias"] is None else False
    # Granite's multipliers (its config's defaults are 1.0, attention_multiplier included)
    mult = (lambda key: float(cfg.get(key, 1.0))) if fam["multipliers"] else (lambda key: 1.0)
    num_layers = int(cfg["num_hidden_layers"])
    gemma = fam["gemma"]
    if fam["multipliers"]:
        scale = mult("attention_multiplier")
    else:
        scale = float(cfg.get("query_pre_attn_scalar", head_dim) if gemma else head_dim) ** -0.5
    window = cfg.get("sliding_window") if gemma else None

    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=fam["qk_norm"],
        norms=fam["norms"],
        norm_kind="gemma" if gemma else fam["norm_kind"],
        hidden_act=_hidden_act(cfg, arch),
        embedding_normalizer=gemma,
        embedding_multiplier=mult("embedding_multiplier"),
        residual_multiplier=mult("residual_multiplier"),
        attention_scale=scale,
        logits_scaling=mult("logits_scaling"),
        attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping") if gemma else None),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping") if gemma else None),
        sliding_window=int(window) if window is not None else None,
        window_layers=_window_layers(cfg, num_layers) if window is not None else (False,) * num_layers,
        eos_token_ids=_eos_ids(gen_eos, cfg.get("eos_token_id")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
