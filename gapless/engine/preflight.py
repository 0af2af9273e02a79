"""What can be known about an engine's options before a process starts or a weight loads.

`Engine` runs `check_engine_config` first, and so do `gapless serve` and `gapless chat` before they start
any worker: a model that cannot be found or fetched, a checkpoint without weights or tokenizer, weight
files missing or cut short (`gapless.model.weight_files`), an architecture gapless cannot run, a sampling
default no request could set (or a `generation_config` folder without the file), a `max_model_len` past
the model's context, or a device this machine lacks is one line within a second, rather than a worker's
traceback after the model began loading. Only the device check imports torch, and only for a CUDA device.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import NamedTuple

from gapless import env
from gapless.config import FP8_KV_CACHE_DTYPES, NO_CHUNKING, EngineConfig
from gapless.engine.pooling import pooling_spec
from gapless.model import weight_files
from gapless.model.config import ModelConfig, load_model_config
from gapless.model.generation_config import generation_defaults
from gapless.model.quant import declared, formats
from gapless.model.source import localize

log = logging.getLogger(__name__)

# the files one of which a Hugging Face tokenizer loads from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# set to 1 to accept a max_model_len above the model's max_position_embeddings (as vLLM's
# VLLM_ALLOW_LONG_MAX_MODEL_LEN): RoPE then runs on positions the model never saw in training
ALLOW_LONG_MAX_MODEL_LEN_ENV = env.ALLOW_LONG_MAX_MODEL_LEN.name


class CheckedConfig(NamedTuple):
    """An engine config found usable, and its model's config."""

    cfg: EngineConfig  # with its model made local
    model: ModelConfig


def check_engine_config(cfg: EngineConfig) -> CheckedConfig:
    """`cfg` with its model made local (see `gapless.model.source.localize`: fetched or downloaded when
    it names a built-in model or a Hugging Face id) and the model's config, once the checkpoint, the
    context length and the device are known to be usable; ValueError (one line, naming what is wrong)
    otherwise. Idempotent."""
    cfg = localize(cfg)  # refuses, by name, an architecture or a feature the decoder lacks
    path = Path(cfg.model)
    if cfg.load_format in ("safetensors", "gguf", "bitsandbytes") and path.is_dir() == (
        cfg.load_format == "gguf"
    ):
        kind = "a safetensors checkpoint" if path.is_dir() else "a GGUF file"
        raise ValueError(f"--load-format {cfg.load_format}: {cfg.model} is {kind}")
    # (vLLM's older name for reading one, or with `--quantization bitsandbytes` for quantizing a float one
    # at load: `auto` loads either alike)
    if cfg.load_format == "bitsandbytes":
        qcfg = declared.checkpoint_quantization(path)
        method = (qcfg or {}).get("quant_method")
        in_flight = qcfg is None and cfg.quantization == "bitsandbytes"
        if str(method).lower() != "bitsandbytes" and not in_flight:
            hint = "" if qcfg else "; with --quantization bitsandbytes a float one is quantized at load"
            raise ValueError(
                f"--load-format bitsandbytes: {cfg.model} is no bitsandbytes checkpoint "
                f"(quant_method {method!r}){hint}"
            )
    mcfg = load_model_config(path)
    if path.is_dir():  # a GGUF file carries its weights and tokenizer
        weights = (path / weight_files.SAFETENSORS_INDEX).is_file() or any(path.glob("*.safetensors"))
        if cfg.load_format != "dummy":  # (dummy: random weights, none are read)
            if not weights:
                raise ValueError(f"{cfg.model!r} has no *.safetensors weights (nor is it a GGUF file)")
            weight_files.check_whole(path)  # (headers only: a shard missing or cut short, an LFS pointer)
        tokenizer = Path(cfg.tokenizer) if cfg.tokenizer is not None else path
        if not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{tokenizer} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    generation_defaults(cfg.model, cfg.generation_config)  # a checkpoint default no request could set
    check_max_model_len(cfg.max_model_len, mcfg.max_position_embeddings, cfg.model)
    if cfg.chunked_prefill_size == NO_CHUNKING:  # (a budget of the longest prompt: none is chunked)
        longest = cfg.max_model_len or mcfg.max_position_embeddings
        cfg = dataclasses.replace(cfg, chunked_prefill_size=longest, max_model_len=longest)
    check_device(cfg.device)
    spec = check_quantization(cfg, path)
    check_tensor_parallel(cfg, mcfg)
    blocks_cut = spec is not None and spec.weight_block is not None and cfg.tensor_parallel_size > 1
    if spec is not None and (spec.online or blocks_cut):  # (the layers as the ranks cut them)
        from gapless.model.loader import check_layers

        check_layers(mcfg, spec, cfg.tensor_parallel_size, path)
    pooling_spec(cfg)  # a sentence-transformers config gapless cannot run
    if mcfg.mrope_section is not None and cfg.speculative_algorithm is not None:  # (verify: 1-D positions)
        raise ValueError("speculative decoding of an M-RoPE model (Qwen2.5-VL) is not supported")
    return CheckedConfig(cfg, mcfg)


def check_tensor_parallel(cfg: EngineConfig, mcfg: ModelConfig) -> None:
    """ValueError when the model does not split over `tensor_parallel_size` ranks, or when a node's
    CUDA ranks outnumber its GPUs (one GPU a rank: a single GPU cannot run tensor parallelism)."""
    if cfg.tensor_parallel_size == 1:
        return
    import torch

    from gapless.model.parallel import check_shardable

    check_shardable(mcfg, cfg.tensor_parallel_size)
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if on_cuda and per_node > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={cfg.tensor_parallel_size} over {cfg.nnodes} node(s) runs {per_node} "
            f"ranks here, one GPU each, but this machine has {torch.cuda.device_count()}"
        )


def check_quantization(cfg: EngineConfig, path: Path) -> formats.QuantSpec | None:
    """The weights' quantized format (None: float, or a GGUF file's own); QuantFormatError (a ValueError,
    one line naming the format) for a format, of the weights or the KV cache, that is unknown or that the
    device cannot run (`gapless.model.quant.formats`); imports torch only when there is one."""
    qcfg = declared.checkpoint_quantization(path)
    if qcfg is None and cfg.quantization is None and cfg.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        return None
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    formats.check_kv_cache(cfg.kv_cache_dtype, device)
    if qcfg is None and cfg.quantization is None:
        return None
    if not path.is_dir():  # a GGUF file
        formats.check_gguf_flag(cfg.quantization)
        return None
    return formats.resolve(qcfg, cfg.quantization, device)


def check_max_model_len(max_model_len: int | None, limit: int, model: str) -> None:
    """A max_model_len past the model's own context length is refused; GAPLESS_ALLOW_LONG_MAX_MODEL_LEN=1
    accepts it with a warning."""
    if max_model_len is None or max_model_len <= limit:
        return
    what = (
        f"max_model_len={max_model_len} is more than the model's context length "
        f"(max_position_embeddings={limit} in {model})"
    )
    if not env.ALLOW_LONG_MAX_MODEL_LEN.get():
        raise ValueError(
            f"{what}; lower it, or set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to run past it anyway (outputs "
            "beyond the trained length may be wrong)"
        )
    log.warning("%s; allowed by %s=1: outputs beyond it may be wrong", what, ALLOW_LONG_MAX_MODEL_LEN_ENV)


def check_device(device: str) -> None:
    """ValueError unless `device` exists here (`auto` and `cpu` always do)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {device!r}: CUDA is not available ({why}); use device cpu or auto")
    number = device.partition(":")[2]
    if number and not number.isdigit():
        raise ValueError(f"device {device!r}: expected cuda or cuda:N")
    if int(number or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
