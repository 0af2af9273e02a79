"""A GGUF file's quantized projections on the int4/int8 weight-only path (`gapless.model.quant.int4`): on a
GPU, and across tensor-parallel ranks, where `gguf_cpu`'s layers (one rank's CPU kernels) do not run.

Each projection is read from its blocks (`gguf_blocks`) into the path's one form, `W = (q - zero) * scale`
(`int4_layouts.Unpacked`), then held, cut for each rank and run like an AWQ/GPTQ checkpoint's (on a GPU:
tinygemm at decode rows and the Triton GEMM above, `int4_kernels`):

- **Q4_0, Q4_1, Q4_K**: 4 bits in groups of 32, the file's values. Their blocks say `w = q * scale +
  offset`; the path's zero is `-offset / scale`, a float (held in float16 under bfloat16 activations,
  `int4.Int4LinearMethod`). A group whose scale is 0, every weight its offset, is held as q = 1, zero 0 and
  scale `offset`: exact (`gguf_blocks.zero_form`).
- **Q8_0, Q5_0, Q5_1, Q5_K** (8 bits in groups of 32), **Q6_K** (8 bits in groups of 16), **Q3_K, Q2_K** (4
  bits in groups of 16): the file's values and scales too (`gguf_blocks.affine_parts`), where llama.cpp and
  vLLM read them exactly and `gguf_cpu`'s int8 rows round them (Q8_0 +2.2% perplexity there). On the CPU's
  kernels (tensor parallelism), groups of 16, which none takes, are int8 rows instead: each row
  requantized with one scale (`gguf_blocks.int8_rows`, as `gguf_cpu`'s), 8 bits one group a row.
- **IQ4_NL, IQ4_XS, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S** (the i-quants the affine form takes in 8 bits:
  `gguf_iq`): 4 bits in the type's groups (16 or 32), each weight's index into its type's levels (IQ4's
  16, IQ3_XXS's 16 lattice values, IQ2's 6), which the Triton GEMM takes as its codebook (`W = levels[q] *
  scale`, the file's weights; a mixture's experts likewise, in the grouped GEMM). Not on the CPU's
  kernels, nor a projection fused with a type of another codebook: there the affine form. IQ3_S and IQ1_*
  are 4 bits in the affine form already.

A fused projection (q/k/v, gate/up) whose parts differ (Q4_K_M files write some layers' `attn_v` as Q6_K) is
held in the widest of their bits and the narrowest of their groups (Q4_K with Q6_K: 8 bits in groups of 16,
every value still the file's), or as int8 rows if one part is (on the CPU). Unlike `gguf_cpu`'s default
layout, every 4-bit projection stays 4-bit: on a GPU the fewest bytes are the fastest decode. The embedding
table is held as the file's blocks, each lookup decoding its rows (`DeviceRows`); the LM head, untied or
tied, runs on this path. Each module is installed as soon as its last shard is read (`GGUFLayers`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from gapless.model import weight_names
from gapless.model.layers import ParallelLMHead, VocabParallelEmbedding
from gapless.model.moe import Experts
from gapless.model.quant import gguf_iq, int4, int4_experts, int4_kernels
from gapless.model.quant.gguf_blocks import (
    FORMS,
    INT4_TYPES,
    GGUFBlocks,
    affine_parts,
    codebook_parts,
    decoded_rows,
    int8_rows,
    label,
)
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked


def _form(qtype: str, cpu: bool) -> tuple[int, int]:
    """(bits, group; -1: int8 rows, one group a row) a matrix of `qtype` is held in (the module's
    docstring); `cpu`: for the CPU's kernels, which take groups of 32 and more."""
    bits, group = FORMS[qtype]
    return (8, -1) if cpu and group < 32 else (bits, group)


def spec_for(parts: list[GGUFBlocks], cpu: bool = False, codebook: bool = True) -> Int4Spec:
    """The int4/int8 scheme a projection stacked from `parts` is held in: 4-bit indices into one codebook
    where every part's type has that one (`gguf_iq.CODEBOOKS`; asked for by `codebook`, and not for the
    CPU's kernels, which take none), in the narrowest of their groups; else the widest of their forms'
    bits in the narrowest of their groups, or int8 rows if any part is (`_form`)."""
    forms = [_form(p.qtype, cpu) for p in parts]
    books = {gguf_iq.CODEBOOKS.get(p.qtype) for p in parts}
    if codebook and not cpu and len(books) == 1 and None not in books:
        group = min(g for _, g in forms)
        return Int4Spec("gguf", 4, group, sym=True, source=label(parts), codebook=books.pop() or "")
    if any(group < 0 for _, group in forms):
        return Int4Spec("gguf", 8, -1, sym=True, source=label(parts))
    bits, group = max(b for b, _ in forms), min(g for _, g in forms)
    return Int4Spec("gguf", bits, group, sym=False, source=label(parts))


def unpacked(b: GGUFBlocks, spec: Int4Spec, device: torch.device | str = "cpu") -> Unpacked:
    """One matrix's weight in the path's form for a projection held as `spec` (`spec_for`), on `device`:
    its own values, scales and zeros (read there from the blocks), each (scale, zero) repeated over
    `spec`'s narrower groups; an i-quant's indices, scales (likewise) and levels (a codebook's spec); or
    int8 rows (read on the host: the CPU's form)."""
    if spec.codebook:
        q, scale = codebook_parts(b, device)
        scale = scale.repeat_interleave(b.cols // scale.shape[1] // spec.group_size, 1)
        return Unpacked(q, scale, torch.zeros_like(scale), levels=gguf_iq.levels(spec.codebook, device))
    if spec.group_size < 0:
        q, scale = int8_rows(b)
        rows = torch.full((b.rows, 1), 128.0)
        return Unpacked(q.to(torch.int16) + 128, scale.float()[:, None], rows).map(lambda t: t.to(device))
    q, scale, zero = affine_parts(b, device)
    per = b.cols // scale.shape[1] // spec.group_size  # (each of its groups, in the projection's)
    return Unpacked(q, scale.repeat_interleave(per, 1), zero.repeat_interleave(per, 1))


class DeviceRows:
    """Rows of an embedding table (this rank's) held as the file's blocks on the table's device, each lookup
    decoding the rows it gathers (`decoded_rows`: the file's weights, as a float load's table holds them)."""

    def __init__(self, b: GGUFBlocks, first: int, count: int, device: torch.device) -> None:
        self.qtype, self.cols = b.qtype, b.cols
        self.data = torch.from_numpy(np.require(b.data[first : first + count], requirements=["C", "W"]))
        self.data = self.data.to(device)
        if count:  # (an i-quant's tables placed now, not in a captured graph)
            decoded_rows(self.qtype, self.data[:1])

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (this rank's numbering) in `dtype`."""
        rows = decoded_rows(self.qtype, self.data[ids.reshape(-1)])
        return rows.view(*ids.shape, self.cols).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]


def install_experts(experts: Any, shards: dict[Any, GGUFBlocks], dtype: torch.dtype, where: str) -> None:
    """A mixture's `Experts` from every expert's blocks (shard (expert, "gate" | "up" | "down")), on the
    experts' device: gate/up in the widest bits and narrowest groups of all their experts' (`spec_for`),
    down in its own (a Q4_K_M file's down is Q6_K in some layers, its gate/up Q4_K), each expert's values
    the file's; on the CPU's kernels a form they take (`spec_for`'s `cpu`)."""
    device = experts.gate_up_proj.device
    cpu = _cpu_kernels(device)
    specs = {
        param: spec_for([shards[s] for s in experts.checkpoint_shards(param) if s in shards], cpu)
        for param in ("gate_up_proj", "down_proj")
    }
    whole = {
        (e, proj): unpacked(b, specs["down_proj" if proj == "down" else "gate_up_proj"], device)
        for (e, proj), b in shards.items()
    }
    int4_experts.install_experts(
        experts, whole, specs["gate_up_proj"], dtype, where, down_spec=specs["down_proj"]
    )


class GGUFModules(ABC):
    """A GGUF load's quantized modules, each installed (`_install`, a subclass's) as soon as every shard of
    it has been read, so the host holds the blocks of the modules still arriving, not the file's. `add`
    each matrix as it is read (its Hugging Face name, blocks), `finish` after the last; a module's shards
    are keyed by `weight_names.target`'s shard id (None: a projection the file stores fused, Phi-3's)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.pending: dict[str, dict[Any, GGUFBlocks]] = {}  # module -> shard -> its blocks
        self.missing: dict[str, set[str]] = {}  # module -> the names (`weight_names`) it still lacks
        self.installed = 0

    def add(self, name: str, blocks: GGUFBlocks) -> list[str]:
        """Take one matrix; the names (`weight_names`) it fills."""
        param, shard = weight_names.target(name)
        module = param.rsplit(".", 1)[0]
        self.pending.setdefault(module, {})[shard] = blocks
        if module not in self.missing:
            self.missing[module] = weight_names.weights_of(self.model, module)
        filled = weight_names.filled_by(self.model, name)
        self.missing[module] -= set(filled)
        if not self.missing[module]:
            del self.missing[module]
            self.installed += 1
            self._install(module, self.pending.pop(module))
        return filled

    def finish(self) -> bool:
        """Install what is still pending, which the install refuses by name (a shard missing); whether any
        module came quantized."""
        for name in list(self.pending):
            self.installed += 1
            self._install(name, self.pending.pop(name))
        return self.installed > 0

    @abstractmethod
    def _install(self, name: str, shards: dict[Any, GGUFBlocks]) -> None:
        """Give module `name` its quantized form from its shards' blocks."""


class GGUFLayers(GGUFModules):
    """The projections of one GGUF load on this path (`GGUFModules`), each installed by `int4.install`
    (cut for this rank, held in `dtype`, its float weight never made; a mixture's experts
    `install_experts`, the table and head `_install_table`); `types` (each matrix's type by name, from
    the file's header) weighs `auto`'s second copies before the first install."""

    def __init__(self, model: Any, types: dict[str, str], dtype: torch.dtype) -> None:
        super().__init__(model)
        self.dtype = dtype
        by_module: dict[str, list[str]] = {}
        for name, qtype in types.items():
            module = weight_names.target(name)[0].rsplit(".", 1)[0]
            by_module.setdefault(module, []).append(qtype)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        gemms = [  # (the layers whose second copy, tinygemm's, `auto` weighs: not experts, not a table)
            m
            for m in by_module
            if (m.startswith("model.layers.") and not isinstance(model.get_submodule(m), Experts))
            or m == ("model.embed_tokens" if tied else "lm_head")
        ]
        numel = sum(
            model.get_submodule(m).weight.numel() for m in gemms if all(k in INT4_TYPES for k in by_module[m])
        )
        self.kernel = int4_kernels.for_model(numel, 4, dtype, model.lm_head.weight.device)

    def _install(self, name: str, shards: dict[Any, GGUFBlocks]) -> None:
        """`name`'s projection read from its blocks, cut and packed on its device (as an AWQ checkpoint's
        layers are: a GPU decodes and packs an 8B's blocks in a fraction of the host's time)."""
        layer = self.model.get_submodule(name)
        if isinstance(layer, Experts):
            install_experts(layer, shards, self.dtype, name)
            return
        if isinstance(layer, VocabParallelEmbedding):
            self._install_table(name, layer, shards)
            return
        device = layer.weight.device
        spec = spec_for(list(shards.values()), _cpu_kernels(device))
        whole = {shard: unpacked(b, spec, device) for shard, b in shards.items()}
        offsets = getattr(layer, "checkpoint_offsets", None)
        if None in whole and offsets:  # (stored fused: each shard its rows)
            whole = int4.split_rows(whole[None], offsets)
        int4.install(layer, whole, spec, self.dtype, name, self.kernel)

    def _install_table(self, name: str, table: VocabParallelEmbedding, shards: dict[Any, GGUFBlocks]) -> None:
        """The embedding table as its blocks on its device, this rank's rows (`DeviceRows`); the LM head,
        untied or tied (a second form of the same blocks), on the int4/int8 path, its rows this rank's
        and padded with zero weights to the head's."""
        if list(shards) != [None]:
            raise ValueError(f"{name}: a table of {len(shards)} GGUF matrices")
        b, device = shards[None], table.weight.device
        count = max(0, min(table.rows, b.rows - table.first))
        head = self.model.lm_head
        if not isinstance(table, ParallelLMHead):
            table.quantized_rows = DeviceRows(b, table.first, count, device)
        if table is head or head.weight is table.weight:
            spec = spec_for([b], _cpu_kernels(device))
            mine = GGUFBlocks(b.qtype, b.cols, b.data[table.first : table.first + count])
            int4.install_head(head, unpacked(mine, spec, device), spec, self.dtype, self.kernel, first=0)
        table.weight.data = table.weight.data.new_empty(0)


def _cpu_kernels(device: torch.device) -> bool:
    """Whether int4/int8 layers on `device` run torch's CPU kernels (`auto` on a CPU; else the GPU's, or
    the reference path)."""
    return device.type == "cpu" and int4_kernels.chosen() == "auto"
