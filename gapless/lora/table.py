"""The device's resident adapters: per adapted layer, A [slots, blocks * max_rank, in] and B [slots, out,
blocks * max_rank] stacked, one slot per adapter (`max_loras`), zero where an adapter has nothing; and the
per-token slot vector every layer reads (a static buffer: a CUDA graph replays whatever the runner copied
into it). Each adapted linear layer gets a `LoRALayer` as its `lora`, which adds the delta after the
layer's own output, so LoRA composes with any linear method.

A mixture's experts get an `ExpertLoRA` on their `Experts` module: A [slots, E, blocks * max_rank, in]
and B [slots, E, out, blocks * max_rank] per stacked parameter, read per (token, expert) entry through the
flat index slot * E + expert, by the same gathered kernels (CUDA) or segmented torch path (elsewhere).

Slots are filled in stream order, by the batch that first needs them (`ForwardBatch.lora_loads`); the
adapters' weights come from a CPU cache of `max_cpu_loras` read adapters, least recently used out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from gapless.config import EngineConfig
from gapless.lora.adapter import (
    BLOCKS,
    MLP_LAYERS,
    AdapterWeights,
    expert_shapes,
    layer_shapes,
    load_adapter,
)
from gapless.lora.ops import Block, Segments, add_lora_torch, segments
from gapless.lora.shard import expert_rank_shape, rank_adapter, rank_shape
from gapless.model.config import ModelConfig
from gapless.model.decoder import CausalLM

log = logging.getLogger(__name__)


class LoRALoad(NamedTuple):
    """Put adapter `lora_id` (read from `path`) into device slot `slot` before a batch's forward."""

    slot: int
    lora_id: int
    name: str
    path: str


class LoRALayer:
    """One layer's stacked adapters, and the delta it adds: `y + B[slot] A[slot] x` per token."""

    def __init__(
        self, table: LoRATable, a: torch.Tensor, b: torch.Tensor, blocks: list[Block] | None = None
    ) -> None:
        self.table = table
        self.a, self.b = a, b
        # torch path, fused layer (q/k/v, gate/up): each rank block's B apart, kept while every adapter
        # put in a slot writes only its block's rows; None from the first that writes more (a fused
        # checkpoint name: Phi-3's `qkv_proj`)
        self.blocks = blocks

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        table = self.table
        if table.kernel:
            from gapless.lora import triton_kernels

            return triton_kernels.add_lora(y, x, self.a, self.b, table.token_slots[: x.shape[0]])
        if table.segments is None:
            return y
        return add_lora_torch(y, x, self.a, self.b, table.segments, self.blocks)


class ExpertLoRA:
    """One mixture layer's stacked adapters of its experts: per stacked parameter (gate_up_proj,
    down_proj) A [S, E, R, in] and B [S, E, out, R]; each (token, expert) entry reads slot * E + expert."""

    def __init__(self, table: LoRATable, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.table, self.weights = table, weights
        self.num_experts = next(iter(weights.values()))[0].shape[1]

    def entry_slots(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The flat adapter index of each (token, expert) entry of `ids` [T, top_k] (-1: the base model's
        rows), in entry order; None on the CPU when no row runs an adapter. Device ops only."""
        table = self.table
        if not table.kernel and table.segments is None:
            return None
        slots = table.token_slots[: ids.shape[0], None]
        return torch.where(slots >= 0, slots * self.num_experts + ids, -1).reshape(-1)

    def add(self, param: str, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """y [n, out] += B[slot] A[slot] x per entry of stacked parameter `param`, in place; `slots` [n]
        from `entry_slots` (or a subset of its entries, in the same order as x and y's rows)."""
        a, b = self.weights[param]
        a, b = a.flatten(0, 1), b.flatten(0, 1)  # [S E, R, in], [S E, out, R]: views
        if self.table.kernel:
            from gapless.lora import triton_kernels

            return triton_kernels.add_lora(y, x, a, b, slots)
        seg = segments(slots)
        return y if seg is None else add_lora_torch(y, x, a, b, seg)


class LoRATable:
    """Every adapted layer's slots, the slot vector, and the adapters read so far (on the CPU)."""

    def __init__(
        self,
        model: CausalLM,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        hold_experts: bool = True,
    ) -> None:
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self.hold_experts = hold_experts  # slots for a mixture's experts (`lora_experts`)
        # CUDA: the gathered kernels read the slot vector on the device (a graph captures them; slot -1
        # rows skip); elsewhere torch runs the batch's tokens sorted by slot, once per batch
        self.kernel = device.type == "cuda"
        self.dtype, self.device = dtype, device
        self.segments: Segments | None = None
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.resident: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self.loads = 0  # adapters put into slots so far
        self.cpu: OrderedDict[tuple[int, str], AdapterWeights] = OrderedDict()  # (id, path) -> read, LRU last
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        # each adapted layer's module: this rank's piece of it, which an adapter is cut like (`shard`)
        self.linears: dict[tuple[int, str], object] = {}
        shapes = layer_shapes(cfg)
        # a mixture layer's experts: gate_up A of two rank blocks (an adapter of one module per expert
        # writes gate and up apart), down of one
        self.experts: dict[int, ExpertLoRA] = {}
        self.expert_modules: dict[int, object] = {}
        for i, layer in enumerate(model.model.layers):
            if not cfg.moe_layers[i] or not hold_experts:
                continue
            experts: Any = layer.mlp.experts  # type: ignore[union-attr]  # a mixture layer's mlp is a SparseMoE
            tables = {}
            for name, shape in expert_shapes(cfg).items():
                local = expert_rank_shape(shape, name, experts)
                rank = (2 if name == "gate_up_proj" else 1) * max_rank
                e = experts.num_experts
                a = torch.zeros(max_loras, e, rank, local.in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, e, local.out_features, rank, dtype=dtype, device=device)
                tables[name] = (a, b)
            experts.lora = self.experts[i] = ExpertLoRA(self, tables)
            self.expert_modules[i] = experts
        for i, layer in enumerate(model.model.layers):
            for name, shape in shapes.items():
                if name in MLP_LAYERS and cfg.moe_layers[i]:
                    continue
                parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
                linear = getattr(parent, name)
                local = rank_shape(shape, linear)
                rank = BLOCKS[name] * max_rank
                a = torch.zeros(max_loras, rank, local.in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, local.out_features, rank, dtype=dtype, device=device)
                lora = LoRALayer(self, a, b, self._blocks(linear, BLOCKS[name], max_loras, max_rank))
                linear.lora = lora
                self.layers[(i, name)] = lora
                self.linears[(i, name)] = linear

    def _blocks(self, linear: object, count: int, slots: int, max_rank: int) -> list[Block] | None:
        """The torch path's block-diagonal B of a fused layer of `count` rank blocks (None on CUDA, or for
        a layer of one block)."""
        offsets = getattr(linear, "shard_offsets", {})
        if self.kernel or count == 1 or len(offsets) != count:
            return None
        return [
            Block(row, n, torch.zeros(slots, n, max_rank, dtype=self.dtype, device=self.device))
            for row, n in offsets.values()
        ]

    @property
    def nbytes(self) -> int:
        blocks = [blk.b for lo in self.layers.values() for blk in lo.blocks or ()]
        tensors = [*(t for lo in self.layers.values() for t in (lo.a, lo.b)), *blocks]
        return sum(t.nbytes for t in tensors) + self.expert_nbytes

    @property
    def expert_nbytes(self) -> int:
        """The bytes of the experts' slots (0 without a mixture, or with `lora_experts` off)."""
        return sum(t.nbytes for ex in self.experts.values() for ab in ex.weights.values() for t in ab)

    def read(self, load: LoRALoad) -> AdapterWeights:
        """The adapter's weights, cut for this rank, from the CPU cache, or read (and checked against the
        whole model) from its path."""
        key = (load.lora_id, load.path)
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return self.cpu[key]
        whole = load_adapter(load.name, load.path, self.cfg, self.max_rank, self.hold_experts)
        weights = rank_adapter(whole, self.linears, self.expert_modules)
        self.cpu[key] = weights
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return weights

    def load(self, load: LoRALoad) -> None:
        """Put an adapter into its slot (zeroing what the slot held)."""
        weights = self.read(load)
        s, r = load.slot, self.max_rank
        for lora in self.layers.values():
            lora.a[s].zero_()
            lora.b[s].zero_()
            for blk in lora.blocks or ():
                blk.b[s].zero_()
        for ex in self.experts.values():
            for a, b in ex.weights.values():
                a[s].zero_()
                b[s].zero_()
        for x in weights.experts:
            a, b = self.experts[x.layer].weights[x.name]
            cols = slice(x.block * r, x.block * r + x.a.shape[1])
            a[s, :, cols].copy_(x.a)
            b[s, :, x.row : x.row + x.b.shape[1], cols].copy_(x.b)
        for d in weights.deltas:
            lora = self.layers[(d.layer, d.name)]
            cols = slice(d.block * r, d.block * r + d.a.shape[0])
            lora.a[s, cols].copy_(d.a)
            lora.b[s, d.row : d.row + d.b.shape[0], cols].copy_(d.b)
            if lora.blocks is not None:
                blk = lora.blocks[d.block]
                if (blk.row, blk.rows) == (d.row, d.b.shape[0]):
                    blk.b[s, :, : d.a.shape[0]].copy_(d.b)
                else:  # B is no longer block-diagonal: expanded whole from now on
                    lora.blocks = None
        self.resident[s] = load.lora_id
        self.loads += 1

    def prepare(self, loads: list[LoRALoad], token_slots: torch.Tensor | None) -> None:
        """Before a forward: fill the slots it loads, and set the per-token slot vector (None: every row
        runs the base model)."""
        for load in loads:
            self.load(load)
        n = 0 if token_slots is None else token_slots.shape[0]
        if self.kernel:  # the tail beyond this batch (a graph's padding) must read -1
            self.token_slots[n:].fill_(-1)
        if token_slots is not None:
            self.token_slots[:n].copy_(token_slots)
        if not self.kernel:
            self.segments = segments(token_slots) if token_slots is not None else None


def make_lora_table(
    cfg: EngineConfig, model: CausalLM, dtype: torch.dtype, device: torch.device
) -> LoRATable | None:
    """The device's LoRA slots when `cfg.enable_lora`, sized for the largest batch (a prefill chunk, a
    decode, a verify, a prefill graph's piece)."""
    if not cfg.enable_lora:
        return None
    assert cfg.chunked_prefill_size is not None, "the runner sets the prefill budget first"
    tokens = max(cfg.chunked_prefill_size, cfg.max_running_requests + 1, cfg.piecewise_cuda_graph_max_tokens)
    if cfg.speculative_algorithm is not None:  # a verify: every request's token and drafts (a graph's too)
        tokens = max(tokens, (cfg.max_running_requests + 1) * (cfg.speculative_num_draft_tokens + 1))
    cpu_loras = cfg.max_cpu_loras or cfg.max_loras
    # the whole model's config (not a tensor-parallel rank's view of it): adapters are read and checked
    # whole, then cut for the rank
    table = LoRATable(
        model, model.cfg, cfg.max_loras, cfg.max_lora_rank, cpu_loras, tokens, dtype, device, cfg.lora_experts
    )
    experts = table.expert_nbytes
    log.info(
        "LoRA: %d slots of rank <= %d, %.3g GiB%s",
        cfg.max_loras,
        cfg.max_lora_rank,
        table.nbytes / 2**30,
        f" ({experts / 2**30:.3g} GiB of them the experts'; --no-lora-experts holds none)" if experts else "",
    )
    return table
