"""Tiny weight-only int4/int8 checkpoints for tests: a float checkpoint's decoder projections quantized
group-wise and written in AWQ's, GPTQ's or compressed-tensors' `pack-quantized` or `int-quantized` (W8A8
INT8) layout (as described in `gapless.model.quant.int4_layouts`), beside a float checkpoint holding the
same weights dequantized (the reference a quantized model must equal)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gapless.model.quant.int4_configs import int4_spec_from_config
from gapless.model.quant.int4_layouts import AWQ_ORDER, Unpacked, pack_int32

# AutoRound's packings (`gapless.model.quant.auto_round`) by the layout each stores
AUTO_ROUND = {"auto_round:auto_gptq": "gptq", "auto_round": "gptq_v2", "auto_round:auto_awq": "awq"}
LAYOUTS = ("awq", "gptq", "gptq_v2", "compressed-tensors", "int-quantized", *AUTO_ROUND)
# every decoder projection: attention's, dense MLPs' (a shared expert's too), each expert's (Mixtral: w1/2/3)
PROJECTIONS = re.compile(r"model\.layers\.\d+\..*(_proj|\.experts\.\d+\.w[123])\.weight$")


def quantize(
    w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None = None
) -> Unpacked:
    """`w` [N, K] rounded to `bits`-bit integers in groups of `group` inputs (-1: the whole row), with
    float16 scales (as the checkpoints store them): asymmetric min/max, or symmetric with zero 2^(bits-1)
    and AutoGPTQ's and compressed-tensors' scale, 2 max|w| / (2^bits - 1) (so a group's most negative
    value takes code 0, its largest is clipped a step, to 2^(bits-1) - 1 steps).
    `order` (act-order): the inputs taken in that order, group j // G holding inputs order[j]."""
    if order is not None:
        return quantize(w[:, order], bits, group, sym)._replace(order=order)
    n, k = w.shape
    g = k if group < 0 else group
    wg = w.float().reshape(n, k // g, g)
    top = (1 << bits) - 1
    if sym:
        scale = wg.abs().amax(-1) * 2 / top
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale.clamp_min(1e-8)).clamp(1, top)  # >= 1: GPTQ v1 stores zero - 1
    scale = scale.clamp_min(1e-6).half().float()
    q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, top)
    return Unpacked(q.reshape(n, k).to(torch.int16), scale, zero)


def layout_label(layout: str, bits: int, group: int, sym: bool, act_order: bool = False) -> str:
    """The weight format the loader names a checkpoint of `layout` by (`Int4Spec.label`, of its config)."""
    spec = int4_spec_from_config(quantization_config(layout, bits, group, sym, act_order))
    assert spec is not None
    return spec.label


def awq_pack(v: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles -> AWQ's [R, C / 8] int32s, nibble i of a word holding column AWQ_ORDER[i]."""
    return pack_int32(v.reshape(v.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(v.shape), 4, dim=1)


def layout_tensors(w: Unpacked, layout: str, bits: int, group: int) -> dict[str, torch.Tensor]:
    """One projection's tensors (by suffix) in `layout` (one of LAYOUTS; AutoRound's GPTQ layout without
    g_idx, as its exporter writes it)."""
    if layout in AUTO_ROUND:
        tensors = layout_tensors(w, AUTO_ROUND[layout], bits, group)
        return {name: t for name, t in tensors.items() if name != "g_idx"}
    n, k = w.q.shape
    mask = (1 << bits) - 1
    if layout == "awq":
        return {
            "qweight": awq_pack(w.q.t()),
            "qzeros": awq_pack(w.zero.t().to(torch.int16)),
            "scales": w.scale.t().half().contiguous(),
        }
    # act-order: q's columns back in input order, each input's group in g_idx
    g_idx = torch.arange(k, dtype=torch.int32) // (k if group < 0 else group)
    q = w.q
    if w.order is not None:
        q, g_idx = (
            torch.empty_like(q).index_copy_(1, w.order, q),
            torch.empty_like(g_idx).index_copy_(0, w.order, g_idx),
        )
    if layout in ("gptq", "gptq_v2"):
        stored = w.zero.to(torch.int64) - (1 if layout == "gptq" else 0)
        return {
            "qweight": pack_int32(q.t(), bits, dim=0),
            "qzeros": pack_int32((stored & mask).t(), bits, dim=1),
            "scales": w.scale.t().half().contiguous(),
            "g_idx": g_idx,
        }
    half = 1 << (bits - 1)
    asymmetric = not bool((w.zero == half).all())
    if layout == "int-quantized":  # the signed values and zero points in int8, unpacked
        out = {"weight": (q - half).to(torch.int8), "weight_scale": w.scale.half()}
        if asymmetric:
            out["weight_zero_point"] = (w.zero - half).to(torch.int8)
        if w.order is not None:
            out["weight_g_idx"] = g_idx
        return out
    out = {
        "weight_packed": pack_int32(q, bits, dim=1),
        "weight_scale": w.scale.half(),
        "weight_shape": torch.tensor([n, k]),
    }
    if asymmetric:
        out["weight_zero_point"] = pack_int32(w.zero, bits, dim=0)
    if w.order is not None:
        out["weight_g_idx"] = g_idx
    return out


def quantization_config(
    layout: str, bits: int, group: int, sym: bool, act_order: bool = False, head: bool = False
) -> dict[str, Any]:
    """The `quantization_config` a checkpoint of `layout` carries in its config.json; `head`: its LM head
    quantized too, as each writer says so (GPTQModel's `lm_head`, AutoRound's `extra_config`,
    compressed-tensors' `ignore` without it)."""
    if head and layout == "awq":
        raise ValueError("AWQ checkpoints keep the LM head float")
    if layout in AUTO_ROUND:  # (as auto-round 0.9's exporter writes it)
        extra = {"lm_head": dict(bits=bits, group_size=group, sym=sym, data_type="int")} if head else None
        return dict(
            extra_config=extra,
            quant_method="auto-round",
            packing_format=layout,
            bits=bits,
            group_size=group,
            sym=sym,
            data_type="int",
            act_bits=16,
            block_name_to_quantize="model.layers",
            autoround_version="0.9.0",
        )
    if layout == "awq":
        return dict(quant_method="awq", bits=bits, group_size=group, zero_point=True, version="gemm")
    if layout in ("gptq", "gptq_v2"):
        return dict(
            quant_method="gptq",
            bits=bits,
            group_size=group,
            desc_act=act_order,
            sym=sym,
            checkpoint_format=layout,
            lm_head=head,
        )
    weights = dict(
        num_bits=bits,
        type="int",
        symmetric=sym,
        strategy="group" if group > 0 else "channel",
        group_size=group if group > 0 else None,
        actorder="group" if act_order else None,
        dynamic=False,
    )
    # int-quantized: a W8A8 checkpoint's dynamic per-token int8 activations (which gapless does not take)
    acts = dict(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    group_0 = dict(
        targets=["Linear"], weights=weights, input_activations=acts if layout == "int-quantized" else None
    )
    return dict(
        quant_method="compressed-tensors",
        format="pack-quantized" if layout == "compressed-tensors" else layout,
        config_groups={"group_0": group_0},
        ignore=[] if head else ["lm_head"],
        quantization_status="compressed",
    )


def write_quantized(
    src: Path,
    dst: Path,
    layout: str,
    *,
    bits: int = 4,
    group: int = 32,
    sym: bool = False,
    act_order: bool = False,
    head: bool = False,
) -> tuple[Path, Path]:
    """(the quantized checkpoint, its float32 reference) written under `dst` from the one-file float
    checkpoint `src`: every decoder projection quantized, everything else (embeddings, norms, LM head,
    biases) kept in float; with `head`, the LM head too (`quantize_head`). `act_order` (GPTQ,
    compressed-tensors): each projection's inputs grouped in a random order, the same for the projections
    one input feeds (a layer's q/k/v, its gate/up), as act-order's quantizers order them by the input's
    statistics."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    if act_order and layout == "awq":
        raise ValueError("AWQ has no act-order")
    qdir, refdir = dst / layout, dst / f"{layout}-reference"

    def quantized(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        check_packable(name, tuple(t.shape), layout, bits, group, sym)
        w = quantize(t, bits, group, sym, _input_order(name, t.shape[1]) if act_order else None)
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.{s}": v for s, v in layout_tensors(w, layout, bits, group).items()}, w.dequantize()

    write_pair(src, qdir, refdir, quantized)
    if head:
        quantize_head(src, qdir, refdir, quantized)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout, bits, group, sym, act_order, head)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, refdir


def check_packable(name: str, shape: tuple[int, ...], layout: str, bits: int, group: int, sym: bool) -> None:
    """Refuse (ValueError, naming the weight) a weight `layout` cannot store in `bits`: its inputs not
    whole groups, or a dimension it packs into int32 words not whole words (`bits` values a word, 3 bits'
    32 values in 3 words: a 3-bit LM head's vocab a multiple of 32). What each packs: AWQ its outputs (its
    weights' and zeros'), GPTQ (and AutoRound's) its inputs (the weights) and outputs (the zeros),
    compressed-tensors' pack-quantized its inputs, and its outputs where it has zeros (asymmetric)."""
    n, k = shape
    per = 32 // bits if 32 % bits == 0 else 32
    if group > 0 and k % group:
        raise ValueError(f"{name} {list(shape)}: its {k} inputs are not whole groups of {group}")
    sizes = {"inputs": k, "outputs": n}
    packs = {"awq": ["outputs"], "compressed-tensors": ["inputs"] + ([] if sym else ["outputs"])}
    for what in packs.get(AUTO_ROUND.get(layout, layout), [] if layout == "int-quantized" else list(sizes)):
        if sizes[what] % per:
            words = "3 int32 words" if bits == 3 else "an int32 word"
            hint = f" (an LM head's vocab: e.g. {-(-n // per) * per})" if what == "outputs" else ""
            raise ValueError(
                f"{name} {list(shape)}: {layout} packs {bits}-bit values {per} to {words} along its {what}, "
                f"and {sizes[what]} is not a multiple of {per}{hint}"
            )


def quantize_head(
    src: Path,
    qdir: Path,
    refdir: Path,
    quantized: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
) -> None:
    """`write_pair`'s checkpoints with the LM head quantized too (a tied model's: the embedding table's
    weight, the table kept float beside it): its tensors (`quantized("lm_head.weight", weight)`) in place
    of its float weight in `qdir`, its float32 weight in `refdir` as an untied head."""
    tensors = load_file(str(src / "model.safetensors"))
    weight = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    stored, held = quantized("lm_head.weight", weight)
    for d, added in ((qdir, stored), (refdir, {"lm_head.weight": held.to(weight.dtype)})):
        edit_tensors(d, partial(_replace_head, added))
    config = json.loads((refdir / "config.json").read_text())
    (refdir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}, indent=2))


def _replace_head(added: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` with the LM head's float weight replaced by `added`."""
    tensors.pop("lm_head.weight", None)
    tensors.update(added)


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear layers a weight-only scheme quantizes (`int4.is_quantized_linear`: all but the routers)."""
    from gapless.model.quant.int4 import is_quantized_linear

    return [m for m in model.modules() if is_quantized_linear(m)]


def experts_of(model: torch.nn.Module) -> list[Any]:
    """The model's mixtures' `Experts`, in order."""
    from gapless.model.moe import Experts

    return [m for m in model.modules() if isinstance(m, Experts)]


def assert_codebook_layers(model: torch.nn.Module, reference: torch.nn.Module, label: str) -> list[Any]:
    """Every linear layer of `model` holds a codebook layer named `label` on the int4 path whose weight is
    `reference`'s (the same model's float load) bit for bit, in under a seventh of float32's bytes; their
    methods."""
    from gapless.model.quant import base, int4

    formats, _ = base.weights_held(model)
    layers = linear_layers(model)
    methods: list[Any] = [m.linear_method for m in layers]
    assert all(isinstance(m, int4.Int4LinearMethod) for m in methods), formats
    assert formats[label] == len(layers), formats
    for name, m in model.named_modules():
        if m in layers:
            w = reference.get_submodule(name).get_parameter("weight")
            assert torch.equal(m.linear_method.dequantized(torch.float32), w), name
    four_bit = sum(t.numel() * t.element_size() for m in methods for t in (m.qweight, m.scales, m.levels))
    assert four_bit < 0.15 * sum(m.out_features * m.in_features * 4 for m in methods)
    return methods


def edit_tensors(checkpoint: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """A one-file checkpoint's tensors (by name) changed in place by `edit`, and saved again."""
    file = checkpoint / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def rounded_copy(
    src: Path, to: Path, round_weight: Callable[[torch.Tensor], torch.Tensor], which: re.Pattern = PROJECTIONS
) -> Path:
    """A copy at `to` of the one-file float checkpoint `src`, each weight `which` matches (every decoder
    projection's: each checkpoint tensor, an expert's among them; no router's, embedding's or head's)
    through `round_weight`: the float reference of the model a load quantizes as it reads `src` (a rounding
    within each row gives a fused projection's weight as its checkpoint tensors' rounded one by one)."""
    shutil.copytree(src, to)

    def round_projections(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if which.match(n)]:
            tensors[name] = round_weight(tensors[name])

    edit_tensors(to, round_projections)
    return to


def assert_refused_after(
    checkpoint: Path, edit: Callable[[dict[str, torch.Tensor]], object], words: tuple[str, ...]
) -> None:
    """`checkpoint` broken by `edit` (`edit_tensors`) is refused on a CPU load with a one-line
    `QuantFormatError` holding every one of `words`."""
    from gapless.model import loader
    from gapless.model.quant.formats import QuantFormatError

    edit_tensors(checkpoint, edit)
    try:
        loader.load_model(checkpoint, torch.float32, torch.device("cpu"))
    except QuantFormatError as e:
        message = str(e)
    else:
        raise AssertionError(f"{checkpoint} loaded; a QuantFormatError was expected")
    assert "\n" not in message and all(w in message for w in words), message


def write_pair(
    src: Path,
    qdir: Path,
    refdir: Path,
    quantized: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
) -> None:
    """The one-file float checkpoint `src` copied to `qdir` and `refdir`, each decoder projection `name`
    (`PROJECTIONS`) replaced in `qdir` by the tensors `quantized(name, weight)` gives (by full name) and in
    `refdir` by the float32 weight they hold (in the weight's dtype); every other tensor kept in both."""
    for d in (qdir, refdir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not PROJECTIONS.match(name):
            out[name] = reference[name] = t
            continue
        tensors, held = quantized(name, t)
        out |= {key: v.contiguous() for key, v in tensors.items()}
        reference[name] = held.to(t.dtype)
    save_file(out, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(refdir / "model.safetensors"), metadata={"format": "pt"})


# what feeds a projection, by its name: the attention's input, o's, the MLP's, down's
_INPUTS = (
    ("q_proj", "k_proj", "v_proj", "qkv_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj", "gate_up"),
    ("down_proj",),
)


def _input_order(name: str, k: int) -> torch.Tensor:
    """A random order of a projection's `k` inputs, seeded by what feeds them (the layer, the expert and
    its input: the attention's, o's, the MLP's, down's), so projections sharing an input share it, and
    each expert has its own (as act-order's quantizers order inputs by each one's own statistics)."""
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1  # (-1: the LM head)
    expert = re.search(r"\.experts\.(\d+)\.", name)
    feeds = next((i for i, kinds in enumerate(_INPUTS) if any(s in name for s in kinds)), len(_INPUTS))
    seed = (1000 * layer + (int(expert.group(1)) + 1 if expert else 0)) * 8 + feeds
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))
