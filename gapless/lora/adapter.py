"""A PEFT LoRA adapter, read and checked against the base model, laid out on gapless's layers.

PEFT adapts `q_proj`, `k_proj`, ... of each layer with `x A^T B^T * scaling` (scaling: alpha / r, or
alpha / sqrt(r) with rslora). gapless fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so each
PEFT module maps onto its slice of a fused layer: its A into that slice's block of the layer's rank
dimension, its B into that slice's output rows (`ModuleDelta`). A mixture's experts come stacked
(`ExpertDelta`: A [E, r, in], B [E, rows, r] per layer and projection), from either of PEFT's layouts:
`target_parameters` on the stacked 3D parameters of transformers 5 (`mlp.experts.gate_up_proj`,
`down_proj`: A [r E, in] and B [out, r E], which nested wrapper adapts which read from its shapes), or
one module per expert (`mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`, as
transformers 4 named them). The scaling is folded into B here. Every refusal is a `LoRAError` naming the
adapter and what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from gapless.model.config import ModelConfig
from gapless.model.weight_files import WeightFileError, check_safetensors

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
# a mixture's experts: stacked (`target_parameters`: `mlp.experts.[base_layer.]*lora_A.weight`, one
# `base_layer.` per wrapper around it) or one module per expert
_STACKED_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$")
_EXPERT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_([AB])\.weight$"
)
# per-expert PEFT module -> (gapless's stacked expert parameter, rank block, output shard)
EXPERT_SLICES = {
    "gate_proj": ("gate_up_proj", 0, "gate"),
    "up_proj": ("gate_up_proj", 1, "up"),
    "down_proj": ("down_proj", 0, "out"),
    "w1": ("gate_up_proj", 0, "gate"),
    "w3": ("gate_up_proj", 1, "up"),
    "w2": ("down_proj", 0, "out"),
}
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # what `target_parameters` may name (transformers 5's)
_SHARED_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.shared_expert\b")
SHARED_REFUSED = "LoRA on Qwen2-MoE's shared expert is not supported (its experts and attention are)"


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


def expert_shapes(cfg: ModelConfig) -> dict[str, LayerShape]:
    """One expert's shapes of a mixture's layers: `gate_up_proj` [2I, H], `down_proj` [H, I]."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    return {
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


class ExpertDelta(NamedTuple):
    """One mixture layer's experts' weights on gapless's stacked parameter `name` (gate_up_proj,
    down_proj): A [E, r, in] into rank block `block`, B (scaled) [E, rows, r] into rows [row, row + rows)."""

    layer: int
    name: str
    block: int
    row: int
    a: torch.Tensor
    b: torch.Tensor


class AdapterWeights(NamedTuple):
    """A checked adapter: its rank and its modules' weights (float32, on the CPU), a mixture's experts
    apart."""

    name: str
    rank: int
    deltas: list[ModuleDelta]
    experts: list[ExpertDelta] = []

    @property
    def nbytes(self) -> int:
        pairs = [(d.a, d.b) for d in self.deltas] + [(x.a, x.b) for x in self.experts]
        return sum(a.nbytes + b.nbytes for a, b in pairs)


def _read_config(name: str, path: Path) -> dict:
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).is_file():
            extra = " (only safetensors adapters are read)" if f == WEIGHTS_FILE else ""
            raise LoRAError(f"LoRA adapter {name!r}: {path / f} is missing{extra}")
    try:
        check_safetensors(path / WEIGHTS_FILE)  # (cut short, or an LFS pointer: named, not a reader's error)
    except WeightFileError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {e}") from None
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {path / CONFIG_FILE} is not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return cfg


class Scaling(NamedTuple):
    """An adapter's scaling rule: alpha / r (alpha / sqrt(r) with rslora), r each module's own (its
    tensors' shape: what `rank_pattern` gave it) and alpha from `alpha_pattern` where one matches (PEFT
    writes both for the stacked experts it converts: gate and up as one `gate_up_proj` of twice the
    rank)."""

    alpha: float
    rslora: bool
    alpha_pattern: dict[str, float]

    def of(self, module: str, r: int) -> float:
        """The scaling of rank `r` of the module at path `module` (`model.layers.0.self_attn.q_proj`)."""
        alpha = next(
            (a for key, a in self.alpha_pattern.items() if re.match(rf"(.*\.)?({key})$", module)), self.alpha
        )
        return float(alpha) / (math.sqrt(r) if self.rslora else r)


def _scaling(name: str, cfg: dict, max_rank: int) -> tuple[int, Scaling]:
    """(rank, scaling rule) of the adapter's config, or a refusal of what gapless does not run."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA",
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
    patterns = cfg.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(isinstance(v, (int, float)) for v in patterns.values()):
        raise LoRAError(f"LoRA adapter {name!r}: alpha_pattern in {CONFIG_FILE} must map patterns to numbers")
    if r > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {r} is above max_lora_rank={max_rank} (--max-lora-rank)"
        )
    return r, Scaling(float(alpha), bool(cfg.get("use_rslora")), patterns)


def _check_targets(name: str, cfg: dict, moe: bool) -> list[str]:
    """The stacked expert parameters `target_parameters` names (gate_up_proj, down_proj); a refusal of
    target modules or parameters the model lacks."""
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        known = {*SLICES, *(EXPERT_SLICES if moe else ())}
        missing = sorted(t.rsplit(".", 1)[-1] for t in targets if t.rsplit(".", 1)[-1] not in known)
        if missing:
            raise LoRAError(
                f"LoRA adapter {name!r}: target modules {missing} are not in the model "
                f"(gapless adapts {sorted(known)})"
            )
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list):
        raise LoRAError(f"LoRA adapter {name!r}: target_parameters in {CONFIG_FILE} must be a list")
    stacked = [p.rsplit(".", 1)[-1] if isinstance(p, str) else p for p in params]
    wrong = [p for p, last in zip(params, stacked) if not moe or last not in EXPERT_PARAMS]
    if wrong:
        what = "the model has no experts" if not moe else f"gapless adapts experts.{'/'.join(EXPERT_PARAMS)}"
        raise LoRAError(f"LoRA adapter {name!r}: target_parameters {wrong} are not supported ({what})")
    return stacked


def load_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int, experts: bool = True
) -> AdapterWeights:
    """The adapter at `path` checked against the model `cfg` (rank <= `max_rank`, modules the model has,
    the model's shapes; a mixture's experts only where `experts`), its weights laid out on gapless's
    layers; `LoRAError` naming what is wrong."""
    path = Path(path)
    acfg = _read_config(name, path)
    rank, scaling = _scaling(name, acfg, max_rank)
    stacked = _check_targets(name, acfg, any(cfg.moe_layers))
    shapes = layer_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    groups: dict[tuple[int, str], str] = {}  # self_attn or mlp
    expert_reader = _ExpertReader(name, cfg, stacked, experts)
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  # safe_open is no mapping: keys() is its listing
            if (shared := _SHARED_KEY.search(key)) is not None:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key!r} adapts layer {shared.group(1)}: {SHARED_REFUSED}"
                )
            if expert_reader.take(key, f):
                continue
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
                    f"LoRA adapter {name!r}: {key!r} adapts the MLP of layer {layer}, a mixture of experts "
                    "(its experts are adapted as experts.gate_up_proj/down_proj, or experts.N.gate_proj ...)"
                )
            pairs.setdefault((layer, module), {})[m.group(4)] = f.get_tensor(key).float()
            groups[(layer, module)] = m.group(2)
    expert_deltas = expert_reader.deltas(scaling, max_rank)
    if not pairs and not expert_deltas:
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
        scale = scaling.of(f"model.layers.{layer}.{groups[(layer, module)]}.{module}", r)
        deltas.append(ModuleDelta(layer, sl.layer, sl.block, row, a, b * scale))
    return AdapterWeights(name, rank, deltas, expert_deltas)


class _ExpertReader:
    """An adapter's expert tensors, gathered while its file is read, then checked and stacked."""

    def __init__(self, adapter: str, cfg: ModelConfig, stacked: list[str], allowed: bool) -> None:
        self.adapter, self.cfg, self.stacked, self.allowed = adapter, cfg, stacked, allowed
        self.shapes = expert_shapes(cfg)
        # (layer, module, expert, A|B); a stacked parameter's: (layer, its wrapper depth, -1, A|B)
        self.tensors: dict[tuple[int, str, int, str], torch.Tensor] = {}

    def take(self, key: str, f: Any) -> bool:
        """Whether `key` is an expert tensor (kept); a refusal of one the model does not have."""
        m = _STACKED_KEY.search(key)
        if m is not None:
            if not self.stacked:
                raise LoRAError(
                    f"LoRA adapter {self.adapter!r}: {key!r} is a stacked experts' LoRA weight, but "
                    f"{CONFIG_FILE} names no target_parameters"
                )
            # which parameter a wrapper adapts is read from its shapes (PEFT's nesting order is not the
            # list's), in `deltas`
            module, expert, ab = f"depth {m.group(2).count('base_layer.')}", -1, m.group(3)
        elif (m := _EXPERT_KEY.search(key)) is not None:
            if m.group(3) not in EXPERT_SLICES:
                raise LoRAError(
                    f"LoRA adapter {self.adapter!r}: {key!r} adapts an expert's {m.group(3)}; gapless adapts "
                    f"{sorted(EXPERT_SLICES)}"
                )
            module, expert, ab = m.group(3), int(m.group(2)), m.group(4)
        else:
            return False
        if not self.allowed:
            raise LoRAError(
                f"LoRA adapter {self.adapter!r}: {key!r} adapts the experts, and this engine holds no LoRA "
                "slots for them (lora_experts off: --lora-experts)"
            )
        layer = int(m.group(1))
        if layer >= self.cfg.num_layers or not self.cfg.moe_layers[layer]:
            raise LoRAError(
                f"LoRA adapter {self.adapter!r}: {key!r} adapts the experts of layer {layer}, which is "
                "no mixture-of-experts layer of this model"
            )
        if expert >= self.cfg.num_experts:
            raise LoRAError(
                f"LoRA adapter {self.adapter!r}: {key!r} adapts expert {expert}; the model has "
                f"{self.cfg.num_experts}"
            )
        self.tensors[(layer, module, expert, ab)] = f.get_tensor(key).float()
        return True

    def _stacked_param(self, where: str, a: torch.Tensor, b: torch.Tensor) -> str:
        """The stacked parameter whose shapes A [r E, in] and B [out, r E] fit: gate_up_proj (H -> 2I) or
        down_proj (I -> H), never both; a refusal when neither does."""
        e = self.cfg.num_experts
        rows = a.shape[0]
        for param, shape in self.shapes.items():
            if (
                a.dim() == b.dim() == 2
                and rows % e == 0
                and a.shape[1] == shape.in_features
                and tuple(b.shape) == (shape.out_features, rows)
            ):
                return param
        fits = ", ".join(
            f"{p} A (r x {e}, {s.in_features}), B ({s.out_features}, r x {e})" for p, s in self.shapes.items()
        )
        raise LoRAError(
            f"LoRA adapter {self.adapter!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
            f"model's experts need {fits}: an adapter of another base model?"
        )

    def deltas(self, scaling: Scaling, max_rank: int) -> list[ExpertDelta]:
        """The experts' deltas, one per layer and PEFT module (stacked over the experts); a refusal of
        shapes another model's, or a module with A or B alone."""
        e = self.cfg.num_experts
        out: list[ExpertDelta] = []
        seen: set[tuple[int, str]] = set()
        for layer, module in sorted({(lay, mod) for lay, mod, _, _ in self.tensors}):
            stacked = module.startswith("depth ")
            where = f"layers.{layer}.mlp.experts" + ("" if stacked else f".N.{module}")
            if stacked:
                a, b = self.tensors.get((layer, module, -1, "A")), self.tensors.get((layer, module, -1, "B"))
            else:
                a, b = self._per_expert(layer, module, "A"), self._per_expert(layer, module, "B")
            if a is None or b is None:
                raise LoRAError(f"LoRA adapter {self.adapter!r}: {where} has not both lora_A and lora_B")
            if stacked:  # A [r E, in] (rows expert-major), B [out, r E] (columns rank-major)
                name, block = self._stacked_param(where, a, b), 0
                shape, row, r = self.shapes[name], 0, a.shape[0] // e
                a, b = a.view(e, r, -1), b.view(b.shape[0], r, e).permute(2, 0, 1)
                limit = 2 * max_rank if name == "gate_up_proj" else max_rank  # gate_up: both rank blocks
            else:  # one module per expert: A [E, r, in], B [E, rows, r]
                name, block, shard = EXPERT_SLICES[module]
                shape, r = self.shapes[name], a.shape[1]
                row, rows = shape.shards[shard]
                if a.shape[2] != shape.in_features or tuple(b.shape[1:]) != (rows, r):
                    raise LoRAError(
                        f"LoRA adapter {self.adapter!r}: {where} has A {tuple(a.shape[1:])} and B "
                        f"{tuple(b.shape[1:])} per expert; this model needs A (r, {shape.in_features}) and "
                        f"B ({rows}, r): an adapter of another base model?"
                    )
                limit = max_rank
            if (layer, f"{name} {block}") in seen:
                raise LoRAError(f"LoRA adapter {self.adapter!r}: layers.{layer} adapts experts.{name} twice")
            seen.add((layer, f"{name} {block}"))
            if r > limit:
                raise LoRAError(
                    f"LoRA adapter {self.adapter!r}: {where} has rank {r}, above max_lora_rank={max_rank}"
                )
            scale = scaling.of(f"model.layers.{layer}.mlp.experts.{name if stacked else module}", r)
            out.append(ExpertDelta(layer, name, block, row, a.contiguous(), (b * scale).contiguous()))
        return out

    def _per_expert(self, layer: int, module: str, ab: str) -> torch.Tensor | None:
        """One module's A or B over every expert, stacked ([E, ...]); zeros for experts it lacks."""
        got = {
            x: t
            for (lay, mod, x, k), t in self.tensors.items()
            if (lay, mod, k) == (layer, module, ab) and x >= 0
        }
        if not got:
            return None
        first = next(iter(got.values()))
        shapes = {tuple(t.shape) for t in got.values()}
        if len(shapes) > 1:
            raise LoRAError(
                f"LoRA adapter {self.adapter!r}: layers.{layer} {module} experts' lora_{ab} differ in shape"
            )
        return torch.stack([got.get(x, torch.zeros_like(first)) for x in range(self.cfg.num_experts)])
