"""AMD Quark's checkpoints (`quant_method: quark`: AMD's `amd/*-FP8-KV` models, Quark's int8, int4 and
MXFP4 exports): the config read into the format gapless runs, or refused in one line naming what is not
run, as vLLM's Quark reader runs and refuses them.

A Quark config gives each linear layer a scheme: its `weight`, `input_tensors`, `output_tensors` and
`bias`, each a tensor's `dtype`, `qscheme` (per_tensor, per_channel, per_group), `group_size`,
`symmetric`, `is_dynamic`, `scale_format`. `global_quant_config` is every layer's, `layer_quant_config`
(by name pattern) and `layer_type_quant_config` (by module type) single layers'; `exclude` names the
layers left float (which gapless reads from the tensors themselves, as for every format). The
`export.kv_cache_group` projections' (`*k_proj`, `*v_proj`) `output_tensors` quantize the KV cache: fp8
e4m3 per tensor, its scales `k_proj.output_scale` / `v_proj.output_scale`, which `--kv-cache-dtype fp8`
takes (`gapless.model.kv_scales`). One scheme runs every quantized layer:

- **fp8_e4m3** weights per tensor or per output channel (`weight_scale` a scalar or [N]), fp8 activations
  (static per tensor or dynamic per token): the FP8 method, its activations rounded per token at run
  time (the static `input_scale` not read, as for every FP8 checkpoint);
- **int8** weights per tensor or per channel, symmetric (W8A8 int8; or weight-only): `weight` int8 [N, K],
  run as w8a16, as compressed-tensors' int-quantized;
- **uint4** (asymmetric, `weight_zero_point`) or **int4** (symmetric, two's complement values) weights per
  group or per channel, float activations: per group, AWQ's layout, `weight` int32 [K, N / 8] packed along
  N, `weight_scale` [K / G, N], `weight_zero_point` int32 [K / G, N / 8]; per channel, `weight` [N, K / 8]
  packed along K, `weight_scale` [N], `weight_zero_point` [N / 8]; `export.pack_method` "reorder"
  interleaves each word's 8 values as AWQ does, "order" keeps them in order;
- **fp4** (MXFP4) weights in groups of 32 with e8m0 scales: `weight` uint8 [N, K / 2] (the first code in
  the low nibble), `weight_scale` uint8 [N, K / 32]; run as w4a16 on the codebook GEMM, the checkpoint's
  activation scheme unused (as compressed-tensors' MXFP4).

Each was checked against Quark 0.13's own exports (`bench/experiments/quant_writers.py quark`).
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from gapless.model.quant.formats import QuantFormatError, QuantSpec
from gapless.model.quant.int4_layouts import MXFP4_GROUP, Int4Spec

QUARK = "quark"
PACK_METHODS = ("reorder", "order")
# what of a tensor's scheme decides how it is stored and run (not its observer, not its rounding method)
_KEYS = ("dtype", "qscheme", "ch_axis", "group_size", "symmetric", "is_dynamic", "scale_format")


def _refuse(what: str) -> QuantFormatError:
    return QuantFormatError(f"quantization quark: {what}")


def _tensor(config: Any) -> dict[str, Any] | None:
    """A tensor's scheme cut to `_KEYS` (None: the tensor is not quantized); a two-level scheme (a list:
    Quark's fp8-and-int4 weights, its NVFP4) refused by name."""
    if config is None:
        return None
    if isinstance(config, list):
        kinds = "+".join(str(c.get("dtype")) for c in config if isinstance(c, dict))
        raise _refuse(f"two-level tensor schemes ({kinds}) are not run")
    if not isinstance(config, dict):
        raise _refuse(f"a tensor scheme {config!r} is not a dict")
    return {k: config.get(k) for k in _KEYS}


def _layer_configs(qcfg: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Each layer scheme the config holds: (where it is, for errors; the layers it names, a name pattern
    or a module type, "" for the global one; the scheme)."""
    found = [("global_quant_config", "", qcfg.get("global_quant_config") or {})]
    for key in ("layer_quant_config", "layer_type_quant_config"):
        entries = qcfg.get(key) or {}
        if not isinstance(entries, dict):
            raise _refuse(f"{key} is not a dict of layer schemes")
        found += [(f"{key}[{name!r}]", str(name), cfg or {}) for name, cfg in entries.items()]
    return found


def _kv_cache_group(qcfg: dict[str, Any]) -> list[str]:
    export = qcfg.get("export") or {}
    group = export.get("kv_cache_group") or []
    if not isinstance(group, list):
        raise _refuse(f"export.kv_cache_group={group!r} is not a list of layer patterns")
    return [str(p) for p in group]


def _check_kv_cache(where: str, output: dict[str, Any] | None) -> None:
    """The KV cache's scheme (a kv_cache_group projection's `output_tensors`): fp8 e4m3 per tensor."""
    if output is None:
        raise _refuse(f"{where} is in export.kv_cache_group but quantizes no output (the KV cache)")
    if (output["dtype"], output["qscheme"]) != ("fp8_e4m3", "per_tensor"):
        raise _refuse(f"a KV cache in {output['dtype']} {output['qscheme']} is not run; fp8_e4m3 per_tensor")


def linear_scheme(qcfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(weight, input) of the one scheme every quantized linear layer runs, each cut to `_KEYS`; the KV
    cache's scheme checked. One line naming what is not run: layers in different schemes, quantized
    outputs (other than the KV cache's) or biases, dynamic weights, no layer quantized at all."""
    kv_group = _kv_cache_group(qcfg)
    schemes: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    for where, name, cfg in _layer_configs(qcfg):
        if not isinstance(cfg, dict):
            raise _refuse(f"{where} is not a dict of tensor schemes")
        weight, output = _tensor(cfg.get("weight")), _tensor(cfg.get("output_tensors"))
        if any(fnmatch.fnmatchcase(name, p) for p in kv_group):
            _check_kv_cache(where, output)
            output = None
        elif name.endswith("q_proj"):  # (Quark's fp8 attention rounds q too; gapless does not)
            output = None
        if output is not None or cfg.get("bias") is not None:
            raise _refuse(f"{where} quantizes the layer's {'output' if output else 'bias'}: not run")
        if weight is not None:  # (a layer scheme of float weights: those layers' tensors are float)
            scheme = (weight, _tensor(cfg.get("input_tensors")))
            schemes.setdefault(json.dumps(scheme, sort_keys=True), scheme)
    if len(schemes) != 1:
        kinds = ", ".join(sorted({f"{w['dtype']} {w['qscheme']}" for w, _ in schemes.values()}))
        what = (
            f"layers in {len(schemes)} schemes ({kinds})" if schemes else "no layer scheme quantizes weights"
        )
        raise _refuse(f"{what}; one scheme for every quantized layer is run")
    weight, act = next(iter(schemes.values()))
    if weight["is_dynamic"]:
        raise _refuse(f"dynamic {weight['dtype']} weights are not run")
    return weight, act


def spec(qcfg: dict[str, Any]) -> QuantSpec:
    """The format a Quark checkpoint runs as (the module's docstring)."""
    weight, act = linear_scheme(qcfg)
    dtype, qscheme = weight["dtype"], weight["qscheme"]
    if dtype == "fp8_e4m3":
        if qscheme not in ("per_tensor", "per_channel") or weight["ch_axis"] not in (None, 0):
            raise _refuse(f"fp8_e4m3 weights {qscheme} (ch_axis {weight['ch_axis']!r}) are not run")
        if act is None or act["dtype"] != "fp8_e4m3":
            got = "float" if act is None else act["dtype"]
            raise _refuse(f"fp8_e4m3 weights with {got} activations are not run (W8A8 fp8 only)")
        label = f"quark fp8 e4m3 {qscheme.replace('_', '-')}"
        return QuantSpec(QUARK, "fp8", label, per_tensor=qscheme == "per_tensor")
    weight_only = int4_spec(qcfg)
    return QuantSpec(QUARK, "int4", weight_only.label, min_capability=(8, 0), weight_only=weight_only)


def int4_spec(qcfg: dict[str, Any]) -> Int4Spec:
    """A Quark checkpoint's int8, int4 or MXFP4 weights as the weight-only path reads them."""
    from gapless.model.quant.int4_configs import check_bits_group

    weight, act = linear_scheme(qcfg)
    dtype, qscheme = weight["dtype"], weight["qscheme"]
    if dtype == "fp4":
        if (qscheme, weight["group_size"], weight["scale_format"]) != ("per_group", MXFP4_GROUP, "e8m0"):
            raise _refuse(
                f"fp4 weights {qscheme} of {weight['group_size']} with {weight['scale_format']} scales are "
                "not run; MXFP4 (per_group of 32, e8m0)"
            )
        return Int4Spec(QUARK, 4, MXFP4_GROUP, sym=True, codebook="mxfp4")
    if dtype == "int8":
        if qscheme not in ("per_tensor", "per_channel") or not weight["symmetric"]:
            sym = "symmetric" if weight["symmetric"] else "asymmetric"
            raise _refuse(f"int8 weights {qscheme} {sym} are not run; symmetric per_tensor or per_channel")
        if act is not None and act["dtype"] != "int8":
            raise _refuse(f"int8 weights with {act['dtype']} activations are not run")
        return Int4Spec(QUARK, 8, -1, sym=True, packed=False, per_tensor=qscheme == "per_tensor")
    if dtype not in ("uint4", "int4"):
        raise _refuse(f"weights in {dtype} are not run (fp8_e4m3, int8, uint4, int4, fp4)")
    if act is not None:
        raise _refuse(f"{dtype} weights with {act['dtype']} activations are not run (w4a16 only)")
    if weight["symmetric"] != (dtype == "int4"):
        sym = "symmetric" if weight["symmetric"] else "asymmetric"
        raise _refuse(f"{sym} {dtype} weights are not run (uint4 asymmetric, int4 symmetric)")
    if qscheme not in ("per_group", "per_channel"):
        raise _refuse(f"{dtype} weights {qscheme} are not run; per_group or per_channel")
    pack = (qcfg.get("export") or {}).get("pack_method", "reorder")
    if pack not in PACK_METHODS:
        raise _refuse(f"export.pack_method={pack!r} is not read; {' or '.join(PACK_METHODS)}")
    group_size = weight["group_size"] if qscheme == "per_group" else -1
    _, group = check_bits_group(QUARK, 4, group_size, (4,))
    return Int4Spec(QUARK, 4, group, sym=dtype == "int4", reorder=pack == "reorder")
