"""What can be known about an engine's options before a process starts or a weight loads.

`gapless serve` and `gapless chat` run `check_engine_config` first, so a checkpoint that is not there, an
architecture gapless cannot run, or a device this machine lacks is one line within a second, rather than
a worker's traceback after the model began loading. Only the device check imports torch, and only for a
CUDA device.
"""

from __future__ import annotations

from pathlib import Path

from gapless.config import EngineConfig
from gapless.model.config import ModelConfig, load_model_config

# the files one of which a Hugging Face tokenizer loads from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_engine_config(cfg: EngineConfig) -> ModelConfig:
    """The checkpoint's model config, once the checkpoint and the device are known to be usable;
    ValueError (one line, naming what is wrong) otherwise."""
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{cfg.model!r} is not a Hugging Face checkpoint directory (no config.json)")
    try:  # refuses, by name, an architecture or a feature the decoder lacks
        mcfg = load_model_config(path)
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'} lacks {e}") from None
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        raise ValueError(f"{cfg.model!r} has no *.safetensors weights (the only format gapless reads)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{cfg.model!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    check_device(cfg.device)
    return mcfg


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
