"""Which quantized format a checkpoint's weights are in, read before any weight loads.

A checkpoint says it in its `config.json`'s `quantization_config` (`quant_method`, vLLM's and Hugging
Face's names) or in ModelOpt's `hf_quant_config.json` (`gapless.model.quant.declared` reads them);
`--quantization` (`EngineConfig.quantization`) names one for a float checkpoint to be quantized at load
(`fp8`, `bitsandbytes`, `rtn`, `experts_int8`), or repeats the checkpoint's own (or names vLLM's or
SGLang's kernel for it: `FLAG_ALIASES`, `SGLANG_FLAGS`). `resolve` turns the two into a `QuantSpec` and
refuses, in one line naming the format, one that is unknown, malformed, or cannot run on the device in
use. One entry of `FORMATS` per `quant_method` (compressed-tensors: one per its own `format`, in
`CT_FORMATS`): a parser of the config into a spec. The loader (`gapless.model.loader`) hands the spec to
the module `gapless.model.quant.<spec.scheme>`, which provides:

- `SCALE_NAMES`: the checkpoint tensor names (last part) that mark a layer as quantized (the loader reads
  them from the safetensors headers, before loading: a layer with one is quantized);
- `quantized_modules(model, spec, targets) -> list[str]`: the modules to quantize (`targets`: those the
  checkpoint marks), or a one-line QuantFormatError;
- `usual_targets(model) -> list[str]`: the modules such checkpoints mark (`--load-format dummy`'s targets);
- `prepare(model, spec, modules)`: before loading, give those modules the parameters their checkpoint
  tensors load into (each with its `weight_loader`, cutting it as tensor parallelism and fused shards do);
- `finish(model, spec, modules)`: after loading, install each module's `linear_method` (whose
  `quant_method` is `spec.name`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gapless.config import E5M2_KV_CACHE_DTYPE, FP8_KV_CACHE_DTYPES

if TYPE_CHECKING:
    import torch

    from gapless.model.quant.int4_layouts import Int4Spec

log = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores


@dataclass(frozen=True)
class QuantSpec:
    """A quantized weight format as the loader needs it.

    `name`: the `quant_method` (vLLM's name); `scheme`: the module of `gapless.model.quant` that runs it
    ("fp8"); `label`: how the start-up line, `/v1/models` and `/metrics` name it; `online`: the checkpoint
    holds float weights that are quantized at load; `weight_block`: (rows, columns) a weight scale covers
    (None: one scale per output row, or per tensor: `per_tensor`). Which layers are quantized is read
    from the checkpoint itself (the weights that come with scales), not from its config's ignore lists;
    `weight_only`: an int4/int8 checkpoint's layout (`gapless.model.quant.int4`, which loads its layers
    itself after the float weights, not through `prepare`/`finish`). Scheme "bnb" (bitsandbytes 4-bit):
    the loader reads its weights through `gapless.model.quant.bnb.dequantized`, as floats, and where
    `bnb.kept` quantizes them again as they become whole, as an online load's."""

    name: str
    scheme: str
    label: str
    online: bool = False
    weight_block: tuple[int, int] | None = None
    per_tensor: bool = False
    min_capability: tuple[int, int] = FP8_MIN_CAPABILITY
    weight_only: Int4Spec | None = None  # scheme "int4": the bits, groups and zeros of the layout
    codebook: str = ""  # scheme "bnb": its 4-bit values' codebook, "nf4" or "fp4"
    rtn: tuple[int, int] | None = None  # scheme "rtn": (bits, group; -1 one a row), `gapless.model.quant.rtn`

    def __post_init__(self) -> None:
        width = self.weight_block[1] if self.weight_block is not None else 16
        if width < 16 or width & (width - 1):  # (the fp8 kernels' K steps: whole blocks of them)
            raise QuantFormatError(
                f"quantization {self.name}: block width {width} is not a power of two >= 16"
            )


class QuantFormatError(ValueError):
    """A quantized format gapless cannot run here (one line, naming it)."""


Parser = Callable[[dict[str, Any], bool], QuantSpec]  # (quantization_config, online) -> spec


# where a checkpoint declares its format (`declared`), as the refusals of one declaring none name them
DECLARED_IN = (
    "config.json's quantization_config, hf_quant_config.json, quantize_config.json or quant_config.json"
)


def _not_at_load(method: str) -> QuantFormatError:
    """`--quantization METHOD` on a checkpoint that declares no format: METHOD is read, not applied."""
    return QuantFormatError(
        f"--quantization {method} reads a checkpoint quantized as {method}, but this one declares no "
        f"quantization ({DECLARED_IN}): only fp8, bitsandbytes, rtn and experts_int8 are applied at load to "
        "float weights"
    )


def _fp8(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """`quant_method: fp8`: Hugging Face's FineGrainedFP8 / DeepSeek layout (Qwen's `*-FP8` repositories):
    e4m3 weights, `weight_scale_inv` per `weight_block_size` block; without `weight_block_size` (vLLM's
    and AutoFP8's serialization) a `weight_scale` per tensor; or, `online`, a float checkpoint quantized
    at load with one scale per output row."""
    if online:
        return QuantSpec("fp8", "fp8", "fp8 e4m3 per-channel (quantized at load)", online=True)
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantFormatError(f"quantization fp8: fmt={fmt!r} is not run (e4m3 only)")
    block = qcfg.get("weight_block_size")
    if block is None:  # vLLM's own FP8 serialization and AutoFP8's (neuralmagic's older `*-FP8`)
        return QuantSpec("fp8", "fp8", "fp8 e4m3 per-tensor", per_tensor=True)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantFormatError(f"quantization fp8: weight_block_size={block!r} is not [rows, columns]")
    return QuantSpec(
        "fp8",
        "fp8",
        f"fp8 e4m3 block {block[0]}x{block[1]}",
        weight_block=(block[0], block[1]),
    )


def _ct_float(qcfg: dict[str, Any], group: dict[str, Any]) -> QuantSpec:
    """compressed-tensors `float-quantized`: e4m3 weights with `weight_scale` per tensor, per output row
    (`channel`), per `block_structure` block or per `group_size` inputs (`mxfp8-quantized`: MXFP8, groups
    of 32 with e8m0 scales); activations quantized per token at run time (a static `input_scale` in the
    checkpoint is not used: see docs/models.md)."""
    w = group.get("weights") or {}
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        raise QuantFormatError(
            "quantization compressed-tensors float-quantized: weights of type "
            f"{w.get('type')!r}, num_bits {w.get('num_bits')!r} are not run (type 'float', num_bits 8 only)"
        )
    strategy = w.get("strategy")
    base = "compressed-tensors fp8 e4m3"
    if strategy == "tensor":
        return QuantSpec("compressed-tensors", "fp8", f"{base} per-tensor", per_tensor=True)
    if strategy == "channel":
        return QuantSpec("compressed-tensors", "fp8", f"{base} per-channel")
    if strategy == "block":
        block = w.get("block_structure") or []
        if not (len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantFormatError(
                f"quantization compressed-tensors: block_structure={block!r} is not [rows, columns]"
            )
        label = f"{base} block {block[0]}x{block[1]}"
        return QuantSpec("compressed-tensors", "fp8", label, weight_block=(block[0], block[1]))
    if strategy == "group":  # (a [1, G] block: MXFP8's, G = 32, its scales e8m0)
        size = w.get("group_size")
        if not isinstance(size, int) or size < 16 or size & (size - 1):
            raise QuantFormatError(
                f"quantization compressed-tensors: fp8 group_size={size!r} is not a power of two >= 16"
            )
        mx = qcfg.get("format") == "mxfp8-quantized"
        label = f"compressed-tensors {'mxfp8 e4m3' if mx else 'fp8 e4m3'} g{size}"
        return QuantSpec("compressed-tensors", "fp8", label, weight_block=(1, size))
    raise QuantFormatError(
        f"quantization compressed-tensors float-quantized: weight strategy {strategy!r} is not run "
        "(tensor, channel, block, group)"
    )


def _int4(qcfg: dict[str, Any], online: bool = False) -> QuantSpec:
    """AWQ, GPTQ, AutoRound and compressed-tensors `pack-quantized` and `int-quantized`: int4/int8 weights
    with group-wise scales and zeros; NVFP4 (ModelOpt's, compressed-tensors'): FP4 codes with group
    scales; activations in the model's dtype (`gapless.model.quant.int4_configs` reads and refuses the
    configs, `int4_layouts` the tensors)."""
    from gapless.model.quant import int4_configs

    method = config_method(qcfg)
    if online:
        raise _not_at_load(method)
    spec = int4_configs.int4_spec_from_config(qcfg)
    if spec is None:  # (a compressed-tensors config whose groups' format is another's than its own)
        formats = sorted({str(g.get("format")) for g in (qcfg.get("config_groups") or {}).values()})
        raise QuantFormatError(
            f"quantization {method}: format {qcfg.get('format')!r}, but its config groups' {formats}"
        )
    return QuantSpec(method, "int4", spec.label, min_capability=(8, 0), weight_only=spec)


# ModelOpt's FP8 `quant_algo`s -> (how the label says its weights, the weight block a scale covers)
MODELOPT_FP8 = {
    "FP8": ("fp8 e4m3 per-tensor", None),
    "FP8_PER_CHANNEL_PER_TOKEN": ("fp8 e4m3 per-channel", None),
    "FP8_PB_WO": ("fp8 e4m3 block 128x128", (128, 128)),
    "MXFP8": ("mxfp8 e4m3 g32", (1, 32)),  # (its scales e8m0: `fp8.mx_scale`)
}


def modelopt_algo(qcfg: dict[str, Any]) -> str:
    """A ModelOpt config's `quant_algo`, upper-cased ("" for none: only its KV cache is quantized): at the
    top (config.json's `quantization_config`) or under `quantization` (`hf_quant_config.json`'s)."""
    inner = qcfg.get("quantization")
    return str((inner if isinstance(inner, dict) else qcfg).get("quant_algo") or "").upper()


# ModelOpt's `quant_algo`s that hold NVFP4 weights (W4A16_NVFP4: the same weights, its activations float)
MODELOPT_NVFP4 = ("NVFP4", "W4A16_NVFP4")
# other names a config's `quant_method` gives a format (vLLM's names of its kernels for ModelOpt's,
# written into some exports' configs; Intel Neural Compressor's older one for AutoRound's)
CONFIG_ALIASES = {
    "modelopt_fp4": "modelopt",
    "modelopt_fp8": "modelopt",
    "modelopt_mxfp8": "modelopt",
    "intel/auto-round": "auto-round",
}


def config_method(qcfg: dict[str, Any]) -> str:
    """A quantization config's `quant_method`, lower-cased, its aliases (`CONFIG_ALIASES`) resolved."""
    method = str(qcfg.get("quant_method") or "").lower()
    return CONFIG_ALIASES.get(method, method)


def _modelopt(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """NVIDIA ModelOpt's FP8 (`nvidia/*-FP8`): e4m3 weights and a `weight_scale` per tensor (`FP8`, its
    static `input_scale` not read), per output row (`FP8_PER_CHANNEL_PER_TOKEN`) or per [128, 128] block
    (`FP8_PB_WO`, stored [row blocks, 1, column blocks, 1]; its activations rounded as every FP8 layer's,
    as vLLM runs it) or per 32 inputs, a power of two (`MXFP8`: uint8 e8m0 scales); NVFP4 (`nvidia/*-FP4`)
    on the weight-only path (`int4_layouts`). The rest are refused by name."""
    if online:
        raise _not_at_load("modelopt")
    algo = modelopt_algo(qcfg)
    if algo in MODELOPT_NVFP4:
        return _int4(qcfg)
    if algo not in MODELOPT_FP8:
        runs = ", ".join([*MODELOPT_FP8, *MODELOPT_NVFP4])
        raise QuantFormatError(
            f"quantization modelopt: quant_algo {algo or None!r} is not run (runs: {runs})"
        )
    weights, block = MODELOPT_FP8[algo]
    return QuantSpec("modelopt", "fp8", f"modelopt {weights}", weight_block=block, per_tensor=algo == "FP8")


def _fbgemm_fp8(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """`quant_method: fbgemm_fp8` (Meta's `Llama-3.1-405B-Instruct-FP8`): e4m3 weights with a
    `weight_scale` per output row; activations quantized per token at run time, as every FP8 layer's (its
    `activation_scale_ub`, a bound on a token's scale, and any `input_scale_ub` tensor are not used)."""
    if online:
        raise _not_at_load("fbgemm_fp8")
    return QuantSpec("fbgemm_fp8", "fp8", "fbgemm fp8 e4m3 per-channel")


def _bitsandbytes(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """`quant_method: bitsandbytes`: `load_in_8bit` (LLM.int8's int8 weights, a scale per row) kept
    quantized as w8a16 (`int4_layouts`); `load_in_4bit` (NF4/FP4 codebooks) dequantized as it is read,
    then kept in 4 bits where a kernel takes them (`gapless.model.quant.bnb.kept`); `online` (a float
    checkpoint, vLLM's in-flight 4-bit): NF4 in blocks of 64, quantized at load (`bnb`'s docstring)."""
    if online:
        label = "bitsandbytes nf4 (quantized at load)"
        return QuantSpec("bitsandbytes", "bnb", label, online=True, min_capability=(0, 0), codebook="nf4")
    if qcfg.get("load_in_8bit") or qcfg.get("_load_in_8bit"):
        return _int4(qcfg)
    if not (qcfg.get("load_in_4bit") or qcfg.get("_load_in_4bit")):
        raise QuantFormatError("quantization bitsandbytes: neither load_in_4bit nor load_in_8bit is set")
    kind = str(qcfg.get("bnb_4bit_quant_type") or "fp4").lower()
    if kind not in ("nf4", "fp4"):
        raise QuantFormatError(
            f"quantization bitsandbytes: bnb_4bit_quant_type {kind!r} is not read; nf4 or fp4"
        )
    return QuantSpec("bitsandbytes", "bnb", f"bitsandbytes {kind}", min_capability=(0, 0), codebook=kind)


def _rtn(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """`--quantization rtn` (vLLM's, SGLang's): a float checkpoint rounded to int8 or int4 at load
    (`gapless.model.quant.rtn`: its bits and group from vLLM's `RTN_NUM_BITS`, `RTN_GROUP_SIZE`)."""
    from gapless.model.quant import rtn

    if not online:
        raise QuantFormatError("quantization rtn in a config: rtn quantizes a float checkpoint at load alone")
    bits, group = rtn.settings()
    label = f"rtn w{bits}a16 {'channel' if group < 0 else f'g{group}'} (quantized at load)"
    return QuantSpec("rtn", "rtn", label, online=True, min_capability=(8, 0), rtn=(bits, group))


def _experts_int8(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """`--quantization experts_int8` (vLLM's): a float checkpoint's mixture experts rounded to int8 per row
    at load (`gapless.model.quant.rtn`)."""
    if not online:
        raise QuantFormatError(
            "quantization experts_int8 in a config: it rounds a float checkpoint at load alone"
        )
    label = "experts_int8 w8a16 channel (quantized at load)"
    return QuantSpec("experts_int8", "rtn", label, online=True, min_capability=(8, 0), rtn=(8, -1))


def _quark(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    """AMD Quark's checkpoints: FP8 W8A8 (and its FP8 KV cache's scales), int8, int4 and MXFP4 weights
    (`gapless.model.quant.quark_configs`)."""
    from gapless.model.quant import quark_configs

    if online:
        raise _not_at_load("quark")
    return quark_configs.spec(qcfg)


# compressed-tensors' own `format` -> its parser (the quantization_config and its one config group)
CT_FORMATS: dict[str, Callable[[dict[str, Any], dict[str, Any]], QuantSpec]] = {
    "float-quantized": _ct_float,
    "mxfp8-quantized": _ct_float,  # (e4m3 in groups of 32, e8m0 scales: `fp8.mx_scale`)
    "pack-quantized": lambda qcfg, group: _int4(qcfg),
    "int-quantized": lambda qcfg, group: _int4(qcfg),  # (W8A8 INT8, run as w8a16: `int4_layouts`)
    "nvfp4-pack-quantized": lambda qcfg, group: _int4(qcfg),  # (NVFP4, run as w4a16: `int4_layouts`)
    "mxfp4-pack-quantized": lambda qcfg, group: _int4(qcfg),  # (MXFP4, likewise)
}


def _compressed_tensors(qcfg: dict[str, Any], online: bool) -> QuantSpec:
    if online:
        raise _not_at_load("compressed-tensors")
    fmt = qcfg.get("format")
    if fmt not in CT_FORMATS:
        raise QuantFormatError(
            f"quantization compressed-tensors: format {fmt!r} is not run (runs: {', '.join(CT_FORMATS)})"
        )
    groups = list((qcfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantFormatError(
            f"quantization compressed-tensors: {len(groups)} config groups "
            "(one is run: a scheme for every layer)"
        )
    if qcfg.get("sparsity_config"):
        raise QuantFormatError("quantization compressed-tensors: sparsity_config is not run")
    return CT_FORMATS[fmt](qcfg, groups[0])


# `quant_method` (or `--quantization`) -> its parser; the one place a new format is added
FORMATS: dict[str, Parser] = {
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
    "awq": _int4,
    "gptq": _int4,
    "modelopt": _modelopt,
    "fbgemm_fp8": _fbgemm_fp8,
    "bitsandbytes": _bitsandbytes,
    "auto-round": _int4,
    "rtn": _rtn,
    "experts_int8": _experts_int8,
    "quark": _quark,
}
# vLLM's `--quantization` names for its own kernels of a checkpoint's format: accepted for a checkpoint in
# one of those formats, which then runs as it would without the flag
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "awq_marlin": ("awq",),
    "awq_triton": ("awq",),
    "gptq_marlin": ("gptq",),
    "gptq_bitblas": ("gptq",),
    "moe_wna16": ("awq", "gptq"),
    "ipex": ("awq", "gptq"),  # (Intel's kernels for both on its CPUs and GPUs)
    "modelopt_fp4": ("modelopt",),
    "modelopt_mxfp8": ("modelopt",),
    "inc": ("auto-round",),
}


# SGLang's `--quantization` names for its kernels -> (what it runs: an FP8 checkpoint, or compressed-tensors'
# int8 W8A8, run as they are; the format a float checkpoint is quantized to at load, None: none)
SGLANG_FLAGS: dict[str, tuple[str, str | None]] = {"w8a8_fp8": ("fp8", "fp8"), "w8a8_int8": ("int8", None)}


def _sglang_flag(qcfg: dict[str, Any] | None, flag: str, device: torch.device | str) -> QuantSpec:
    """`--quantization w8a8_fp8` or `w8a8_int8` (`SGLANG_FLAGS`): the checkpoint's own format where it is
    the one the flag names; a float checkpoint quantized at load where SGLang does so (w8a8_fp8: FP8 per
    output row, as `fp8`); else a one-line QuantFormatError."""
    kind, at_load = SGLANG_FLAGS[flag]
    runs = (
        "an FP8 checkpoint" if kind == "fp8" else "an int8 W8A8 checkpoint (compressed-tensors int-quantized)"
    )
    if qcfg is None:
        if at_load is None:
            raise QuantFormatError(f"--quantization {flag} runs {runs}; the checkpoint is float")
        spec = resolve(None, at_load, device)
        assert spec is not None
        return spec
    spec = resolve(qcfg, None, device)
    assert spec is not None
    int8 = spec.name == "compressed-tensors" and spec.weight_only is not None and spec.weight_only.bits == 8
    if (spec.scheme == "fp8") if kind == "fp8" else int8:
        return spec
    raise QuantFormatError(f"--quantization {flag} runs {runs}; the checkpoint is {spec.label}")


GGUF = "gguf"  # vLLM's `--quantization` name for a GGUF file's own format


def check_gguf_flag(flag: str | None) -> None:
    """Refuse `--quantization` for a GGUF file, but vLLM's `gguf` (the file's own format, a no-op here:
    its quantized matrices are read as the file stores them, `gapless.model.gguf`)."""
    if flag not in (None, GGUF):
        raise QuantFormatError(
            f"--quantization {flag} applies to a safetensors checkpoint, not a GGUF file (its format: gguf)"
        )


def resolve(qcfg: dict[str, Any] | None, flag: str | None, device: torch.device | str) -> QuantSpec | None:
    """The format a load runs: the checkpoint's (`qcfg`), or `flag` applied at load to a float checkpoint;
    None: float weights. QuantFormatError (one line) for an unknown format, a flag that contradicts the
    checkpoint, a malformed config, or a device that cannot run it."""
    if flag in SGLANG_FLAGS:
        return _sglang_flag(qcfg, flag, device)
    method = None if qcfg is None else config_method(qcfg)
    if flag == GGUF:
        raise QuantFormatError(
            "--quantization gguf names a GGUF file's format; this checkpoint is no GGUF file"
        )
    if qcfg is not None and method not in FORMATS:
        raise QuantFormatError(
            f"quantization {method or '(no quant_method)'!r} in config.json is not run; "
            f"runs: {', '.join(FORMATS)}"
        )
    if flag is not None and flag not in FORMATS and flag not in FLAG_ALIASES:
        raise QuantFormatError(
            f"--quantization {flag!r} is not a known format; formats: {', '.join(FORMATS)} "
            f"(and vLLM's and SGLang's kernel names {', '.join([*FLAG_ALIASES, *SGLANG_FLAGS])} for their "
            "checkpoints)"
        )
    if flag in FLAG_ALIASES:
        if method not in FLAG_ALIASES[flag]:
            raise QuantFormatError(
                f"--quantization {flag} runs a {' or '.join(FLAG_ALIASES[flag])} checkpoint; "
                f"the checkpoint is {f'quantized as {method}' if method else 'float'}"
            )
        flag = method
    if qcfg is not None and flag is not None and flag != method:
        raise QuantFormatError(f"--quantization {flag} but the checkpoint is quantized as {method}")
    if qcfg is None and flag is None:
        return None
    if qcfg is not None and method:
        try:
            spec = FORMATS[method](qcfg, False)
        except (TypeError, AttributeError, KeyError, IndexError, AssertionError) as e:
            # a config's field of another JSON type than its format's (a string for a list, a number for
            # an object, null): the parsers take the types the writers write, and this names the rest
            what = f"{type(e).__name__}: {e}"
            raise QuantFormatError(f"quantization {method}: malformed config ({what})") from None
    else:
        spec = FORMATS[str(flag)]({"quant_method": flag}, True)
    check_device(spec, device)
    return spec


def check_kv_cache(name: str, device: torch.device | str) -> None:
    """Refuse `--kv-cache-dtype` fp8 (e4m3) on a CUDA device older than sm_89, whose Triton has no e4m3 to
    read or store the cache with (`auto` there keeps the model's dtype: `declared.checkpoint_kv_cache`;
    fp8_e5m2 runs there). fp8_e5m2 asked for where e4m3 runs is taken, with a warning that e4m3 is the
    more accurate of the two."""
    if name not in FP8_KV_CACHE_DTYPES:
        return
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if name == E5M2_KV_CACHE_DTYPE:
        if tuple(cap) >= FP8_MIN_CAPABILITY:
            log.warning(
                "--kv-cache-dtype fp8_e5m2 on sm_%d%d: fp8 (e4m3) runs here too, the same bytes with one "
                "more mantissa bit (docs/serving.md#fp8-kv-cache)",
                *cap,
            )
        return
    if tuple(cap) < FP8_MIN_CAPABILITY:
        raise QuantFormatError(
            f"--kv-cache-dtype {name} needs a GPU of sm_89 or newer (Triton's e4m3); "
            f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}: use fp8_e5m2 or auto"
        )


def check_device(spec: QuantSpec, device: torch.device | str) -> None:
    """Refuse `spec` on a CUDA device older than its kernels need (the CPU runs a reference path)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < spec.min_capability:
        need = "sm_{}{}".format(*spec.min_capability)
        raise QuantFormatError(
            f"quantization {spec.name} ({spec.label}) needs a GPU of {need} or newer; "
            f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}"
        )
