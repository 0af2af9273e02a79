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

# architecture -> per-family switches of the one decoder implementation
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
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
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


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


def model_config_from_dict(cfg: dict[str, Any], where: str, gen_eos: Any = None) -> ModelConfig:
    """Validate a `config.json` dict (from `where`, for messages); `gen_eos`: generation config's EOS ids."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _FAMILIES:
        raise ValueError(
            f"unsupported architecture {arch!r} in {where}; gapless runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    fam = _FAMILIES[arch]
    for moe_key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(moe_key):
            raise ValueError(f"{arch}: mixture-of-experts ({moe_key}={cfg[moe_key]}) is not supported")
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{arch}: hidden_act={hidden_act!r} is not supported (only 'silu')")

    max_pos = int(cfg.get("max_position_embeddings", 2048))  # transformers' default when absent
    window = cfg.get("sliding_window")
    window_on = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and window_on and int(window) < max_pos:
        raise ValueError(
            f"{arch}: sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_pos}) is not supported"
        )

    # RoPE: v5 configs carry `rope_parameters` (rope_theta inside), v4 ones `rope_theta` + `rope_scaling`.
    rope = dict(cfg.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type form; all our layers are full attention
        rope = dict(rope["full_attention"])
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = rope or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{arch}: rope scaling type {rope_type!r} is not supported (supported: {_ROPE_TYPES})"
        )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={cfg['partial_rotary_factor']} is not supported")
    scaling = {**scaling, "rope_type": rope_type} if rope_type != "default" else None

    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    attn_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attn_bias if fam["qkv_bias"] is None else fam["qkv_bias"]
    o_bias = attn_bias if fam["qkv_bias"] is None else False

    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=fam["qk_norm"],
        eos_token_ids=_eos_ids(gen_eos, cfg.get("eos_token_id")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
