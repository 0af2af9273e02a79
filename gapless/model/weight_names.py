"""The names a checkpoint's tensors fill: the model parameter (and the shard of it) a tensor loads into,
and the names (`param` or `param#shard`) a parameter is whole with, so the loader can tell a complete
checkpoint, and a layer whose tensors have all arrived, from one still loading."""

from __future__ import annotations

from typing import Any

import torch

from gapless.model import moe
from gapless.model.decoder import CausalLM


def target(name: str) -> tuple[str, Any]:
    """(the parameter, the shard of it) a checkpoint tensor `name` fills; shard None: the whole of it (an
    expert's: (expert, "gate" | "up" | "down"); a fused projection's: "q", "k", "v", "gate", "up")."""
    found = moe.checkpoint_target(name)  # one expert's projection, or Mixtral's router
    if found is not None:
        return found
    for frag, (fused, shard_id) in CausalLM.fused_weights.items():
        if frag in name:
            return name.replace(frag, fused), shard_id
    return name, None


def owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    """The module that holds parameter `param_name`."""
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def names_of(model: torch.nn.Module, name: str) -> list[str]:
    """The names the loader fills parameter `name` by: each of its shards (`name#shard`) where its module
    lists them (a fused projection's `shard_offsets`, the experts' `checkpoint_shards`), else `name`."""
    module = owner(model, name)
    if isinstance(module, moe.Experts):
        shards = module.checkpoint_shards(name.rsplit(".", 1)[1])
    else:
        shards = list(getattr(module, "shard_offsets", None) or ())
    return [f"{name}#{s}" for s in shards] if shards else [name]


def expected(model: torch.nn.Module) -> set[str]:
    """The names a complete load fills: each parameter's `names_of`."""
    return {n for name, _ in model.named_parameters() for n in names_of(model, name)}


def filled_by(model: torch.nn.Module, name: str) -> list[str]:
    """The names a whole checkpoint tensor `name` fills: its parameter's shard, or every shard where the
    checkpoint stores a fused projection whole (Phi-3's `qkv_proj`, `gate_up_proj`)."""
    param, shard = target(name)
    offsets = getattr(owner(model, param), "checkpoint_offsets", None)
    if shard is None and offsets:
        return [f"{param}#{s}" for s in offsets]
    return [param if shard is None else f"{param}#{shard}"]


def weights_of(model: torch.nn.Module, layer: str) -> set[str]:
    """The names a linear layer's weight, or a mixture layer's experts' (gate/up's and down's), is whole
    with: what a quantized form of the layer needs before it can be made."""
    experts = isinstance(model.get_submodule(layer), moe.Experts)
    weights = ("gate_up_proj", "down_proj") if experts else ("weight",)
    return {n for w in weights for n in names_of(model, f"{layer}.{w}")}
