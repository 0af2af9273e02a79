"""Test modules of Triton kernels: they run on a GPU, or on the CPU under Triton's interpreter, which must
be switched on (`TRITON_INTERPRET=1`, set by tests/conftest.py) before the kernels are first imported."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_kernels_or_skip(module: str) -> ModuleType:
    """Import the kernel module named `module` (one with an `INTERPRET` flag), or skip the calling test
    module, with the reason, where its kernels cannot run here: triton missing, or no GPU and the kernels
    built for one (imported before TRITON_INTERPRET was set)."""
    import pytest
    import torch

    pytest.importorskip("triton", reason="triton is not installed (or does not import here)")
    kernels = importlib.import_module(module)
    if not torch.cuda.is_available() and not kernels.INTERPRET:
        pytest.skip(
            f"{module} was imported before TRITON_INTERPRET was set, so its kernels cannot run on CPU",
            allow_module_level=True,
        )
    return kernels
