"""Load a model: a Hugging Face checkpoint directory (config.json + single or sharded *.safetensors) or a
GGUF file (dequantized by `gapless.model.gguf`). Both yield Hugging Face names and layouts, so one loop
places either."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from gapless.model import gguf, moe, parallel
from gapless.model.config import ModelConfig, load_model_config
from gapless.model.cpu_gemm import pack_cpu_gemms
from gapless.model.decoder import CausalLM
from gapless.model.gguf import is_gguf_file
from gapless.model.layers import default_weight_loader

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` means the checkpoint's dtype on an accelerator and float32 on the CPU (where bf16 is slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(cfg.torch_dtype or "bfloat16", torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight of a checkpoint directory or a GGUF file, under its Hugging Face name; a checkpoint's
    with a progress bar on stderr (by bytes read: a big model loads for minutes, and the bar shows it
    moving)."""
    if is_gguf_file(path):
        yield from gguf.iter_weights(path)
        return
    files = safetensors_files(path)
    with tqdm(
        total=sum(f.stat().st_size for f in files), desc="loading weights", unit="B", unit_scale=True
    ) as bar:
        done = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.nbytes)
                    yield name, tensor
            done += file.stat().st_size
            bar.update(done - bar.n)  # the file's header


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> CausalLM:
    """The checkpoint's model in `dtype` on `device`; `max_positions` as `CausalLM` takes it."""
    path = Path(path)
    cfg = load_model_config(path)
    parallel.check_shardable(cfg, parallel.current().size)
    with _default_dtype(dtype), torch.device(device):
        model = CausalLM(cfg, max_positions)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in iter_weights(path):
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head shares the embedding table
        loaded.update(_place(model, params, name, tensor.to(dtype)))
    missing = sorted(_expected(model) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(missing[:8])}")
    return pack_cpu_gemms(model.requires_grad_(False).eval())


def _place(
    model: CausalLM, params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor
) -> list[str]:
    """Load one checkpoint tensor into its parameter; the names it filled (`name#shard` for a fused one).

    A separate q/k/v or gate/up tensor goes into its shard of the fused parameter; a tensor the checkpoint
    already fuses (Phi-3's `qkv_proj`, `gate_up_proj`) is split along its rows into every shard."""
    shard = None
    target = moe.checkpoint_target(name)  # one expert's projection, or Mixtral's router
    if target is not None:
        name, shard = target
    for frag, (fused, shard_id) in CausalLM.fused_weights.items():
        if target is None and frag in name:
            name, shard = name.replace(frag, fused), shard_id
            break
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint weight {name!r} has no place in the {model.cfg.architecture} model")
    loader = getattr(param, "weight_loader", default_weight_loader)
    # where each shard sits in the checkpoint's fused tensor (whole, whatever this rank keeps of it)
    offsets = getattr(_owner(model, name), "checkpoint_offsets", None)
    if shard is None and offsets:
        if tensor.shape[0] != sum(n for _, n in offsets.values()):
            whole = sum(n for _, n in offsets.values())
            raise ValueError(f"fused weight {name!r} has {tensor.shape[0]} rows, the model {whole}")
        for shard_id, (off, n) in offsets.items():
            loader(param, tensor.narrow(0, off, n), shard_id)
        return [f"{name}#{s}" for s in offsets]
    loader(param, tensor, shard)
    return [name if shard is None else f"{name}#{shard}"]


def _expected(model: CausalLM) -> set[str]:
    """The names `_place` must fill: each parameter, or each of its shards (`name#shard`) where its module
    lists them (a fused projection's `shard_offsets`, the experts' `checkpoint_shards`)."""
    expected = set()
    for name, _ in model.named_parameters():
        owner = _owner(model, name)
        if isinstance(owner, moe.Experts):
            shards = owner.checkpoint_shards(name.rsplit(".", 1)[1])
        else:
            shards = list(getattr(owner, "shard_offsets", None) or ())
        expected.update([f"{name}#{s}" for s in shards] if shards else [name])
    return expected


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])
