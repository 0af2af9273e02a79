"""Checks on a quantized checkpoint's tensors as the loader reads them, whatever the format: every scale
finite (a NaN or infinite scale makes its whole group's outputs NaN), one spelling of a layer's fp8 weight
scale (`weight_scale_inv` is read as `weight_scale`: a layer holding both would keep whichever came last),
and an fp8 tensor only where its parameter holds that type (a cast would change its codes or drop its
scale)."""

from __future__ import annotations

import torch

from gapless.memory.kv_pool import FP8_DTYPES
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.fp8 import SCALE_NAMES

# a tensor's last name part that makes it a weight's scale: AWQ/GPTQ's, fp8's and compressed-tensors',
# NVFP4's per-tensor ones, bitsandbytes 8-bit's; (k/v cache scales: `gapless.model.kv_scales`)
SCALES = frozenset({"scales", *SCALE_NAMES, "weight_scale_2", "weight_global_scale", "SCB"})


class ScaleCheck:
    """Called on each checkpoint tensor (name, value) as it is read; refuses a bad scale in one line (a
    GGUF file's blocks, not tensors, are let through)."""

    def __init__(self) -> None:
        self.spelled: dict[str, str] = {}  # module -> the spelling of its fp8 weight scale read first

    def __call__(self, name: str, tensor: object) -> None:
        module, _, last = name.rpartition(".")
        if last not in SCALES or not isinstance(tensor, torch.Tensor):
            return
        if last in SCALE_NAMES:
            first = self.spelled.setdefault(module, last)
            if first != last:
                raise QuantFormatError(
                    f"checkpoint module {module!r} has both {first} and {last}: one weight scale is read"
                )
        if tensor.is_floating_point():
            values = tensor.float() if tensor.element_size() == 1 else tensor  # (isfinite takes no float8)
            bad = ~torch.isfinite(values)
            if bool(bad.any()):
                count, first_bad = int(bad.sum()), values[bad][0].item()
                raise QuantFormatError(
                    f"checkpoint scale {name!r} holds {count} non-finite value(s) ({first_bad}); "
                    "a scale must be finite"
                )


def check_fp8_dtype(name: str, dtype: torch.dtype, param: torch.dtype) -> None:
    """Refuse checkpoint tensor `name` of `dtype` for a parameter of type `param` where either is fp8 and
    they differ: an e4m3 weight into a float layer (no fp8 format declared for it, or its scale missing),
    an e5m2 one, an fp8 scale read as floats, or a float weight into an fp8 layer (cast to e4m3, it would
    lose its scale: ~1/scale off)."""
    if dtype == param or (dtype not in FP8_DTYPES and param not in FP8_DTYPES):
        return
    given, held = (str(t).removeprefix("torch.") for t in (dtype, param))
    if dtype not in FP8_DTYPES:  # (as the loader cast it: not necessarily the checkpoint's own type)
        raise QuantFormatError(
            f"checkpoint weight {name!r} is floats, but its layer holds e4m3 codes under a scale, and a "
            "float weight is not cast into them"
        )
    if param in FP8_DTYPES:
        why = "fp8 layers hold e4m3 (e5m2 weights are not run)"
    elif name.endswith("_scale"):
        why = f"this scale is read as {held}"
    else:
        why = "its layer is not fp8: the checkpoint declares no fp8 format for it, or lacks its scale"
    raise QuantFormatError(f"checkpoint weight {name!r} is {given}, but {why}")
