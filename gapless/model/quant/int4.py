"""Weight-only int4/int8 checkpoints (w4a16, w8a16, group-wise scales and zeros) kept quantized: each layer's
weight, read into one form by `gapless.model.quant.int4_layouts` (AWQ, GPTQ, AutoRound's,
compressed-tensors `pack-quantized` and `int-quantized`, NVFP4, MXFP4), cut for tensor parallelism and
stacked for fused projections here, then packed into the one layout the GEMM reads
(`gapless.model.quant.int4_triton`'s docstring).

On CUDA the layer runs the Triton GEMM (or a library's: `int4_kernels`); on the CPU torch's CPU int4/int8
kernels where they take it (`int4_kernels.cpu_runs`). Elsewhere `apply` is a reference path: it
dequantizes the whole weight to the activations' dtype on every call and multiplies with torch, so the
quantized checkpoint is exact against a float model holding the same dequantized weights (tests), at a
float GEMM's cost plus the dequantization: for parity, not speed. A codebook's weight (`Unpacked.levels`:
bitsandbytes' NF4, GGUF's IQ4/IQ3_XXS/IQ2, NVFP4, MXFP4), which no CPU kernel takes, is dequantized once
there instead and held beside its codes (the float model's bytes and more). The LM head, where a
checkpoint quantizes it, is held so too (`install_head`).

A mixture's experts are unpacked the same way and stacked into the layer's `Experts` by
`gapless.model.quant.int4_experts`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from gapless.model.quant import int4_kernels
from gapless.model.quant.base import in_order
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4_layouts import (
    FP4_CODEBOOKS,
    FP4_E2M1,
    Int4Spec,
    Unpacked,
    pack_int32,
    unpack_int32,
)

# the tests set this under Triton's interpreter: the layers then run the Triton GEMM on CPU tensors too
TRITON_ON_CPU = False


class Int4LinearMethod:
    """`x W^T + b` with W held packed (`int4_triton`'s layout): the Triton GEMM on CUDA, the dequantizing
    reference path elsewhere (the module's docstring); on CUDA where the model's kernel choice gives the
    layer a library's GEMM (`int4_kernels.for_layer`; `kernel`: that choice, default the variable's), the
    weight in that library's layout too, or instead: `auto` runs tinygemm's copy up to
    `int4_kernels.TINYGEMM_ROWS` rows and the Triton GEMM above. `tensors()`: what is held."""

    def __init__(
        self, w: Unpacked, spec: Int4Spec, dtype: torch.dtype, device: torch.device, kernel: str | None = None
    ) -> None:
        if spec.bits == 4:  # (fewer bits' values about the middle, where the kernels' offsets are small)
            w = w.centered(4)
        n, k = w.q.shape
        self.name, self.quant_method = spec.label, spec.method
        self.bits, self.group = spec.bits, k // w.scale.shape[1]
        self.out_features, self.in_features, self.dtype = n, k, dtype
        # act-order: x's columns in the weight's order first (`in_order`: written so by the kernel before
        # the layer where it can, else one small gather a call)
        self.order = None if w.order is None else w.order.to(device)
        # the order a kernel before the layer may write x's columns in beside x: a permutation of them; not
        # a rank's regrouped act-order layer's, padded (`regroup_for_rank`): that layer appends a zero to
        # x, which its padding reads, and gathers
        permutes = w.order is None or torch.equal(w.order.sort().values, torch.arange(len(w.order)))
        self.written_order = self.order if permutes else None
        self.pads_x = not permutes
        if k % (32 // spec.bits):
            raise QuantFormatError(f"{spec.label}: in_features {k} is not a multiple of {32 // spec.bits}")
        # a codebook's weight (`Unpacked.levels`): the Triton GEMM alone takes it, on any device
        self.levels = None if w.levels is None else w.levels.float().to(device)
        self.float_weight: torch.Tensor | None = None  # (`apply`'s where no kernel takes a codebook)
        choice = "triton" if self.levels is not None else kernel or int4_kernels.chosen()
        library, _, also = int4_kernels.for_layer(
            choice, spec.bits, self.group, dtype, n, k, device
        ).partition("+")
        self.library, self.library_rows = None, int4_kernels.TINYGEMM_ROWS if also else None
        self.triton_held = library == "triton" or also == "triton"  # (the Triton GEMM's layout held)
        if library != "triton":
            self.library = int4_kernels.library_kernel(library, w, spec.bits, dtype, device, spec.label)
            rows = f" to {self.library_rows} rows, triton above" if also else ""
            self.name = f"{spec.label} ({library}{rows})"
        # a checkpoint's zeros are integers; a GGUF file's are not (`gguf_int4`), which the PTX values
        # cannot hold (`int4_triton.ptx_values`); held as `zeros_dtype` says
        self.integer_zeros = bool(torch.equal(w.zero, w.zero.round()))
        if not self.triton_held:
            return
        self.qweight = pack_int32(w.q.t(), spec.bits, dim=0).to(device)
        self.scales = w.scale.t().to(dtype).contiguous().to(device)
        zero = w.zero if self.levels is None else w.zero[:0]  # (a codebook's zeros are 0: not held)
        self.zeros = zero.t().to(zeros_dtype([w.zero], dtype)).contiguous().to(device)
        # a codebook's weight where no kernel of the device takes one (the CPU's int kernels take evenly
        # spaced levels alone): dequantized once, beside its codes, not on every call
        if self.levels is not None and device.type != "cuda" and not TRITON_ON_CPU:
            self.float_weight = self.dequantized(dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (the reference path's weight), its columns in `order` as held."""
        q = unpack_int32(self.qweight, self.bits, dim=0)  # [K, N]
        scale = self.scales.repeat_interleave(self.group, dim=0).float()
        if self.levels is not None:
            return (self.levels[q.long()] * scale).t().to(dtype)
        zero = self.zeros.repeat_interleave(self.group, dim=0).float()
        return ((q.float() - zero) * scale).t().to(dtype)  # as the GEMM: fp32, one rounding

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self.order is not None:
            x = in_order(torch.nn.functional.pad(x, (0, 1)) if self.pads_x else x, self.order)
        if self.library is not None and (self.library_rows is None or x.shape[0] <= self.library_rows):
            y = self.library(x.to(self.dtype)).to(x.dtype)
        elif x.is_cuda or TRITON_ON_CPU:
            from gapless.model.quant.int4_triton import w4a16_matmul

            y = w4a16_matmul(
                x.to(self.scales.dtype),
                self.qweight,
                self.scales,
                self.zeros,
                self.group,
                self.bits,
                integer_zeros=self.integer_zeros,
                levels=self.levels,
            )
            y = y.to(x.dtype)
        else:
            w = self.float_weight if self.float_weight is not None else self.dequantized(x.dtype)
            y = torch.mm(x, w.to(x.dtype).t())
        bias = getattr(layer, "bias", None)
        return y if bias is None else y + bias

    def tensors(self) -> list[torch.Tensor]:
        held = self.library.tensors() if self.library is not None else []
        held += [self.qweight, self.scales, self.zeros] if self.triton_held else []
        return held + [t for t in (self.order, self.levels, self.float_weight) if t is not None]


def zeros_dtype(zeros: list[torch.Tensor], dtype: torch.dtype) -> torch.dtype:
    """The dtype zeros are held in under a model of `dtype`: its own, but where bfloat16 would hold a
    fractional zero (a GGUF file's, `gguf_int4`) up to 1/32 of a step off, float16 (on the default model's
    Q4_1 layers 0.18% RMS weight error, bfloat16's 0.41%), or float32 past float16's range."""
    if dtype != torch.bfloat16 or all(torch.equal(z, z.round()) for z in zeros):
        return dtype
    return torch.float16 if max(float(z.abs().max()) for z in zeros) < 2**15 else torch.float32


def split_rows(w: Unpacked, offsets: dict[Any, tuple[int, int]]) -> dict[Any, Unpacked]:
    """A fused projection's weight (Phi-3's qkv_proj) cut along its rows into its shards."""
    return {s: w.map(partial(torch.narrow, dim=0, start=off, length=n)) for s, (off, n) in offsets.items()}


def split_columns(w: Unpacked, tp: Any, what: str) -> Unpacked:
    """This rank's columns of a weight whose inputs split over `tp`'s ranks and the groups they fall in:
    each rank's input slice must be whole groups, or the row one group (per channel: every rank's columns
    keep the row's scale and zero); else a one-line error beginning with `what`."""
    k, groups = w.q.shape[1], w.scale.shape[1]
    if groups == 1:
        return w._replace(q=tp.part(w.q, tp.size, dim=1))
    if groups % tp.size:
        raise QuantFormatError(
            f"{what} {groups} groups of {k // groups} inputs do not split over {tp.size} ranks"
        )
    return w.map(lambda t: tp.part(t, tp.size, dim=1))


def shard_for_rank(w: Unpacked, layer: Any, shard: Any, where: str) -> Unpacked:
    """This rank's piece of one (shard of a) projection, cut as the layer cuts its float weight: a
    column-parallel layer keeps its rows (scales and zeros with them), a row-parallel one its columns
    and the groups they fall in (so each rank's input slice must be whole groups, or the row one group:
    per channel, every rank's columns keep the row's scale and zero; act-order's groups are spread over
    every rank's inputs: `regroup_for_rank`)."""
    from gapless.model import layers

    tp = getattr(layer, "tp", None)
    if tp is None or tp.size == 1 or isinstance(layer, layers.ReplicatedLinear):
        return w
    if isinstance(layer, layers.RowParallelLinear):
        if w.order is not None:
            return regroup_for_rank(w, tp, where)
        return split_columns(w, tp, f"{where}:")
    parts = layer.shard_parts[shard] if isinstance(layer, layers.MergedColumnParallelLinear) else tp.size
    return w.map(lambda t: tp.part(t, parts))


def takes_down_order(gate_up: Any, down: Any, groups: int) -> bool:
    """Whether an MLP's act-order down projection (its inputs in `groups` groups) has its order taken
    onto gate/up's rows at load instead (`gapless.model.int4_loading`), down then a plain grouped weight:
    the intermediate width is gate/up's output alone, so any order of it serves where gate/up write it so
    (SiLU·mul works column by column). Not where gate/up add a bias (loaded apart, in the stored order),
    nor where this rank's cut would split down's groups (then down is regrouped: `regroup_for_rank`)."""
    from gapless.model import layers

    pair = isinstance(gate_up, layers.MergedColumnParallelLinear) and isinstance(
        down, layers.RowParallelLinear
    )
    return pair and gate_up.bias is None and groups % down.tp.size == 0


def regroup_for_rank(w: Unpacked, tp: Any, where: str) -> Unpacked:
    """An act-order weight's columns for this rank of a row-parallel layer (inputs [r K / n, (r + 1) K / n)
    of its n ranks): act-order groups its inputs by `g_idx`, so each group's inputs lie on every rank, a
    varying number on each. The rank keeps every group's scale and zero and its own inputs of each group,
    in group order, each group's run padded to the same width: the largest run's rounded up to a power of
    two, at least 32 (the smallest group the library kernels take). A padding column reads input K / n,
    which is no input: the zero the layer appends to x (`Int4LinearMethod.pads_x`), so it adds exactly 0
    whatever its code (0) and the group's zero and scale. The kernels then read whole groups of that
    width, as any act-order layer's: for groups of 128 up to 8 ranks, about twice the rank's bytes."""
    k, groups = w.q.shape[1], w.scale.shape[1]
    assert w.order is not None
    if k % tp.size:
        raise QuantFormatError(f"{where}: {k} act-order inputs do not split over {tp.size} ranks")
    first, inputs = tp.rank * (k // tp.size), k // tp.size
    mine = ((w.order >= first) & (w.order < first + inputs)).nonzero().flatten()  # (in group order)
    group_of = mine // (k // groups)
    counts = torch.bincount(group_of, minlength=groups)
    width = max(32, 1 << (int(counts.max()) - 1).bit_length())
    slot = group_of * width + torch.arange(len(mine)) - (counts.cumsum(0) - counts)[group_of]
    q = torch.zeros(w.q.shape[0], groups * width, dtype=w.q.dtype)
    q[:, slot] = w.q[:, mine]
    order = torch.full((groups * width,), inputs, dtype=w.order.dtype)  # (padding: the appended zero)
    order[slot] = w.order[mine] - first
    return Unpacked(q, w.scale, w.zero, order, w.levels)


def install(
    layer: Any, shards: dict[Any, Unpacked], spec: Int4Spec, dtype: torch.dtype, where: str, kernel: str
) -> Int4LinearMethod:
    """Give `layer` (a `_Linear`) its quantized weight from its shards (checkpoint shard id -> whole
    unpacked weight), cut for this rank and stacked in the layer's shard order, for the model's `kernel`
    choice (`int4_kernels.for_model`); its float weight freed."""
    from gapless.model import layers

    if not isinstance(layer, layers._Linear):
        raise QuantFormatError(f"{where} ({type(layer).__name__}) has no {spec.method} form")
    order = list(getattr(layer, "shard_offsets", None) or [None])
    missing = [s for s in order if s not in shards]
    if missing:
        raise QuantFormatError(
            f"{where}: the checkpoint quantizes only some of its shards (missing {missing})"
        )
    pieces = [shard_for_rank(shards[s], layer, s, where) for s in order]
    if not all(same_order(p.order, pieces[0].order) for p in pieces):  # (the stack meets one x)
        raise QuantFormatError(f"{where}: its shards' act-orders (g_idx) differ; one input order is built")
    if not all(same_order(p.levels, pieces[0].levels) for p in pieces):  # (one table a layer)
        raise QuantFormatError(f"{where}: its shards' codebooks differ; one is built")
    q, scale, zero = map(torch.cat, zip(*(p.tensors for p in pieces)))
    w = Unpacked(q, scale, zero, pieces[0].order, pieces[0].levels)
    # the inputs it reads; a rank's regrouped act-order weight (`regroup_for_rank`) holds more columns than
    # x has, its padding reading index `inputs`: the zero appended to x
    inputs = layer.weight.shape[1]
    reads = int(w.order.max()) if w.order is not None and w.q.shape[1] != inputs else w.q.shape[1]
    if (w.q.shape[0], reads) != (layer.weight.shape[0], inputs):
        raise QuantFormatError(
            f"{where}: quantized weight {tuple(w.q.shape)} does not fit the layer's "
            f"{tuple(layer.weight.shape)}"
        )
    return hold(layer, w, spec, dtype, kernel)


def install_head(
    head: Any, w: Unpacked, spec: Int4Spec, dtype: torch.dtype, kernel: str, first: int | None = None
) -> Int4LinearMethod:
    """Give the LM head (a `ParallelLMHead`) its quantized weight from `w` [vocab rows, hidden]: this
    rank's rows, from `first` (default the head's first row; 0 where `w` holds them alone), padded with
    zero weights to the head's rows; its float weight dropped, a head tied to the embedding table untied
    first (the table keeps its float rows, where it keeps any)."""
    first = head.first if first is None else first
    count = max(0, min(head.rows, w.q.shape[0] - first))
    mine = w.map(lambda t: torch.nn.functional.pad(t[first : first + count], (0, 0, 0, head.rows - count)))
    head.weight = torch.nn.Parameter(head.weight.data.new_empty(0), requires_grad=False)  # (untied)
    return hold(head, mine, spec, dtype, kernel)


def same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two optional tensors (an input order, a codebook) are both None or equal."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def hold(layer: Any, w: Unpacked, spec: Int4Spec, dtype: torch.dtype, kernel: str) -> Int4LinearMethod:
    """`layer`'s method from its (this rank's) whole weight `w`; its float weight freed."""
    method = Int4LinearMethod(w, spec, dtype, layer.weight.device, kernel)
    layer.linear_method = method
    layer.weight.data = layer.weight.data.new_empty(0)
    return method


def random_unpacked(n: int, k: int, spec: Int4Spec, device: torch.device) -> Unpacked:
    """A random [N, K] weight in the scheme's form: values uniform over the 2^bits levels (NVFP4's and
    MXFP4's: their codes), zero at the middle, one scale per group such that W's standard deviation is
    0.02 (as `--load-format dummy`'s float weights); with act-order, its inputs in a random order (so the
    layer gathers x as a loaded one does)."""
    group, levels = spec.group_for(k), 1 << spec.bits
    if k % group:
        raise QuantFormatError(f"{spec.label}: {k} inputs are not whole groups of {group}")
    q = torch.randint(0, levels, (n, k), dtype=torch.int16, device=device)
    if spec.codebook in FP4_CODEBOOKS:  # (its codes' values: e2m1's, no zeros)
        table = torch.tensor(FP4_E2M1, device=device)
        scale = torch.full((n, k // group), 0.02 / float(table.square().mean().sqrt()), device=device)
        return Unpacked(q, scale, torch.zeros_like(scale), levels=table)
    scale = torch.full((n, k // group), 0.02 * 12**0.5 / levels, device=device)
    order = torch.randperm(k, device=device) if spec.act_order else None
    return Unpacked(q, scale, torch.full_like(scale, levels / 2), order)


def is_quantized_linear(module: Any) -> bool:
    """Whether an int4/int8 checkpoint quantizes `module`: a linear layer but a router (not the head)."""
    from gapless.model import layers

    return isinstance(module, layers._Linear) and not isinstance(module, layers.ReplicatedLinear)


def check_inputs(model: Any, modules: list[str], multiple: int, flag: str, what: str) -> None:
    """Refuse, in one line naming it, a module of `modules` with a weight whose inputs (this rank's: a
    linear layer's, or a mixture's gate/up or down) are no multiple of `multiple` (`what` says what that
    is), as `--quantization FLAG` rounds them at load."""
    from gapless.model.moe import Experts

    for name in modules:
        m = model.get_submodule(name)
        weights = (m.gate_up_proj, m.down_proj) if isinstance(m, Experts) else (m.get_parameter("weight"),)
        for k in (int(w.shape[-1]) for w in weights):
            if k % multiple:
                raise QuantFormatError(
                    f"--quantization {flag}: {name} takes {k} inputs (this rank's), not a multiple of {what}"
                )


def usual_targets(model: Any) -> list[str]:
    """The modules a weight-only scheme quantizes (`quantizes`), by name: every linear layer but the
    routers (the head is no `_Linear`), and every mixture's experts."""
    return [name for name, m in model.named_modules() if quantizes(m)]


def quantizes(module: Any) -> bool:
    """Whether an int4/int8 checkpoint's layout (and `install_random`) quantizes `module`: a mixture's
    experts, or `is_quantized_linear`."""
    from gapless.model.moe import Experts

    return isinstance(module, Experts) or is_quantized_linear(module)


def install_random(model: Any, spec: Int4Spec, dtype: torch.dtype, kernel: str) -> None:
    """A `--load-format dummy` load of a checkpoint of this scheme: random weights in its form
    (`random_unpacked`) for the layers such a checkpoint quantizes, every linear layer but the routers
    (and the LM head, which is not one) and every mixture's experts, cut for this rank as a loaded
    checkpoint is; the LM head too where the config quantizes it (`Int4Spec.lm_head`: this rank's rows,
    untied from the embedding table, which keeps its float rows). For benchmarks of shapes no quantized
    checkpoint is written for."""
    from gapless.model.moe import Experts
    from gapless.model.quant.int4_experts import install_experts  # (which imports this module)

    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not quantizes(module):
            continue
        if isinstance(module, Experts):
            device, tp = module.gate_up_proj.device, module.tp
            hidden, inter = module.gate_up_proj.shape[2], module.inter * tp.size
            shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
            shards = {
                (e, p): random_unpacked(*shapes[p], spec, device)
                for e in range(module.num_experts)
                for p in shapes
            }
            for e in range(module.num_experts):  # (act-order: gate and up read x in one order)
                shards[(e, "up")] = shards[(e, "up")]._replace(order=shards[(e, "gate")].order)
            install_experts(module, shards, spec, dtype, name)
        else:
            n, k = module.weight.shape
            w = random_unpacked(n, k, spec, module.weight.device)
            if w.order is not None and name.endswith(".down_proj"):  # (as a checkpoint's MLP is installed)
                gate_up = modules.get(name.removesuffix("down_proj") + "gate_up_proj")
                if takes_down_order(gate_up, module, w.scale.shape[1] * module.tp.size):
                    w = w._replace(order=None)
            hold(module, w, spec, dtype, kernel)
    if spec.lm_head:
        head = model.lm_head
        rows, hidden = head.weight.shape
        install_head(
            head, random_unpacked(rows, hidden, spec, head.weight.device), spec, dtype, kernel, first=0
        )
