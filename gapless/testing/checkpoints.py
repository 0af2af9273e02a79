"""Small random-weight Hugging Face checkpoints for tests, benchmarks and the default model.

Each checkpoint is written by transformers itself (its own config classes and `save_pretrained`),
so the engine's loader is tested against the real on-disk format, and the same directory can be
loaded by `AutoModelForCausalLM` as the reference in parity tests.

The tiny configs are chosen so that together they cover the features the engine must get right:
grouped-query and multi-query attention, a head_dim that is not hidden/heads, llama3 RoPE scaling,
attention bias (Qwen2), q/k norm (Qwen3), and tied and untied lm_heads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from gapless.testing.tokenizer import _trained_tokenizer_json, build_tokenizer

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("tiny", "overlap", "bench", "qwen3-0.6b")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}

# Per-arch tiny configs. Between them: GQA (4 q / 2 kv heads), MQA (mistral: 1 kv head), head_dim 32
# != 64/4 (qwen3), llama3 RoPE scaling whose thresholds split head_dim 16's frequencies into all
# three bands (unchanged, smoothed, divided by `factor`), and tied (qwen*) / untied (llama, mistral)
# lm_heads. Qwen2's q/k/v bias and Qwen3's q/k RMSNorm come with their config classes.
_TINY: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}

# Shapes for the larger sizes; they replace the tiny shape but keep each arch's features (rope,
# tying, bias) unless they set them. They are meant for qwen3 first; the other archs accept them too.
_SHAPES: dict[str, dict[str, Any]] = {
    # Small enough that host-side scheduling time is a visible share of a step.
    "overlap": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    # Big enough that CPU forward time dominates, for throughput benchmarks.
    "bench": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    # Qwen3-0.6B's own shape, for the GPU benchmark (`gapless.bench.gpu`): the values of the published
    # Qwen/Qwen3-0.6B config.json (hidden 1024, 28 layers, 16 q / 8 kv heads of head_dim 128 != 1024/16,
    # vocab 151936, 40960 positions, rope_theta 1e6, eps 1e-6, tied lm_head), with random weights.
    # ~596M parameters (155M of them the tied embedding): 1.2 GB in bf16, and 112 KiB of bf16 KV per
    # token (28 layers x 2 x 8 heads x 128). Too big for tests; only the GPU benchmark builds it. Meant
    # for qwen3 (the other archs take the shape but not Qwen3's q/k norm).
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

# RoPE goes in as `rope_theta` / `rope_scaling`: transformers 5 folds them into `rope_parameters`
# (which is what config.json then carries), and 4.x takes them as they are.
_COMMON: dict[str, Any] = dict(
    max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0
)

# Re-initialisation scales (see `_spread_init`): logit std ~ LOGIT_STD, each linear roughly
# variance-preserving times LINEAR_GAIN.
LOGIT_STD = 2.0
LINEAR_GAIN = 1.5
EMBED_STD = 1.0
NORM_NOISE = 0.1
BIAS_STD = 0.1


def model_config(arch: str, size: str = "tiny", **overrides: Any) -> PretrainedConfig:
    """The transformers config for `arch` at `size`, with token ids and vocab from the test tokenizer."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    tokenizer = build_tokenizer()
    kwargs: dict[str, Any] = dict(_COMMON)
    kwargs.update(json.loads(json.dumps(_TINY[arch])))  # deep copy: configs mutate rope dicts
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if size != "tiny":
        kwargs.update(_SHAPES[size])  # after the tokenizer's: a real model's shape may bring its vocab
    kwargs.update(overrides)
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    return _CONFIG_CLASSES[arch](**kwargs)


@torch.no_grad()
def _spread_init(model: PreTrainedModel, seed: int) -> None:
    """Re-initialise weights so greedy decoding has clear winners.

    HF's default init (std 0.02) gives near-uniform logits, so greedy top-1 is decided by rounding
    noise and two correct implementations disagree. Here the lm_head gives logits of std ~LOGIT_STD,
    each linear is variance-preserving (times LINEAR_GAIN) so the layers, not just the last token's
    embedding, decide the output, and norms/biases get noise so a wrong index into them shows up.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal_(p: torch.Tensor, mean: float, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    hidden = model.config.hidden_size
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for name, p in model.named_parameters():
        if p is head or p is embed:
            # The lm_head (or the tied embedding) sets the logit scale: h has RMS ~1 after the norm.
            std = LOGIT_STD / math.sqrt(hidden) if p is head else EMBED_STD
            normal_(p, 0.0, std)
        elif "norm" in name:
            normal_(p, 1.0, NORM_NOISE)
        elif name.endswith(".bias"):
            normal_(p, 0.0, BIAS_STD)
        elif p.dim() == 2:
            normal_(p, 0.0, LINEAR_GAIN / math.sqrt(p.shape[1]))
        else:
            raise ValueError(f"no init rule for parameter {name} {tuple(p.shape)}")


def _uninitialised_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """The model for `config` with weights left for `_spread_init`, which overwrites every parameter.

    Built on the meta device and then given empty CPU storage, so torch's and transformers' own inits
    never run: for Qwen3-0.6B they were 16 s of the 30 s a checkpoint took on 2 cores. The result is the
    same model: `tie_weights` restores the tie that `to_empty` breaks, and non-persistent buffers (RoPE's
    inv_freq), left as garbage, are never saved. Where that might not hold (a persistent buffer, which
    init would fill and the checkpoint carry, or a tie not restored) it builds the model the plain way.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if set(model.state_dict()) <= params:
        model.to_empty(device="cpu")
        model.tie_weights()
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if tied == bool(config.tie_word_embeddings):
            return model
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


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
    """Write a random-weight checkpoint (config, safetensors, tokenizer, generation config) to `path`.

    `shards > 1` picks a shard size that makes transformers split the weights into several
    `model-0000i-of-0000n.safetensors` files plus an index (about `shards` of them; whole tensors
    never split, so the count is approximate but always > 1).
    """
    path = Path(path)
    config = model_config(arch, size, **config_overrides)
    model = _uninitialised_model(config, seed)  # float32: init and cast happen after
    _spread_init(model, seed)
    model = model.to(dtype).eval()

    max_shard_size: int | str = "50GB"
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        max_shard_size = max(1, math.ceil(total / shards))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(path))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(path))
    return path


def cache_dir() -> Path:
    """Root of the on-disk cache: `$GAPLESS_CACHE` or `~/.cache/gapless`."""
    root = os.environ.get("GAPLESS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "gapless"


def _build_atomically(target: Path, build: Callable[[Path], Any]) -> Path:
    """Build into a private temp dir next to `target`, then rename it into place.

    Concurrent callers each build their own copy; the first rename wins and the others discard
    theirs, so a reader never sees a half-written checkpoint.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # the rename failed for a reason other than losing the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_checkpoint(arch: str, size: str = "tiny", **kw: Any) -> Path:
    """A checkpoint from `make_checkpoint(arch, size=size, **kw)`, built once and kept in the cache.

    The directory name hashes every argument plus the recipe (resolved config, init constants,
    tokenizer), so different requests never share a directory and a changed recipe never reuses a
    stale one.
    """
    overrides = {k: v for k, v in kw.items() if k not in ("seed", "shards", "dtype")}
    recipe = dict(
        args={"arch": arch, "size": size, **kw},
        config=model_config(arch, size, **overrides).to_dict(),
        init=[LOGIT_STD, LINEAR_GAIN, EMBED_STD, NORM_NOISE, BIAS_STD],
        tokenizer=hashlib.sha256(_trained_tokenizer_json().encode()).hexdigest(),
    )
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{arch}-{size}-{digest}"
    return _build_atomically(target, lambda tmp: make_checkpoint(tmp, arch, size=size, **kw))


def default_model_path() -> Path:
    """The built-in model `make serve` uses when none is given: tiny qwen3, built on first use.

    The name is fixed so users can find it; bump its version whenever the recipe changes.
    """
    target = cache_dir() / "models" / "tiny-qwen3-v1"
    return _build_atomically(target, lambda tmp: make_checkpoint(tmp, "qwen3", size="tiny"))
