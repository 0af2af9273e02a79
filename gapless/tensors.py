"""Moving host-built batches to the device (or across a pipe) without a host sync."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without blocking the host: from pinned memory on CUDA."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def map_tensors(obj: T, fn: Callable[[Any], Any], kind: type = torch.Tensor) -> T:
    """A copy of a dataclass with `fn` applied to every field of type `kind`, also inside nested
    dataclasses and tuples."""

    def conv(v: Any) -> Any:
        if isinstance(v, kind):
            return fn(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return map_tensors(v, fn, kind)
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        return v

    return dataclasses.replace(obj, **{f.name: conv(getattr(obj, f.name)) for f in dataclasses.fields(obj)})  # type: ignore[arg-type]


def packed(*parts: torch.Tensor) -> list[torch.Tensor]:
    """1-D tensors of one dtype as views of one new buffer, so that `dataclass_to_device` moves them in
    one copy (and no view shares memory with the tensors it came from)."""
    return list(torch.cat(parts).split([p.shape[0] for p in parts]))


def dataclass_to_device(obj: T, device: torch.device) -> T:
    """A copy of a dataclass with its tensors on `device`, one copy per host buffer: tensors that are
    views of one small buffer (see `packed`) are moved as that buffer and come back as the same views of
    the device's copy. A view of a buffer much larger than itself is moved alone."""
    tensors: list[torch.Tensor] = []
    map_tensors(obj, lambda t: tensors.append(t))
    viewed: dict[int, int] = {}  # storage -> bytes its tensors here view
    for t in tensors:
        if t.device != device:
            key = t.untyped_storage().data_ptr()
            viewed[key] = viewed.get(key, 0) + t.numel() * t.element_size()
    moved: dict[int, torch.UntypedStorage] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() > viewed[key] + _SLACK_BYTES:
            return to_device(t, device)
        if key not in moved:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            moved[key] = to_device(whole, device).untyped_storage()
        out = torch.empty(0, dtype=t.dtype, device=device)
        return out.set_(moved[key], t.storage_offset(), t.shape, t.stride())

    return map_tensors(obj, move)


_SLACK_BYTES = 4096  # a buffer this much larger than the views of it still moves whole


def to_numpy(obj: T) -> T:
    """For a pipe: numpy arrays pickle as raw bytes, torch tensors through a much slower path."""
    return map_tensors(obj, lambda t: t.numpy())


def from_numpy(obj: T) -> T:
    return map_tensors(obj, torch.from_numpy, kind=np.ndarray)
