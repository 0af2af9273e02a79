"""The sampling defaults a checkpoint ships: what a request samples with where it leaves a knob unset.

A Hugging Face checkpoint carries them in `generation_config.json` (Qwen3's: temperature 0.6, top_k 20,
top_p 0.95); a GGUF file may carry them as `general.sampling.*` metadata (`gapless.model.gguf`), though
most GGUF files, the default model's included, have none. As vLLM's `--generation-config`:

- `auto` (the default): the model's own, from the directory's `generation_config.json` or the GGUF file;
- `vllm`: none, so unset knobs take the library's defaults (`gapless.sampling_params.LIBRARY_DEFAULTS`);
- a folder: the `generation_config.json` in it.

Only the knobs `SamplingParams` lets a checkpoint default are read (temperature, top_p, top_k, min_p,
repetition_penalty); like vLLM, `do_sample` is not consulted, and a top_k of 0 (off, in transformers and
llama.cpp) is read as -1, gapless's off. EOS ids are the model's config (`gapless.model.config`), read
whatever this setting is: they say where the model's text ends, not how to sample it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gapless.model.gguf import generation_config_dict, is_gguf_file
from gapless.sampling_params import CHECKPOINT_DEFAULTABLE, check_sampling_value

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_SETTINGS = ("auto", "vllm")  # or a folder holding a generation_config.json


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """The directory's `generation_config.json` as a dict; {} when it has none."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    found = json.loads(path.read_text())
    if not isinstance(found, dict):
        raise ValueError(f"{path} is not a JSON object")
    return found


def generation_defaults(model: str | Path, setting: str = "auto") -> dict[str, float | int]:
    """The sampling defaults of `model` (a checkpoint directory or a GGUF file) under `setting` (see the
    module's docstring), each checked as a request's own value would be: ValueError, naming the file and
    the knob, for one a request could not set (or for a folder without a generation_config.json)."""
    if setting == "vllm":
        return {}
    if setting == "auto" and is_gguf_file(model):
        return _checked(generation_config_dict(model), str(model))
    folder = Path(model) if setting == "auto" else Path(setting).expanduser()
    if setting != "auto" and not (folder / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(
            f"generation_config={setting!r}: expected auto, vllm, or a folder holding "
            f"{GENERATION_CONFIG_FILE}"
        )
    return _checked(read_generation_config(folder), str(folder / GENERATION_CONFIG_FILE))


def _checked(fields: dict[str, Any], where: str) -> dict[str, float | int]:
    defaults: dict[str, float | int] = {}
    for name in CHECKPOINT_DEFAULTABLE:
        value = fields.get(name)
        if value is None:
            continue
        if name == "top_k" and value == 0:  # transformers' and llama.cpp's "off"
            value = -1
        try:
            defaults[name] = check_sampling_value(name, value)
        except ValueError as e:
            raise ValueError(
                f"{where}: a default a request could not set ({e}); --generation-config vllm ignores the "
                "checkpoint's sampling defaults"
            ) from None
    return defaults


def describe(defaults: dict[str, float | int]) -> str:
    """`temperature=0.6, top_p=0.95`: the defaults as the start-up log names them."""
    return ", ".join(f"{name}={value:g}" for name, value in defaults.items())
