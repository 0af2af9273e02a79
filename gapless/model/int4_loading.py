"""An int4/int8 checkpoint's quantized tensors (AWQ, GPTQ, compressed-tensors), gathered by checkpoint
module as they are read and installed a layer at a time (`gapless.model.quant.int4`) as soon as every
tensor of every module the layer is made of has arrived: the host holds the packed tensors of the layers
still arriving (one, for a checkpoint stored layer by layer), not the whole checkpoint's, which each
tensor-parallel rank read whole before. What has not arrived whole by the end is installed then, where a
missing tensor or shard is refused by name.

Under act-order an MLP's gate/up waits for its down projection: down's order over the intermediate width
is taken onto gate's and up's rows where `int4.takes_down_order` says so, down then installed without one
(no gather of its input, and no padding on a tensor-parallel rank)."""

from __future__ import annotations

from typing import Any

import torch

from gapless.model import moe, weight_names
from gapless.model.decoder import CausalLM
from gapless.model.layers import ParallelLMHead
from gapless.model.quant import int4, int4_experts
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked, act_order, unpack, whole_tensors

_ORDERS = ("g_idx", "weight_g_idx")  # act-order's tensors, which `unpack` reads where they are


class Int4Layers:
    """The quantized layers of one load (see the module's docstring); `add` each tensor as it is read,
    `finish` after the last. `filled`: the names (`weight_names`) their installs filled."""

    def __init__(self, model: CausalLM, spec: Int4Spec, dtype: torch.dtype, kernel: str) -> None:
        self.model, self.spec, self.dtype, self.kernel = model, spec, dtype, kernel
        self.modules = dict(model.named_modules())
        self.whole = whole_tensors(spec)
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint module -> its tensors, as stored
        self.layers: dict[str, list[str]] = {}  # layer -> the checkpoint modules it is made of
        self.missing: dict[str, set[str]] = {}  # layer -> the names its whole modules do not fill yet
        self.whole_modules: set[str] = set()  # checkpoint modules with every tensor they are whole with
        self.installed: set[str] = set()  # checkpoint modules whose layer is installed
        self.filled: list[str] = []
        # act-order MLPs' layers whole and waiting for the other of their pair (`_install`)
        self.waiting: set[str] = set()
        self.finishing = False

    def add(self, module: str, tensor: str, value: torch.Tensor) -> None:
        """Checkpoint module `module`'s tensor `tensor` (`qweight`, `scales`, ...); its layer installed
        if that made it whole."""
        if module in self.installed:
            self._late(module, tensor, value)
            return
        self.parts.setdefault(module, {})[tensor] = value
        layer = weight_names.target(f"{module}.weight")[0].rsplit(".", 1)[0]
        if layer not in self.modules:
            raise ValueError(
                f"checkpoint module {module!r} has no place in the {self.model.cfg.architecture} model"
            )
        if layer not in self.layers:
            self.layers[layer] = []
            self.missing[layer] = weight_names.weights_of(self.model, layer)
        sources = self.layers[layer]
        if module not in sources:
            sources.append(module)
        if module not in self.whole_modules and set(self.whole) <= set(self.parts[module]):
            self.whole_modules.add(module)
            self.missing[layer] -= set(weight_names.filled_by(self.model, f"{module}.weight"))
            if not self.missing[layer] and all(m in self.whole_modules for m in sources):
                self._install(layer)

    def finish(self) -> list[str]:
        """Install every layer not yet whole (unpacking or installing refuses what it lacks); the names
        all the installs filled. A checkpoint with no layer in its declared format (a float checkpoint
        beside a quantization config) is refused: its layers would run as floats under the format's name."""
        self.finishing = True
        for layer in list(self.layers):
            if layer in self.layers:  # (an MLP's pair: installed together)
                self._install(layer)
        if not self.installed:
            raise QuantFormatError(
                f"the checkpoint declares {self.spec.label}, but no layer is stored so "
                f"({', '.join(self.spec.tensors)}): a float checkpoint beside a quantization config?"
            )
        return self.filled

    def _install(self, layer_name: str) -> None:
        """`layer_name` installed (`_install_one`); under act-order an MLP's gate/up and down together,
        once both are whole (or at the end, where the other never came quantized): down first, its order
        taken onto gate/up's rows where `int4.takes_down_order` says so."""
        pair = self._mlp_pair(layer_name)
        if pair is None:
            self._install_one(layer_name)
            return
        gate_up, down = pair
        other = down if layer_name == gate_up else gate_up
        if not self.finishing and other not in self.waiting:
            self.waiting.add(layer_name)  # (whole, waiting for the other)
            return
        self.waiting -= {gate_up, down}
        both = other in self.layers
        order = self._install_one(down, gate_up if both else None) if down in self.layers else None
        if gate_up in self.layers:
            self._install_one(gate_up, rows=order)

    def _mlp_pair(self, layer_name: str) -> tuple[str, str] | None:
        """Under act-order, (gate/up, down) of the MLP `layer_name` is one of; else None."""
        if not self.spec.act_order:
            return None
        for mine, other in ((".gate_up_proj", ".down_proj"), (".down_proj", ".gate_up_proj")):
            if layer_name.endswith(mine):
                partner = layer_name.removesuffix(mine) + other
                if partner in self.modules:
                    return (layer_name, partner) if mine == ".gate_up_proj" else (partner, layer_name)
        return None

    def _install_one(
        self, layer_name: str, gate_up: str | None = None, rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`layer_name`'s modules unpacked on its device, cut and packed (`int4.install`, a mixture's
        experts `int4_experts.install_experts`), their tensors dropped. `gate_up` (an act-order MLP's
        down's, installed with it): down installed without its order where that gate/up can take it
        (`int4.takes_down_order`), which is returned; `rows` (that gate/up's): its rows taken in that
        order. Each such layer's `inter_order` set to it."""
        layer = self.modules[layer_name]
        experts = isinstance(layer, moe.Experts)
        device = layer.gate_up_proj.device if experts else layer.weight.device
        offsets = getattr(layer, "checkpoint_offsets", None)
        shards: dict[Any, Unpacked] = {}
        del self.missing[layer_name]
        for module in self.layers.pop(layer_name):
            shard = weight_names.target(f"{module}.weight")[1]
            parts = {k: t.to(device) for k, t in self.parts.pop(module).items()}
            w = unpack(self.spec, parts, module)
            pieces = int4.split_rows(w, offsets) if shard is None and offsets else {shard: w}
            shards.update(pieces)
            self.filled += weight_names.filled_by(self.model, f"{module}.weight")
            self.installed.add(module)
        taken = None
        if gate_up is not None and shards.get(None) is not None and shards[None].order is not None:
            w = shards[None]
            if int4.takes_down_order(self.modules[gate_up], layer, w.scale.shape[1]):
                taken, shards = w.order, {None: w._replace(order=None)}
        if rows is not None:
            shards = {s: w.rows_in(rows) for s, w in shards.items()}
        inter_order = rows if rows is not None else taken
        if inter_order is not None:  # (on the CPU, where LoRA's adapters are read)
            layer.inter_order = inter_order.cpu()
        if experts:  # a mixture's experts: every expert's projections stacked
            int4_experts.install_experts(layer, shards, self.spec, self.dtype, layer_name)
        elif isinstance(layer, ParallelLMHead):  # a quantized LM head (GPTQ's `lm_head: true`, ...)
            int4.install_head(layer, shards[None], self.spec, self.dtype, self.kernel)
        else:
            int4.install(layer, shards, self.spec, self.dtype, layer_name, self.kernel)
        return taken

    def _late(self, module: str, tensor: str, value: torch.Tensor) -> None:
        """A tensor of a module whose layer is installed: one `unpack` does not read for this scheme is
        left; a non-trivial act-order (the config naming none) is refused, as the layer was installed
        without it."""
        if tensor in _ORDERS:
            k = value.numel()
            if act_order(value, k, self.spec.group_for(k), module) is not None:
                raise QuantFormatError(
                    f"{module}.{tensor}: an act-order stored after the layer's other tensors, where the "
                    "config names none; it is not read"
                )
