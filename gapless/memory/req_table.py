"""The request table: one row of slot ids per running request, the page table attention reads."""

from __future__ import annotations

import torch


class ReqTable:
    """``[max_rows, max_context]`` int32 slot ids, on the device and mirrored on the host.

    Two copies because of overlap: the scheduler runs ahead of the device, so it edits the host
    mirror freely (``write_host``), while the device table only changes through writes enqueued in
    stream order (``apply_writes``), never under a forward that is still reading it.
    """

    def __init__(self, max_rows: int, max_context: int, device: torch.device | str | None) -> None:
        """`device=None` keeps only the host mirror: the scheduler's copy when the device side (and its
        table) lives in another process."""
        if max_rows < 1 or max_context < 1:
            raise ValueError(f"need max_rows >= 1 and max_context >= 1, got {max_rows}, {max_context}")
        self.max_rows = max_rows
        self.max_context = max_context
        self.device = torch.device(device) if device is not None else None
        # Zero = slot 0 of the reserved page 0: an unwritten entry never points at live KV.
        self.device_table = (
            torch.zeros((max_rows, max_context), dtype=torch.int32, device=self.device)
            if device is not None
            else None
        )
        self.host_table = torch.zeros((max_rows, max_context), dtype=torch.int32)
        self._free_rows: list[int] = []
        self._is_free: list[bool] = []
        self.reset()

    def reset(self) -> None:
        """Mark every row free. Table contents are left as they are (rows are rewritten on reuse)."""
        self._free_rows = list(range(self.max_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._is_free = [True] * self.max_rows

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def is_free(self, row: int) -> bool:
        return self._is_free[row]

    def alloc(self) -> int | None:
        """A free row index, or None if every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        """Return ``row``; RuntimeError on a row that is out of range or already free."""
        if not 0 <= row < self.max_rows:
            raise RuntimeError(f"row {row} out of range [0, {self.max_rows})")
        if self._is_free[row]:
            raise RuntimeError(f"double free of request-table row {row}")
        self._is_free[row] = True
        self._free_rows.append(row)

    def write_host(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Host mirror: ``host_table[row, start:start + len(slots)] = slots``."""
        end = start + slots.numel()
        if end > self.max_context:
            raise ValueError(f"positions [{start}, {end}) exceed max_context {self.max_context}")
        self.host_table[row, start:end] = slots.reshape(-1).to(device="cpu", dtype=torch.int32)

    def apply_writes(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Device table: ``device_table[rows[i], positions[i]] = slots[i]`` for all i, as one scatter.

        The scheduler builds the three index tensors for a whole batch; the device side applies them in
        stream order, before the batch that needs them. Tensors already on the device are used as they
        are (no copy, no host sync).
        """
        assert self.device_table is not None, "a host-only request table (device=None) has no device table"
        rows = rows.to(self.device, torch.int64, non_blocking=True)
        positions = positions.to(self.device, torch.int64, non_blocking=True)
        slots = slots.to(self.device, torch.int32, non_blocking=True)
        self.device_table.index_put_((rows, positions), slots)
