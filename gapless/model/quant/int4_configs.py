"""The weight-only int4/int8 schemes' configs: a checkpoint's `quantization_config` read into an `Int4Spec`
(`int4_spec_from_config`), whose tensors `gapless.model.quant.int4_layouts` reads; a scheme that is not run
refused in one line naming the field. AWQ (GEMM layout), GPTQ (v1 and v2 zeros, act-order, GPTQModel's
`dynamic` rules), compressed-tensors' `pack-quantized`, `int-quantized`, `nvfp4-pack-quantized` and
`mxfp4-pack-quantized`, bitsandbytes' 8-bit, ModelOpt's NVFP4, and Intel's AutoRound, which writes GPTQ's
or AWQ's layout, as its `packing_format` says (as auto-round's exporter picks its packer):

- `auto_round:auto_gptq` (its default for symmetric weights): GPTQ's, the zeros stored minus one;
- `auto_round` (asymmetric weights in its own format) and `auto_round:gptqmodel`: GPTQ's, the zeros as
  they are (gptq_v2), g_idx none or `k // G` (AutoRound has no act-order);
- `auto_round:auto_awq`: AWQ's GEMM layout (4 bits, zero points stored).

AutoRound's `extra_config` gives single layers their own scheme: a layer kept float (bits 16) is read as
float from the checkpoint itself, as every format's, and one quantized as the config says (its LM head,
`--quant_lm_head`) as its tensors say; one quantized otherwise is refused by name, as are its other data
types (FP8/MXFP4/NVFP4 exports) and quantized activations (`act_bits` < 16). As GPTQModel's `dynamic`
rules, which are read the same way. A quantized LM head (GPTQModel's `lm_head: true`, AutoRound's, a
compressed-tensors config that does not ignore it) is read as any layer (`int4.install_head`).
"""

from __future__ import annotations

from typing import Any

from gapless.model.quant.formats import MODELOPT_NVFP4, QuantFormatError, config_method, modelopt_algo
from gapless.model.quant.int4_layouts import MXFP4_GROUP, NVFP4_GROUP, Int4Spec


def refuse(method: str, what: str) -> QuantFormatError:
    return QuantFormatError(f"quantization_config ({method}): {what}")


def _listed(value: Any) -> list[Any]:
    """A config's list field, a lone string taken as a list of one (as some writers store `targets`)."""
    return [value] if isinstance(value, str) else list(value or [])


def check_bits_group(method: str, bits: Any, group: Any, allowed: tuple[int, ...]) -> tuple[int, int]:
    """(bits, group) of a config's scheme, refused in one line naming `method` where the bits are not
    `allowed` or the group is not a power of two >= 16 (or -1, None: per channel)."""
    if bits not in allowed:
        raise refuse(method, f"bits={bits!r} is not run; bits: {', '.join(map(str, allowed))}")
    if group is None:
        group = -1
    if not isinstance(group, int) or not (group == -1 or (group >= 16 and group & (group - 1) == 0)):
        raise refuse(method, f"group_size={group!r} is not run; a power of two >= 16, or -1 (per channel)")
    return int(bits), group


def _awq(qc: dict[str, Any]) -> Int4Spec:
    version = qc.get("version", "gemm")
    if str(version).lower() != "gemm":
        raise refuse("awq", f"version={version!r} is not read; only the GEMM layout (version 'gemm')")
    bits, group = check_bits_group(
        "awq", qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")), (4,)
    )
    if qc.get("zero_point", True) is False:
        raise refuse("awq", "zero_point=false is not read; AWQ's GEMM layout with zero points only")
    return Int4Spec("awq", bits, group, sym=False)


def _gptq(qc: dict[str, Any]) -> Int4Spec:  # (desc_act: read from each layer's g_idx, `unpack`)
    # (the format's key: `checkpoint_format`, `format` in some GPTQModel releases, AutoGPTQ's older flag)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse("gptq", f"checkpoint_format={fmt!r} is not read; gptq or gptq_v2")
    if str(qc.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":  # (GPTQModel's option)
        raise refuse("gptq", f"pack_dtype={qc['pack_dtype']!r} is not read; values packed in int32 only")
    bits, group = check_bits_group("gptq", qc.get("bits"), qc.get("group_size"), (2, 3, 4, 8))
    _check_dynamic(qc)
    sym = bool(qc.get("sym", True))
    act_order = bool(qc.get("desc_act")) and not qc.get("static_groups")  # (static: g_idx is k // G)
    zero_offset = 1 if fmt == "gptq" else 0
    held, stored = _held_bits(bits)
    head = bool(qc.get("lm_head"))
    return Int4Spec("gptq", held, group, sym, zero_offset, act_order, lm_head=head, stored_bits=stored)


def _held_bits(bits: int) -> tuple[int, int]:
    """(the bits GPTQ's layout of `bits` is held in, `Int4Spec.stored_bits`): 2 and 3 as 4 (the kernels
    take 4 and 8), the checkpoint's bits kept for reading it; 4 and 8 as they are (stored_bits 0)."""
    return (4, bits) if bits < 4 else (bits, 0)


_SCHEME_KEYS = {"bits": None, "group_size": None, "sym": True, "desc_act": False}  # (and their defaults)


def _check_dynamic(qc: dict[str, Any]) -> None:
    """GPTQModel's per-module rules (`dynamic`): a rule that leaves modules unquantized (`-:`) is read from
    the checkpoint itself (a layer is quantized where its tensors are); one that quantizes modules with
    other bits, groups, symmetry or act-order than the config's is refused by name (one scheme a model)."""
    rules = qc.get("dynamic") or {}
    if not isinstance(rules, dict):
        raise refuse("gptq", f"dynamic={rules!r} is not a dict of module rules")
    for pattern, override in rules.items():
        if str(pattern).startswith("-:"):
            continue
        changed = sorted(
            k for k, v in (override or {}).items() if k in _SCHEME_KEYS and v != qc.get(k, _SCHEME_KEYS[k])
        )
        if changed:
            raise refuse(
                "gptq", f"dynamic rule {pattern!r} quantizes with its own {', '.join(changed)}: not built"
            )


def _compressed(qc: dict[str, Any]) -> Int4Spec | None:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise refuse("compressed-tensors", "no config_groups")
    formats = {str(g.get("format") or qc.get("format")) for g in groups}
    if formats == {"nvfp4-pack-quantized"}:
        return _nvfp4_config("compressed-tensors", [g.get("weights") or {} for g in groups])
    if formats == {"mxfp4-pack-quantized"}:
        return _mxfp4_config([g.get("weights") or {} for g in groups])
    if formats not in ({"pack-quantized"}, {"int-quantized"}):
        return None  # another compressed-tensors format (float-quantized: the FP8 method's)
    packed = formats == {"pack-quantized"}
    schemes = {repr(sorted(g.get("weights", {}).items())) for g in groups}
    if len(schemes) != 1:
        raise refuse("compressed-tensors", "config_groups with different weight schemes are not run")
    w = groups[0].get("weights") or {}
    if packed and any(g.get("input_activations") for g in groups):  # (int-quantized's: left unused)
        raise refuse(
            "compressed-tensors", "pack-quantized with quantized activations is not run (w4a16/w8a16 only)"
        )
    if w.get("type", "int") != "int":
        raise refuse("compressed-tensors", f"weights of type {w.get('type')!r} are not run; int only")
    # act-order: "group" stores each input's group (`weight_g_idx`, read by `unpack`); "weight" only
    # quantized in that order, its groups contiguous
    if w.get("actorder") not in (None, False, True, "group", "weight", "static"):
        raise refuse("compressed-tensors", f"actorder={w.get('actorder')!r} is not read")
    if w.get("dynamic"):
        raise refuse("compressed-tensors", "dynamic weight quantization is not run")
    strategy = w.get("strategy")
    strategies = ("group", "channel") if packed else ("group", "channel", "tensor")
    if strategy not in strategies:
        raise refuse("compressed-tensors", f"strategy={strategy!r} is not run; {' or '.join(strategies)}")
    targets = {str(t) for g in groups for t in _listed(g.get("targets", []))}
    if targets - {"Linear"}:
        raise refuse("compressed-tensors", f"targets {sorted(targets)} are not run; Linear only")
    group_size = w.get("group_size") if strategy == "group" else -1
    bits, group = check_bits_group("compressed-tensors", w.get("num_bits"), group_size, (4, 8))
    symmetric, act_order = bool(w.get("symmetric", True)), w.get("actorder") in (True, "group")
    return Int4Spec(
        "compressed-tensors",
        bits,
        group,
        symmetric,
        act_order=act_order,
        packed=packed,
        per_tensor=strategy == "tensor",
    )


def _nvfp4_config(method: str, weights: list[dict[str, Any]]) -> Int4Spec:
    """An NVFP4 checkpoint's spec (`weights`: compressed-tensors' schemes, each e2m1 in groups of 16;
    ModelOpt's: its config's group size alone)."""
    for w in weights:
        if (w.get("type", "float"), w.get("num_bits", 4)) != ("float", 4):
            raise refuse(method, f"NVFP4 weights {w.get('type')}{w.get('num_bits')}: fp4 (e2m1) only")
        if w.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
            raise refuse(method, f"NVFP4 group_size={w.get('group_size')!r} is not read; {NVFP4_GROUP}")
    return Int4Spec(method, 4, NVFP4_GROUP, sym=True, codebook="nvfp4")


def _mxfp4_config(weights: list[dict[str, Any]]) -> Int4Spec:
    """A compressed-tensors MXFP4 checkpoint's spec (`mxfp4-pack-quantized`: e2m1 codes, an e8m0 scale
    per 32 inputs, no per-tensor scale)."""
    for w in weights:
        if (w.get("type", "float"), w.get("num_bits", 4)) != ("float", 4):
            raise refuse("compressed-tensors", f"MXFP4 weights {w.get('type')}{w.get('num_bits')}: fp4 only")
        if w.get("group_size", MXFP4_GROUP) != MXFP4_GROUP:
            raise refuse("compressed-tensors", f"MXFP4 group_size={w.get('group_size')!r} is not read; 32")
    return Int4Spec("compressed-tensors", 4, MXFP4_GROUP, sym=True, codebook="mxfp4")


def int4_spec_from_config(qc: dict[str, Any] | None) -> Int4Spec | None:
    """The weight-only integer scheme a checkpoint's `quantization_config` names; None when it names none
    (or another method: FP8). Raises `QuantFormatError`, one line naming the field, for a scheme of these
    methods that is not run (bits other than 4/8, a group size that is not a power of two, ...)."""
    if not qc:
        return None
    method = config_method(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    if method == "bitsandbytes" and (qc.get("load_in_8bit") or qc.get("_load_in_8bit")):
        return Int4Spec("bitsandbytes", 8, -1, sym=True, packed=False)
    if method == AUTO_ROUND:
        return _auto_round(qc)
    if method == "quark":
        from gapless.model.quant import quark_configs

        return quark_configs.int4_spec(qc)
    if method == "modelopt" and modelopt_algo(qc) in MODELOPT_NVFP4:
        inner = qc.get("quantization")
        group = (inner if isinstance(inner, dict) else qc).get("group_size", NVFP4_GROUP)
        return _nvfp4_config("modelopt", [{"group_size": group}])
    return None


# Intel's AutoRound (the module's docstring)
AUTO_ROUND = "auto-round"  # (also Intel Neural Compressor's older `intel/auto-round`: `CONFIG_ALIASES`)
# `packing_format` -> the layout it stores (GPTQ's checkpoint_format, or AWQ's)
PACKINGS = {
    "auto_round:auto_gptq": "gptq",
    "auto_round": "gptq_v2",
    "auto_round:gptqmodel": "gptq_v2",
    "auto_round:auto_awq": "awq",
}
_DEFAULTS = {"sym": True, "data_type": "int", "act_bits": 16}  # (a scheme's keys besides bits and group)


def _auto_round(qc: dict[str, Any]) -> Int4Spec:
    """The weight-only scheme an AutoRound `quantization_config` names (the module's docstring)."""
    packing = str(qc.get("packing_format") or "auto_round:auto_gptq")
    layout = PACKINGS.get(packing)
    if layout is None:
        raise refuse(AUTO_ROUND, f"packing_format={packing!r} is not read; {', '.join(PACKINGS)}")
    if str(qc.get("data_type") or "int") != "int":
        raise refuse(AUTO_ROUND, f"data_type={qc['data_type']!r} is not run; int only")
    if _bits(qc.get("act_bits"), "act_bits") < 16:
        what = f"act_bits={qc['act_bits']!r} (quantized activations)"
        raise refuse(AUTO_ROUND, f"{what} is not run; weight-only")
    _check_extra(qc)
    allowed = (4,) if layout == "awq" else (2, 3, 4, 8)
    bits, group = check_bits_group(AUTO_ROUND, qc.get("bits"), qc.get("group_size"), allowed)
    head = any("lm_head" in str(name) for name in _quantized_extra(qc))  # (`--quant_lm_head`)
    if layout == "awq":
        return Int4Spec("awq", bits, group, sym=False, producer=AUTO_ROUND, lm_head=head)
    zero_offset = 1 if layout == "gptq" else 0
    sym = bool(qc.get("sym", True))
    held, stored = _held_bits(bits)
    return Int4Spec(
        "gptq", held, group, sym, zero_offset, producer=AUTO_ROUND, lm_head=head, stored_bits=stored
    )


def _quantized_extra(qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """AutoRound's `extra_config` entries that quantize their layers (bits below 16), by layer name."""
    extra = qc.get("extra_config") or {}
    if not isinstance(extra, dict):
        raise refuse(AUTO_ROUND, f"extra_config={extra!r} is not a dict of layer schemes")
    entries = {str(name): override or {} for name, override in extra.items()}
    if not all(isinstance(o, dict) for o in entries.values()):
        raise refuse(AUTO_ROUND, "extra_config's entries are not dicts of a layer's scheme")
    quantized = {n: o for n, o in entries.items() if _bits(o.get("bits", qc.get("bits")), f"{n} bits") < 16}
    return quantized


def _bits(value: Any, what: str) -> int:
    """A scheme's bit count (None: 16, unquantized), refused by name where it is no integer."""
    if value is None:
        return 16
    if not isinstance(value, int) or isinstance(value, bool):
        raise refuse(AUTO_ROUND, f"{what}={value!r} is not a number of bits")
    return value


def _check_extra(qc: dict[str, Any]) -> None:
    """Refuse an `extra_config` entry that quantizes a layer with its own bits, group, symmetry, data type
    or activations; one keeping a layer float (bits >= 16), or quantizing one (the LM head) as the config
    does, is the checkpoint's to say."""
    for name, override in _quantized_extra(qc).items():
        changed = sorted(
            k
            for k, v in override.items()
            if k in ("bits", "group_size", *_DEFAULTS) and v != qc.get(k, _DEFAULTS.get(k))
        )
        if changed:
            own = ", ".join(changed)
            raise refuse(AUTO_ROUND, f"extra_config {name!r} quantizes with its own {own}: not built")
