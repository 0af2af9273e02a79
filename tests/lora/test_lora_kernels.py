"""The gathered LoRA kernels equal the torch path (segmented by slot) on rows of several adapters and of
the base model (slot -1), under Triton's interpreter here. That they compile for an H100 (sm_90) without a
GPU is tests/testing/test_triton_compile.py's (`gapless.testing.triton_compile` launches them)."""

from __future__ import annotations

import pytest
import torch

from gapless.lora.ops import add_lora_torch, segments

triton = pytest.importorskip("triton", reason="the kernels are Triton's")


def _case(dtype: torch.dtype, t: int = 7, k: int = 80, r: int = 24, n: int = 72, slots: int = 3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(slots, r, k, generator=g) * 0.2).to(dtype)
    b = (torch.randn(slots, n, r, generator=g) * 0.2).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    idx = torch.tensor([2, -1, 0, 0, 1, -1, 2][:t], dtype=torch.int64)
    return y, x, a, b, idx


@pytest.mark.parametrize(
    "dtype, k",
    [(torch.float32, 80), (torch.bfloat16, 80), (torch.float32, 600)],  # 600: three shrink splits, one cut
)
def test_kernel_equals_torch(dtype, k):
    from gapless.lora import triton_kernels

    if not torch.cuda.is_available() and not triton_kernels.interpreted():
        pytest.skip("no GPU and TRITON_INTERPRET unset")
    assert (k > 2 * triton_kernels.SPLIT_K) == (k == 600)
    y, x, a, b, idx = _case(dtype, k=k)
    want = add_lora_torch(y.float().clone(), x.float(), a.float(), b.float(), segments(idx))
    dev = "cpu" if triton_kernels.interpreted() else "cuda"
    got = triton_kernels.add_lora(*(t.to(dev) for t in (y.clone(), x, a, b, idx))).cpu()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    base_rows = idx < 0
    assert torch.equal(got[base_rows], y[base_rows])  # slot -1: the base output, untouched
    assert not torch.allclose(got[~base_rows].float(), y[~base_rows].float())


@pytest.mark.parametrize(
    "slots, layout",
    [
        ([1] * 7, (True, False, False)),  # one adapter: its rows are the grid, expanded into y in place
        ([2, -1, 0, 0, 1, -1, 2], (False, True, False)),  # gathered, uneven runs on a padded grid
        ([0, 1, 2, 3], (True, False, False)),  # a decode of one row per adapter: no copy
        ([-1, -1, 0, 2, 2, -1], (True, True, False)),  # consecutive rows, uneven runs
        ([2, 1, 0, -1], (False, False, False)),  # gathered, even runs
        ([0] * 12 + [1, 2], (True, True, True)),  # too uneven for the grid: a GEMM pair per adapter
    ],
)
def test_torch_path_equals_token_by_token(slots, layout):
    """Every layout of the torch path adds, for each adapter token, B[s] A[s] x, and nothing to the base
    model's rows; consecutive slots are a view of the table, others a gather."""
    t = len(slots)
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(t, 80, generator=g), torch.randn(t, 72, generator=g)
    a, b = torch.randn(4, 24, 80, generator=g) * 0.2, torch.randn(4, 72, 24, generator=g) * 0.2
    idx = torch.tensor(slots)
    seg = segments(idx)
    assert seg is not None and (seg.order is None, seg.grid is not None, seg.uneven) == layout
    want = y.clone()
    for i, s in enumerate(slots):  # token by token
        if s >= 0:
            want[i] += b[s] @ (a[s] @ x[i])
    torch.testing.assert_close(add_lora_torch(y.clone(), x, a, b, seg), want, rtol=1e-5, atol=1e-5)
    assert segments(torch.full((3,), -1, dtype=torch.int64)) is None
    gaps = segments(torch.tensor([0, 3, -1]))
    assert gaps is not None and isinstance(gaps.slots, torch.Tensor)  # slots 0 and 3: a gather
    assert gaps.slots.tolist() == [0, 3]


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, -1, 0, 0, 1, -1, 2], [3, 1], [1] * 5])
def test_block_diagonal_expand_equals_the_whole(slots):
    """A fused layer's B while block-diagonal (rank block j writes only its shard's rows), each block's
    B stored apart: expanding each block alone adds what the whole B does."""
    from gapless.lora.ops import Block

    t, r, shards = len(slots), 8, [(0, 40), (40, 16), (56, 16)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(t, 32, generator=g), torch.randn(t, 72, generator=g)
    a, b = torch.randn(4, 3 * r, 32, generator=g), torch.zeros(4, 72, 3 * r)
    blocks = [Block(off, n, torch.randn(4, n, r, generator=g)) for off, n in shards]
    for j, blk in enumerate(blocks):
        b[:, blk.row : blk.row + blk.rows, j * r : (j + 1) * r] = blk.b
    seg = segments(torch.tensor(slots))
    assert seg is not None
    want = add_lora_torch(y.clone(), x, a, b, seg)
    torch.testing.assert_close(add_lora_torch(y.clone(), x, a, b, seg, blocks), want, rtol=1e-5, atol=1e-5)
