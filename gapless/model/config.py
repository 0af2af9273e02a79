"""The model's shape, read straight from a Hugging Face `config.json`.

We parse the JSON ourselves instead of going through `transformers.AutoConfig`: the field names on
disk are stable across transformers releases (v4 writes `rope_theta` + `rope_scaling`, v5 writes
`rope_parameters`), while the in-memory config objects are not. Everything the decoder can't run
is refused here, at load, with an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gapless.model.generation_config import read_generation_config
from gapless.model.gguf import config_dict as gguf_config_dict
from gapless.model.gguf import is_gguf_file
from gapless.model.gguf_vision import config_dict as gguf_vision_config_dict
from gapless.model.gguf_vision import mmproj_for
from gapless.model.vision import VISION_ARCHITECTURES, VisionSpec, is_vision_config, text_config, vision_spec

# architecture -> per-family switches of the one decoder implementation:
#   qkv_bias: bias on q/k/v (None: the config's `attention_bias`, which then also puts one on o_proj)
#   qk_norm: None, "head" (Qwen3: RMSNorm over head_dim, per head) or "all" (OLMo 2: over all heads at once)
#   norms: where each layer's RMSNorms sit (`NORM_PLACES`): "pre" (on the sublayers' inputs), "post" (on
#     their outputs, OLMo 2) or "sandwich" (both, Gemma 2)
#   norm_kind: the RMSNorm's arithmetic (`ModelConfig.norm_kind`; Gemma's is "gemma")
#   multipliers: Granite's embedding/residual/attention multipliers and logits divisor are read
#   gemma: Gemma's `1 + weight` RMSNorm, sqrt(hidden) embedding scale, `query_pre_attn_scalar`,
#     attention and final logit soft-capping, and sliding-window layers (`layer_types`): 2 (Gemma 2) or 3
#     (Gemma 3: also a RoPE base of its own on the window layers, and a window pattern of 6); 0 elsewhere
#   window: how a `sliding_window` applies outside Gemma: "all" (Mistral, Mixtral, Phi-3: every layer, as
#     soon as it is set), "qwen" (Qwen2, Qwen3: with `use_sliding_window`, on the layers `layer_types` names,
#     else those from `max_window_layers` on) or None (an active window is refused)
#   moe: a mixture-of-experts MLP (`gapless.model.moe`): None (dense), "qwen" (Qwen2/3-MoE, OLMoE: top-k
#     of the softmax, renormalised if `norm_topk_prob`, weights cast to the model's dtype) or "mixtral"
#     (always renormalised, weights kept in fp32 as transformers' Mixtral keeps them)
_PLAIN: dict[str, Any] = {
    "qkv_bias": None,
    "qk_norm": None,
    "norms": "pre",
    "norm_kind": "llama",
    "multipliers": False,
    "gemma": 0,
    "window": None,
    "moe": None,
}
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _PLAIN,
    "MistralForCausalLM": {**_PLAIN, "qkv_bias": False, "window": "all"},
    "Qwen2ForCausalLM": {**_PLAIN, "qkv_bias": True, "window": "qwen"},
    "Qwen3ForCausalLM": {**_PLAIN, "qk_norm": "head", "window": "qwen"},
    # q/k/v and gate/up come fused in the checkpoint
    "Phi3ForCausalLM": {**_PLAIN, "qkv_bias": False, "window": "all"},
    "Olmo2ForCausalLM": {**_PLAIN, "qk_norm": "all", "norms": "post", "norm_kind": "fp32"},
    "GraniteForCausalLM": {**_PLAIN, "multipliers": True},
    "Gemma2ForCausalLM": {**_PLAIN, "norms": "sandwich", "gemma": 2},
    "Gemma3ForCausalLM": {**_PLAIN, "norms": "sandwich", "gemma": 3, "qk_norm": "head"},
    "MixtralForCausalLM": {**_PLAIN, "qkv_bias": False, "window": "all", "moe": "mixtral"},
    "Qwen2MoeForCausalLM": {**_PLAIN, "qkv_bias": True, "moe": "qwen"},
    "Qwen3MoeForCausalLM": {**_PLAIN, "qk_norm": "head", "moe": "qwen"},
    "OlmoeForCausalLM": {**_PLAIN, "qk_norm": "all", "moe": "qwen"},
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
# (`freq_factors`: each frequency divided by its own factor, as a GGUF file's `rope_freqs` stores Llama 3.x's
# scaling; `gapless.model.gguf` writes it, no Hugging Face config does)
_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


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
    local_rope_theta: float | None  # Gemma 3: the window layers' own RoPE base (None: the model's)
    local_rope_scaling: dict[str, Any] | None  # and their RoPE scaling
    moe: str | None  # the family's router (`_FAMILIES`' "moe"); None: every MLP is dense
    moe_layers: tuple[bool, ...]  # per layer: whether its MLP is the mixture of experts
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's MLP width
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int  # Qwen2-MoE: an always-on expert behind a sigmoid gate; 0: none
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    vision: VisionSpec | None = None  # a vision-language checkpoint's vision side (gapless.model.vision)
    # Qwen2.5-VL's M-RoPE: the rotary frequencies' sections rotated by time, height and width positions
    mrope_section: tuple[int, ...] | None = None

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
    for EOS ids) or of a GGUF file (its metadata, as `gapless.model.gguf.config_dict` maps it; with a
    vision projector beside it, as `gapless.model.gguf_vision.config_dict` does)."""
    path = Path(path)
    if is_gguf_file(path):
        mmproj = mmproj_for(path)
        cfg = gguf_vision_config_dict(path, mmproj) if mmproj is not None else gguf_config_dict(path)
        return model_config_from_dict(cfg, str(path))
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
    gen_eos = read_generation_config(path).get("eos_token_id")
    cfg = json.loads(cfg_file.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file} is not a JSON object")
    return model_config_from_dict(cfg, str(cfg_file), gen_eos)


def _architecture(cfg: dict[str, Any], where: str) -> str:
    """The checkpoint's architecture if the decoder runs it; else an error that names what it is."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _FAMILIES:
        multimodal = [k for k in _MULTIMODAL_KEYS if cfg.get(k)]
        what = f" (multimodal: {', '.join(multimodal)}; gapless runs text only)" if multimodal else ""
        raise ValueError(
            f"unsupported architecture {arch!r} in {where}{what}; "
            f"gapless runs {', '.join(SUPPORTED_ARCHITECTURES + VISION_ARCHITECTURES)}"
        )
    fam = _FAMILIES[arch]
    for moe_key in ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts"):
        if cfg.get(moe_key) and not fam["moe"]:
            raise ValueError(f"{arch}: mixture-of-experts ({moe_key}={cfg[moe_key]}) is not supported")
    for key in ("clip_qkv", "use_bidirectional_attention"):  # OLMoE's clipping, EmbeddingGemma's attention
        if cfg.get(key):
            raise ValueError(f"{arch}: {key}={cfg[key]!r} is not supported")
    hidden_act = _hidden_act(cfg, arch)
    if hidden_act not in _ACTIVATIONS or (hidden_act != "silu") != bool(fam["gemma"]):
        raise ValueError(f"{arch}: hidden_act={hidden_act!r} is not supported")
    return arch


def _hidden_act(cfg: dict[str, Any], arch: str) -> str:
    """Gemma names the activation `hidden_activation` (some configs carry a stale `hidden_act` too)."""
    if _FAMILIES[arch]["gemma"]:
        return str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    return str(cfg.get("hidden_act", "silu"))


def _window(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers slide, as transformers decides it for the family (`_FAMILIES`'
    "gemma" and "window"). Gemma: as `layer_types` lists them, else every `sliding_window_pattern`-th layer
    is global (transformers' defaults: every other one for Gemma 2, every sixth for Gemma 3)."""
    fam = _FAMILIES[arch]
    window = cfg.get("sliding_window")
    gemma, kind = fam["gemma"], fam["window"]
    if window is None or not (gemma or kind or cfg.get("use_sliding_window", True)):
        return None, (False,) * num_layers
    if gemma:
        pattern = int(cfg.get("sliding_window_pattern") or (2 if gemma == 2 else 6))
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif kind == "all":
        default = ["sliding_attention"] * num_layers
    elif kind == "qwen":
        if not cfg.get("use_sliding_window", False):
            return None, (False,) * num_layers
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:
        max_pos = int(cfg.get("max_position_embeddings", 2048))  # transformers' default when absent
        if int(window) < max_pos:
            raise ValueError(
                f"{arch}: sliding-window attention (sliding_window={window} < "
                f"max_position_embeddings={max_pos}) is not supported"
            )
        return None, (False,) * num_layers
    types = default if kind == "all" else cfg.get("layer_types") or default
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types={types!r} is not supported")
    return int(window), tuple(t == "sliding_attention" for t in types)


def _rope(
    cfg: dict[str, Any], arch: str, layer_type: str = "full_attention"
) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and scaling: v5 configs carry `rope_parameters` (rope_theta inside, and Phi-3's
    partial_rotary_factor; per layer type for Gemma 3), v4 ones `rope_theta` + `rope_scaling` (and
    Gemma 3's `rope_local_base_freq` for its window layers, which v4 never scaled)."""
    rope = dict(cfg.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type form
        rope = dict(rope.get(layer_type) or {})
    elif layer_type == "sliding_attention":  # v4 (or flat) Gemma 3: the local base, no scaling
        return float(cfg.get("rope_local_base_freq", 10000.0)), None
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={partial} is not supported")
    scaling = rope or dict(cfg.get("rope_scaling") or {})
    scaling.pop("mrope_section", None)  # M-RoPE's (`_mrope_section`), over unscaled frequencies
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "default" if rope_type == "mrope" else rope_type
    if rope_type in ("longrope", "su"):
        # Phi-3's LongRoPE switches short/long factors by sequence length, which a batch of requests of
        # different lengths cannot follow token-exactly
        raise ValueError(f"{arch}: LongRoPE scaling (rope type {rope_type!r}) is not supported")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{arch}: rope scaling type {rope_type!r} is not supported (supported: {_ROPE_TYPES})"
        )
    return theta, ({**scaling, "rope_type": rope_type} if rope_type != "default" else None)


def _mrope_section(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """Qwen2.5-VL's `mrope_section` (in `rope_parameters` or v4's `rope_scaling`), else None."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (cfg.get(key) or {}).get("mrope_section")
        if section is not None:
            return tuple(int(n) for n in section)
    return None


def model_config_from_dict(cfg: dict[str, Any], where: str, gen_eos: Any = None) -> ModelConfig:
    """Validate a `config.json` dict (from `where`, for messages); `gen_eos`: generation config's EOS ids."""
    if is_vision_config(cfg):  # the decoder runs its text_config; the vision side rides along
        text = model_config_from_dict(text_config(cfg), where, gen_eos)
        return dataclasses.replace(text, vision=vision_spec(cfg))
    arch = _architecture(cfg, where)
    fam = _FAMILIES[arch]
    theta, scaling = _rope(cfg, arch)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    attn_bias = bool(cfg.get("attention_bias", False))
    # Qwen2's bias is always on; Qwen2-MoE's config may switch it (`qkv_bias`)
    qkv_bias = attn_bias if fam["qkv_bias"] is None else fam["qkv_bias"] and bool(cfg.get("qkv_bias", True))
    o_bias = attn_bias if fam["qkv_bias"] is None else False
    # Granite's multipliers (its config's defaults are 1.0, attention_multiplier included)
    mult = (lambda key: float(cfg.get(key, 1.0))) if fam["multipliers"] else (lambda key: 1.0)
    num_layers = int(cfg["num_hidden_layers"])
    gemma = fam["gemma"]
    if fam["multipliers"]:
        scale = mult("attention_multiplier")
    else:
        scale = float(cfg.get("query_pre_attn_scalar", head_dim) if gemma else head_dim) ** -0.5
    window, window_layers = _window(cfg, arch, num_layers)
    local_theta, local_scaling = _rope(cfg, arch, "sliding_attention") if gemma == 3 else (None, None)

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
        embedding_normalizer=bool(gemma),
        embedding_multiplier=mult("embedding_multiplier"),
        residual_multiplier=mult("residual_multiplier"),
        attention_scale=scale,
        logits_scaling=mult("logits_scaling"),
        # transformers' Gemma 3 never applies an `attn_logit_softcapping` its config may carry
        attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping") if gemma == 2 else None),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping") if gemma else None),
        sliding_window=window,
        window_layers=window_layers,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        eos_token_ids=_eos_ids(gen_eos, cfg.get("eos_token_id")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        **_moe_fields(cfg, fam["moe"], num_layers),
        mrope_section=_mrope_section(cfg),
    )


def _moe_fields(cfg: dict[str, Any], moe: str | None, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig`: which layers route to experts (Qwen's
    `decoder_sparse_step` and `mlp_only_layers`; all of them in Mixtral and OLMoE), how many experts, how
    many per token, their width and the shared expert's."""
    if moe is None:
        return dict(
            moe=None,
            moe_layers=(False,) * num_layers,
            num_experts=0,
            num_experts_per_tok=0,
            moe_intermediate_size=0,
            norm_topk_prob=False,
            shared_expert_intermediate_size=0,
        )
    for keys in (("num_experts", "num_local_experts"), ("num_experts_per_tok",)):
        if not any(k in cfg for k in keys):  # transformers would fill in its default (128 experts, ...)
            raise ValueError(f"{cfg['architectures'][0]}: the config lacks {keys[0]}")
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return dict(
        moe=moe,
        moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=moe == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
