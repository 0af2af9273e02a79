"""A PEFT LoRA adapter, read and checked against the base model, laid out on gapless's layers.

PEFT adapts `q_proj`, `k_proj`, ... of each layer with `x A^T B^T * scaling` (scaling: alpha / r, or
alpha / sqrt(r) with rslora). gapless fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so each
PEFT module maps onto its slice of a fused layer: its A into that slice's block of the layer's rank
dimension, its B into that slice's output rows (`ModuleDelta`). The scaling is folded into B here. Every
refusal is a `LoRAError` naming the adapter and what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from gapless.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter gapless refuses: the message names the adapter and what is wrong."""


class Slice(NamedTuple):
    """Where one PEFT module sits in a gapless layer: its block of the rank dimension, its output rows."""

    layer: str  # gapless's module: qkv_proj, o_proj, gate_up_proj, down_proj
    block: int  # which max_rank-wide block of the layer's rank dimension holds its A and B columns
    rows: tuple[str, ...]  # the layer's output shards it writes (all of them for a fused checkpoint name)


# PEFT module name -> its place in gapless's layers
SLICES: dict[str, Slice] = {
    "q_proj": Slice("qkv_proj", 0, ("q",)),
    "k_proj": Slice("qkv_proj", 1, ("k",)),
    "v_proj": Slice("qkv_proj", 2, ("v",)),
    "qkv_proj": Slice("qkv_proj", 0, ("q", "k", "v")),  # Phi-3 names the fused layer
    "o_proj": Slice("o_proj", 0, ("out",)),
    "gate_proj": Slice("gate_up_proj", 0, ("gate",)),
    "up_proj": Slice("gate_up_proj", 1, ("up",)),
    "gate_up_proj": Slice("gate_up_proj", 0, ("gate", "up")),
    "down_proj": Slice("down_proj", 0, ("out",)),
}
# gapless's adapted layers -> how many max_rank blocks their rank dimension has
BLOCKS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
MLP_LAYERS = ("gate_up_proj", "down_proj")

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# a mixture of experts' expert weights, however PEFT names them: per expert (`mlp.experts.3.gate_proj`,
# Mixtral's `block_sparse_moe.experts.3.w1`), Qwen2-MoE's `mlp.shared_expert.*`, or the stacked 3D
# parameters (`mlp.experts.lora_A`, from `target_parameters`)
_EXPERT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(experts|shared_expert)\b")
EXPERTS_REFUSED = (
    "LoRA on mixture-of-experts experts is not supported (gapless adapts a MoE model's attention "
    "and its dense MLP layers)"
)


class LayerShape(NamedTuple):
    """A gapless layer's input width and its output shards (name -> (row offset, rows))."""

    in_features: int
    shards: dict[str, tuple[int, int]]

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.shards.values())


def layer_shapes(cfg: ModelConfig) -> dict[str, LayerShape]:
    """The adapted layers' whole shapes for a model (a rank's piece: `gapless.lora.shard`)."""
    q, kv, h, inter = cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv_proj": LayerShape(h, {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}),
        "o_proj": LayerShape(q, {"out": (0, h)}),
        "gate_up_proj": LayerShape(h, {"gate": (0, inter), "up": (inter, inter)}),
        "down_proj": LayerShape(inter, {"out": (0, h)}),
    }


class ModuleDelta(NamedTuple):
    """One PEFT module's weights on a gapless layer: A [r, in] into rank block `block`, B (scaled)
    [rows, r] into output rows [row, row + rows)."""

    layer: int
    name: str  # gapless's layer: qkv_proj, ...
    block: int
    row: int
    a: torch.Tensor
    b: torch.Tensor


class AdapterWeights(NamedTuple):
    """A checked adapter: its rank and its modules' weights (float32, on the CPU)."""

    name: str
    rank: int
    deltas: list[ModuleDelta]

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas)


def _read_config(name: str, path: Path) -> dict:
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).is_file():
            extra = " (only safetensors adapters are read)" if f == WEIGHTS_FILE else ""
            raise LoRAError(f"LoRA adapter {name!r}: {path / f} is missing{extra}")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {path / CONFIG_FILE} is not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return cfg


def _scaling(name: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the adapter's config, or a refusal of what gapless does not run."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {  # (target_parameters first: PEFT adds rank/alpha patterns for the experts it targets)
        "target_parameters": "LoRA on parameters (a mixture's stacked experts)",
        "use_dora": "DoRA",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "modules_to_save": "modules_to_save",
        "layer_replication": "layer_replication",
        "lora_bias": "a LoRA bias",
        "trainable_token_indices": "trainable_token_indices",
        "alora_invocation_tokens": "activated LoRA",
        "use_qalora": "QA-LoRA",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} ({key} in {CONFIG_FILE}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r={r!r} in {CONFIG_FILE} must be an int >= 1")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha={alpha!r} in {CONFIG_FILE} must be a number")
    if r > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {r} is above max_lora_rank={max_rank} (--max-lora-rank)"
        )
    return r, float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _check_targets(name: str, cfg: dict, moe: bool) -> None:
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        missing = sorted(t.rsplit(".", 1)[-1] for t in targets if t.rsplit(".", 1)[-1] not in SLICES)
        if moe and set(missing) & {"w1", "w2", "w3"}:  # Mixtral's expert projections
            raise LoRAError(f"LoRA adapter {name!r}: target modules {missing} are experts: {EXPERTS_REFUSED}")
        if missing:
            raise LoRAError(
                f"LoRA adapter {name!r}: target modules {missing} are not in the model "
                f"(gapless adapts {sorted(SLICES)})"
            )


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterWeights:
    """The adapter at `path` checked against the model `cfg` (rank <= `max_rank`, modules the model has,
    the model's shapes), its weights laid out on gapless's layers; `LoRAError` naming what is wrong."""
    path = Path(path)
    acfg = _read_config(name, path)
    rank, scaling = _scaling(name, acfg, max_rank)
    _check_targets(name, acfg, any(cfg.moe_layers))
    shapes = layer_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  # safe_open is no mapping: keys() is its listing
            expert = _EXPERT_KEY.search(key)
            if expert is not None:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key!r} adapts the {expert.group(2).replace('_', ' ')} of "
                    f"layer {expert.group(1)}: {EXPERTS_REFUSED}"
                )
            m = _KEY.search(key)
            if m is None or m.group(3) not in SLICES or "vision" in key or "projector" in key:
                raise LoRAError(
                    f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a module the "
                    f"model has (gapless adapts {sorted(SLICES)} of each layer)"
                )
            layer, module = int(m.group(1)), m.group(3)
            if layer >= cfg.num_layers:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key!r} adapts layer {layer}; the model has {cfg.num_layers}"
                )
            if SLICES[module].layer in MLP_LAYERS and cfg.moe_layers[layer]:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key!r} adapts the MLP of layer {layer}, a mixture of experts: "
                    f"{EXPERTS_REFUSED}"
                )
            pairs.setdefault((layer, module), {})[m.group(4)] = f.get_tensor(key).float()
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    deltas = []
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} but not both A and B")
        sl = SLICES[module]
        shape = shapes[sl.layer]
        row = shape.shards[sl.rows[0]][0]
        rows = sum(shape.shards[s][1] for s in sl.rows)
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.shape != (r, shape.in_features) or b.shape != (rows, r):
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model "
                f"needs A (r, {shape.in_features}) and B ({rows}, r): an adapter of another base model?"
            )
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has rank {r}, above max_lora_rank={max_rank}")
        deltas.append(ModuleDelta(layer, sl.layer, sl.block, row, a, b * scaling))
    return AdapterWeights(name, rank, deltas)
