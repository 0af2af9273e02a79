"""Moving host-built batches to the device (or across a pipe) without a host sync, one buffer at a time.

The scheduler builds a batch's index vectors as views of one host buffer (`packed`); both ways a batch
leaves the host move each such buffer once, and the views come back as views of its copy: to a device,
one copy per buffer (`dataclass_to_device`); through the device process's pipe, one pickled array per
buffer (`dumps`). A view of a buffer much larger than itself moves alone (`_moves_whole`), so a slice of
a big table never drags the table along.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_SLACK_BYTES = 1 << 16
ALIGN_BYTES = 16  # where a batch's index vectors start in their buffer (`packed`)


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
    return dataclasses.replace(
        obj, **{f.name: _map_value(getattr(obj, f.name), fn, kind) for f in dataclasses.fields(obj)}
    )


def _map_value(v: Any, fn: Callable[[Any], Any], kind: type) -> Any:
    # (a module function, not a closure calling itself: that would be a reference cycle per call, keeping
    # `fn` and what it holds, such as the device copies of a batch, until the garbage collector runs)
    if isinstance(v, kind):
        return fn(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return map_tensors(v, fn, kind)
    if isinstance(v, tuple):
        return tuple(_map_value(x, fn, kind) for x in v)
    return v


def packed(*parts: torch.Tensor) -> list[torch.Tensor]:
    """1-D tensors of one dtype as views of one new buffer, so that the batch moves in one copy (and no
    view shares memory with the tensors it came from). Each view starts `ALIGN_BYTES`-aligned (the
    parts padded with zeros to a multiple of it): Triton compiles a kernel apart for each pattern of
    16-byte alignment among its pointers, so views at any offset would compile the batch's kernels
    again, mid-run, whenever the vectors' lengths fell a new way."""
    step = max(1, ALIGN_BYTES // parts[0].element_size())
    pad = torch.zeros(step - 1, dtype=parts[0].dtype, device=parts[0].device)
    sizes = [p.shape[0] for p in parts]
    tails = [-n % step for n in sizes]
    buf = torch.cat([x for p, t in zip(parts, tails) for x in (p, pad[:t])])
    chunks = buf.split([n + t for n, t in zip(sizes, tails)])
    return [c[:n] for c, n in zip(chunks, sizes)]


def _moves_whole(t: torch.Tensor) -> bool:
    """Whether `t` moves as (a view of) its whole buffer: unless the buffer is much larger than `t`."""
    return t.untyped_storage().nbytes() <= 16 * t.numel() * t.element_size() + _SLACK_BYTES


def _as_view(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """`t`'s view (dtype, offset, shape, strides) of `storage`, a copy of its own buffer."""
    out = torch.empty(0, dtype=t.dtype, device=storage.device)
    return out.set_(storage, t.storage_offset(), t.shape, t.stride())


def dataclass_to_device(obj: T, device: torch.device) -> T:
    """A copy of a dataclass with its tensors on `device`: one copy per host buffer (see the module)."""
    moved: dict[int, torch.UntypedStorage] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        # (a tensor already on the device may name it otherwise, `cuda:0` for `cuda`: `to` leaves it)
        if t.device == device or t.device.type != "cpu" or not _moves_whole(t):
            return to_device(t, device)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in moved:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            moved[key] = to_device(whole, device).untyped_storage()
        return _as_view(t, moved[key])

    return map_tensors(obj, move)


def _rebuild(buf: np.ndarray, dtype: torch.dtype, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
    """A tensor `dumps` wrote: a view of `buf`, the raw bytes of its buffer (shared by its other views)."""
    out = torch.empty(0, dtype=dtype)
    return out.set_(torch.from_numpy(buf).untyped_storage(), offset, shape, stride)


class _Pickler(pickle.Pickler):
    """Writes each CPU tensor as a view of its buffer's raw bytes, a numpy array that pickle memoizes, so
    a buffer shared by many views is written once (torch's own pickling would write each view's whole
    storage, through a much slower path)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._buffers: dict[int, np.ndarray] = {}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor or obj.device.type != "cpu":
            return NotImplemented
        if not _moves_whole(obj):
            obj = obj.clone()
        storage = obj.untyped_storage()
        key = storage.data_ptr()
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        return _rebuild, (buf, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())


def dumps(obj: object) -> bytes:
    """`pickle.dumps(obj)` for the device process's pipe, each tensor buffer written once."""
    f = io.BytesIO()
    _Pickler(f).dump(obj)
    return f.getvalue()
