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


def dataclass_to_device(obj: T, device: torch.device) -> T:
    return map_tensors(obj, lambda t: to_device(t, device))


def to_numpy(obj: T) -> T:
    """For a pipe: numpy arrays pickle as raw bytes, torch tensors through a much slower path."""
    return map_tensors(obj, lambda t: t.numpy())


def from_numpy(obj: T) -> T:
    return map_tensors(obj, torch.from_numpy, kind=np.ndarray)
