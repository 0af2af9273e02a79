"""Checks on a quantized checkpoint's scale tensors as the loader reads them, whatever the format: every
value finite (a NaN or infinite scale makes its whole group's outputs NaN), and one spelling of a layer's
fp8 weight scale (`weight_scale_inv` is read as `weight_scale`: a layer holding both would keep whichever
came last)."""

from __future__ import annotations

import torch

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
