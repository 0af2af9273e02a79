"""KVPool: slot ids index the per-layer buffers directly; store writes in place."""

import pytest
import torch

from gapless.memory.kv_pool import KVPool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_bytes_per_token() -> None:
    assert KVPool.bytes_per_token(2, 4, 8, torch.float16) == 2 * 2 * 4 * 8 * 2
    assert KVPool.bytes_per_token(3, 1, 64, torch.float32) == 2 * 3 * 64 * 4


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_and_zero_init(device: str) -> None:
    pool = KVPool(
        num_layers=3,
        num_pages=5,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        device=device,
    )
    assert len(pool.k) == len(pool.v) == 3 and pool.num_slots == 20
    for t in pool.k + pool.v:
        assert t.shape == (20, 2, 8) and t.dtype == torch.bfloat16 and t.device.type == device
        assert not bool(t.any())
    assert pool.k_buffer.nbytes + pool.v_buffer.nbytes == 20 * KVPool.bytes_per_token(3, 2, 8, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_store_writes_only_the_given_slots_of_one_layer(device: str) -> None:
    pool = KVPool(2, 4, 2, 2, 4, torch.float32, device)
    slots = torch.tensor([5, 2, 7], device=device)
    k = torch.randn(3, 2, 4, device=device)
    v = torch.randn(3, 2, 4, device=device)
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], v)
    assert torch.equal(pool.k_buffer[1, slots], k)  # the per-layer tensors are views of one buffer
    untouched = torch.ones(8, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert not bool(pool.k[1][untouched].any()) and not bool(pool.k[0].any()) and not bool(pool.v[0].any())


def test_store_casts_to_pool_dtype() -> None:
    pool = KVPool(1, 2, 2, 1, 2, torch.float16, "cpu")
    pool.store(0, torch.tensor([3]), torch.full((1, 1, 2), 1.5), torch.full((1, 1, 2), -2.0))
    assert pool.k[0][3].tolist() == [[1.5, 1.5]] and pool.v[0].dtype == torch.float16
