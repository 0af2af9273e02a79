"""Where a checkpoint declares its quantized format, read before any weight loads: config.json's
`quantization_config` (`compression_config` in older compressed-tensors checkpoints), ModelOpt's
`hf_quant_config.json`, or AutoGPTQ's and AutoAWQ's own files; and the KV cache format a ModelOpt config
names. `gapless.model.quant.formats` turns what they say into a `QuantSpec`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gapless.model.quant.formats import FP8_MIN_CAPABILITY, QuantFormatError, config_method, modelopt_algo

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MODELOPT_FILE = "hf_quant_config.json"  # ModelOpt's own record of a checkpoint's format

# AutoGPTQ's and AutoAWQ's own records of a checkpoint's format, from before transformers wrote it into
# config.json (vLLM reads them too); a record without a `quant_method` is AWQ's by AWQ's own keys
LEGACY_FILES = ("quantize_config.json", "quant_config.json")
_AWQ_KEYS = ("w_bit", "q_group_size", "version", "zero_point")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise QuantFormatError(f"{file.name} of {file.parent} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise QuantFormatError(f"{file.name} of {file.parent} is not a JSON object")
    return data


def _legacy(path: Path) -> dict[str, Any] | None:
    """The first of `LEGACY_FILES` in `path`, its `quant_method` filled in where it says none (awq where it
    has AWQ's keys, else gptq: AutoGPTQ's `quantize_config.json`)."""
    file = next((path / f for f in LEGACY_FILES if (path / f).is_file()), None)
    if file is None:
        return None
    qcfg = _read_json(file)
    if not qcfg.get("quant_method"):
        qcfg["quant_method"] = "awq" if any(k in qcfg for k in _AWQ_KEYS) else "gptq"
    return qcfg


def _declared(path: Path) -> dict[str, Any] | None:
    """A checkpoint directory's quantization config as written: config.json's `quantization_config`
    (`compression_config` in older compressed-tensors checkpoints), else ModelOpt's `hf_quant_config.json`
    as `quant_method: modelopt`, else AutoGPTQ's or AutoAWQ's own file (`LEGACY_FILES`); None: none, or
    no checkpoint directory (a GGUF file)."""
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file():
        return None
    cfg = _read_json(cfg_file)
    key = "quantization_config" if cfg.get("quantization_config") else "compression_config"
    qcfg = cfg.get(key)
    if qcfg and not isinstance(qcfg, dict):
        raise QuantFormatError(f"config.json's {key} is not a JSON object: {qcfg!r}")
    if not qcfg and (path / MODELOPT_FILE).is_file():
        qcfg = {**_read_json(path / MODELOPT_FILE), "quant_method": "modelopt"}
    return dict(qcfg) if qcfg else _legacy(path)


def _is_modelopt(qcfg: dict[str, Any]) -> bool:
    return config_method(qcfg) == "modelopt"


def checkpoint_quantization(path: Path) -> dict[str, Any] | None:
    """The quantization config of a checkpoint's weights (`_declared`); None: float weights, among them a
    ModelOpt export without a `quant_algo`, which quantizes the KV cache alone (`checkpoint_kv_cache`)."""
    qcfg = _declared(path)
    if qcfg is None or _is_modelopt(qcfg) and not modelopt_algo(qcfg):
        return None
    return qcfg


def checkpoint_kv_cache(path: Path, device: torch.device | str) -> str | None:
    """The KV cache format a checkpoint's ModelOpt config names, which `--kv-cache-dtype auto` takes (as
    vLLM does): "fp8_e4m3" where its `kv_cache_scheme` is static 8-bit floats or its `kv_cache_quant_algo`
    FP8 (at the top of the config or under `quantization`); None where it names none, or one not built
    (NVFP4), or where `device` is a GPU older than e4m3 needs (Triton's e4m3 takes sm_89: an Ampere GPU
    keeps the model's dtype, as vLLM's fix for older GPUs does), each of those logged."""
    qcfg = _declared(path)
    if qcfg is None or not _is_modelopt(qcfg):
        return None
    inner = qcfg.get("quantization")
    places = [inner, qcfg] if isinstance(inner, dict) else [qcfg]
    named = [p.get(key) for key in ("kv_cache_scheme", "kv_cache_quant_algo") for p in places]
    kv = next((k for k in named if k), None)
    if isinstance(kv, dict):
        static_fp8 = (kv.get("type"), kv.get("num_bits"), kv.get("dynamic")) == ("float", 8, False)
        kv = "FP8" if static_fp8 else str(kv)
    if kv is None:
        return None
    if str(kv).upper() != "FP8":
        log.warning("the checkpoint's KV cache format %s is not built: the cache is in the model's dtype", kv)
        return None
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        log.warning("the checkpoint's fp8 KV cache needs sm_89 or newer: the cache is in the model's dtype")
        return None
    return "fp8_e4m3"
