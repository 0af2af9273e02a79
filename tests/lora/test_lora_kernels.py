"""The gathered LoRA kernels equal the torch path (segmented by slot) on rows of several adapters and of
the base model (slot -1), under Triton's interpreter here. That they compile for an H100 (sm_90) without a
GPU is tests/testing/test_triton_compile.py's (`gapless.testing.triton_compile` launches them)."""

from __future__ import annotations

import pytest
import torch

from gapless.lora.ops import Segments, add_lora_torch, segments

triton = pytest.importorskip("triton", reason="the kernels are Triton's")


def _case(dtype: torch.dtype, t: int = 7, k: int = 80, r: int = 24, n: int = 72, slots: int = 3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(slots, r, k, generator=g) * 0.2).to(dtype)
    b = (torch.randn(slots, n, r, generator=g) * 0.2).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    idx = torch.tensor([2, -1, 0, 0, 1, -1, 2][:t], dtype=torch.int64)
    return y, x, a, b, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch(dtype):
    from gapless.lora import triton_kernels

    if not torch.cuda.is_available() and not triton_kernels.interpreted():
        pytest.skip("no GPU and TRITON_INTERPRET unset")
    y, x, a, b, idx = _case(dtype)
    want = add_lora_torch(y.float().clone(), x.float(), a.float(), b.float(), segments(idx))
    dev = "cpu" if triton_kernels.interpreted() else "cuda"
    got = triton_kernels.add_lora(*(t.to(dev) for t in (y.clone(), x, a, b, idx))).cpu()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    base_rows = idx < 0
    assert torch.equal(got[base_rows], y[base_rows])  # slot -1: the base output, untouched
    assert not torch.allclose(got[~base_rows].float(), y[~base_rows].float())


def test_torch_path_segments():
    y, x, a, b, idx = _case(torch.float32)
    same = segments(torch.full((7,), 1, dtype=torch.int64))
    assert same == Segments(None, [(1, 0, 7)])
    torch.testing.assert_close(add_lora_torch(y.clone(), x, a, b, same), y + (x @ a[1].t()) @ b[1].t())
    assert segments(torch.full((7,), -1, dtype=torch.int64)) is None
    mixed = segments(torch.tensor([2, -1, 2, 0]))
    assert mixed.order.tolist() == [3, 0, 2] and mixed.spans == [(0, 0, 1), (2, 1, 3)]
    want = y.clone()
    for t, s in enumerate(idx.tolist()):  # token by token
        if s >= 0:
            want[t] += b[s] @ (a[s] @ x[t])
    torch.testing.assert_close(add_lora_torch(y.clone(), x, a, b, segments(idx)), want)
