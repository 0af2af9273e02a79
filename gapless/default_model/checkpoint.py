"""Random-weight Hugging Face checkpoints, written by transformers itself.

The default model is one; `gapless.testing` writes its test checkpoints with the same code. Each is
saved with transformers' own config class and `save_pretrained`, so the engine's loader reads the real
on-disk format and `AutoModelForCausalLM` loads the same directory as the reference in parity tests.
Nothing here imports the rest of gapless, so the checkpoints stay an independent yardstick.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PretrainedConfig

from gapless import env
from gapless.default_model.tokenizer import FILLER_TEXT, build_tokenizer, trained_tokenizer_json

if TYPE_CHECKING:  # (transformers' modeling code imports torch._dynamo: ~1.6 s a process that needs none)
    from transformers import PreTrainedModel

# RoPE goes in as `rope_theta` / `rope_scaling`: transformers 5 folds them into `rope_parameters`
# (which is what config.json then carries), and 4.x takes them as they are.
COMMON: dict[str, Any] = dict(
    max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0
)

# Re-initialisation scales (see `_spread_init`): logit std ~ LOGIT_STD, each linear roughly
# variance-preserving times LINEAR_GAIN.
LOGIT_STD = 2.0
LINEAR_GAIN = 1.5
EMBED_STD = 1.0
NORM_NOISE = 0.1
BIAS_STD = 0.1


def shape(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra: Any
) -> dict[str, Any]:
    """A model's shape as transformers' config keywords: hidden and MLP width, layers, query and KV heads."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


TINY = shape(64, 128, 2, 4, 2)  # the tiny models' shape: forwards in milliseconds on one CPU core
QWEN3_TINY = dict(TINY, head_dim=32, tie_word_embeddings=True)  # head_dim 32 != 64/4, on purpose


def random_config(config_class: type[PretrainedConfig], *settings: dict[str, Any]) -> PretrainedConfig:
    """`config_class` with the common settings and the built-in tokenizer's vocabulary and special ids,
    then each of `settings` in turn (a later one wins: a real model's shape may bring its own vocab)."""
    tokenizer = build_tokenizer()
    kwargs: dict[str, Any] = dict(COMMON)
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for more in settings:
        kwargs.update(copy.deepcopy(more))  # configs mutate the rope dicts they are given
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    return config_class(**kwargs)


def recipe() -> dict[str, Any]:
    """What decides a written checkpoint's bytes besides its config and arguments: the init scales and
    the tokenizer. Cache keys hash it, so a changed recipe never reuses a stale directory."""
    return dict(
        init=[LOGIT_STD, LINEAR_GAIN, EMBED_STD, NORM_NOISE, BIAS_STD],
        tokenizer=hashlib.sha256(trained_tokenizer_json().encode()).hexdigest(),
        tokenizer_filler=FILLER_TEXT,  # how a vocabulary past the trained one is filled
    )


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
        elif p.dim() in (2, 3):  # a linear's [out, in], or stacked experts' [experts, out, in]
            normal_(p, 0.0, LINEAR_GAIN / math.sqrt(p.shape[-1]))
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
    from transformers import AutoModelForCausalLM

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


def write_checkpoint(
    path: str | Path,
    config: PretrainedConfig,
    *,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight checkpoint of `config` (config, safetensors, tokenizer, generation config).

    `shards > 1` picks a shard size that makes transformers split the weights into several
    `model-0000i-of-0000n.safetensors` files plus an index (about `shards` of them; whole tensors
    never split, so the count is approximate but always > 1).
    """
    path = Path(path)
    model = _uninitialised_model(config, seed)  # float32: init and cast happen after
    _spread_init(model, seed)
    model = model.to(dtype).eval()  # type: ignore[arg-type]  # transformers wraps `to` so mypy sees it unbound

    max_shard_size: int | str = "50GB"
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        max_shard_size = max(1, math.ceil(total / shards))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)

    # every id of the model's vocabulary decodes to text, however far past the trained tokenizer's it goes
    tokenizer = build_tokenizer(vocab_size=config.vocab_size)
    tokenizer.model_max_length = config.max_position_embeddings
    save_tokenizer(tokenizer, path)
    return path


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Write `tokenizer` into the checkpoint at `path`, and a generation config of its special tokens."""
    tokenizer.save_pretrained(str(path))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(path))


def cache_dir() -> Path:
    """Root of the on-disk cache: `$GAPLESS_CACHE` or `~/.cache/gapless`."""
    root = env.CACHE.get()
    return Path(root) if root else Path.home() / ".cache" / "gapless"


def build_atomically(target: Path, build: Callable[[Path], Any]) -> Path:
    """`target`, built by `build` into a private temp dir next to it and renamed into place if missing.

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
