"""ReqTable: row management, host mirror, and the device scatter the engine enqueues."""

import pytest
import torch

from gapless.memory.req_table import ReqTable

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_row_alloc_free_and_double_free() -> None:
    t = ReqTable(max_rows=3, max_context=8, device="cpu")
    assert t.num_free == 3
    rows = [t.alloc(), t.alloc(), t.alloc()]
    assert rows == [0, 1, 2] and t.alloc() is None and t.num_free == 0
    assert not t.is_free(1)
    t.free(1)
    assert t.is_free(1) and t.num_free == 1
    with pytest.raises(RuntimeError, match="double free"):
        t.free(1)
    with pytest.raises(RuntimeError):
        t.free(3)
    assert t.alloc() == 1
    t.reset()
    assert t.num_free == 3 and all(t.is_free(r) for r in range(3))


def test_tables_start_zero_and_have_the_right_layout() -> None:
    t = ReqTable(2, 5, "cpu")
    for table in (t.host_table, t.device_table):
        assert table.shape == (2, 5) and table.dtype == torch.int32 and not bool(table.any())
    assert t.host_table.device.type == "cpu"


def test_write_host() -> None:
    t = ReqTable(2, 6, "cpu")
    t.write_host(1, 2, torch.tensor([9, 8, 7], dtype=torch.int64))
    assert t.host_table[1].tolist() == [0, 0, 9, 8, 7, 0]
    assert not bool(t.device_table.any())  # the mirror never touches the device table
    with pytest.raises(ValueError):
        t.write_host(0, 5, torch.tensor([1, 2]))


@pytest.mark.parametrize("device", DEVICES)
def test_apply_writes_scatters_into_the_device_table(device: str) -> None:
    t = ReqTable(3, 4, device)
    rows = torch.tensor([0, 2, 2, 1], device=device)
    positions = torch.tensor([3, 0, 1, 1], device=device)
    slots = torch.tensor([11, 12, 13, 14], device=device)
    t.apply_writes(rows, positions, slots)
    assert t.device_table.device.type == device
    assert t.device_table.cpu().tolist() == [[0, 0, 0, 11], [0, 14, 0, 0], [12, 13, 0, 0]]
    t.apply_writes(torch.tensor([0]), torch.tensor([0]), torch.tensor([5]))  # host tensors are moved
    assert int(t.device_table[0, 0]) == 5
    assert not bool(t.host_table.any())
