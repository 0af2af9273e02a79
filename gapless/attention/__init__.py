"""Attention backends and `make_backend`, which picks one by name.

Nothing here imports Triton: the Triton backend loads it when it is made, so this package imports (and
the torch backend works) where Triton is missing.
"""

from __future__ import annotations

import logging

import torch

from gapless.attention.base import AttentionBackend, AttentionMetadata
from gapless.attention.selfcheck import Probe, disagreement
from gapless.attention.torch_ref import TorchRefBackend

log = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "Probe", "TorchRefBackend", "make_backend"]

BACKENDS = ("auto", "torch", "triton")


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:  # a broken install raises ImportError subclasses too
        return f"{type(e).__name__}: {e}"
    return None


def make_backend(name: str, device: torch.device | str, probe: Probe | None = None) -> AttentionBackend:
    """ "torch": the reference backend, any device. "triton": the Triton kernels; on CPU only under
    Triton's interpreter (TRITON_INTERPRET=1, slow, for tests). "auto": Triton on CUDA when it imports
    and, given the model's attention shapes (`probe`, with its sliding window and soft-cap if any), agrees
    with the reference on them at start-up; else torch, with a warning saying why."""
    device = torch.device(device)
    if name == "torch":
        return TorchRefBackend()
    if name == "auto":
        if device.type == "cuda" and _triton_import_error() is None:
            from gapless.attention.triton_backend import TritonBackend

            return checked(TritonBackend(), probe, device)
        return TorchRefBackend()
    if name == "triton":
        err = _triton_import_error()
        if err is not None:
            raise RuntimeError(
                f"attention backend 'triton' needs the triton package, which failed to import ({err})"
            )
        from gapless.attention.triton_backend import TritonBackend, interpret_requested

        if device.type == "cpu" and not interpret_requested():
            raise RuntimeError(
                "attention backend 'triton' runs on CUDA devices; on CPU it needs Triton's interpreter "
                "(set TRITON_INTERPRET=1 before start-up, slow, meant for tests) - or use 'torch'"
            )
        if device.type not in ("cuda", "cpu"):
            raise RuntimeError(f"attention backend 'triton' does not support device type {device.type!r}")
        backend = TritonBackend()
        if device.type == "cpu" and not backend.interpreted:
            raise RuntimeError(
                "attention backend 'triton': the kernels were imported before TRITON_INTERPRET was set, so "
                "they were built for the GPU; set it before gapless.attention.triton_kernels is imported"
            )
        return backend
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")


def checked(backend: AttentionBackend, probe: Probe | None, device: torch.device) -> AttentionBackend:
    """`backend` if it agrees with the reference on `probe`'s shapes (or there is no probe), else the
    reference backend."""
    why = disagreement(backend, probe, device) if probe is not None else None
    if why is None:
        return backend
    log.warning(
        "attention: %s does not work here (%s); using the torch reference", type(backend).__name__, why
    )
    return TorchRefBackend()
