"""Shared fixtures: tiny random-weight checkpoints (made here, never downloaded) and their HF references."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import torch

# Without a GPU, the Triton attention kernels run under Triton's interpreter. Triton picks interpreter or
# GPU mode for triton.language's own helpers when triton.language is first imported, and that happens as a
# side effect of importing transformers (so of gapless.testing, below, and of most test modules): the
# variable must be set before any of them loads. Importing torch alone does not load Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gapless.testing import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    made: dict[tuple, object] = {}

    def get(arch: str, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"{arch}-ckpt"), arch, **kw)
        return made[key]

    return get


@pytest.fixture
def int4_reference_path(monkeypatch):
    """int4/int8 weight-only layers on the CPU take the reference path (exact against the dequantized
    weights), not torch's CPU kernels that `auto` gives them, which round the activations to bfloat16
    (their parity: tests/model/test_int4_cpu.py); on CUDA the Triton GEMM."""
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")


@pytest.fixture
def int4_path(monkeypatch, int4_reference_path):
    """A CPU load of a GGUF file as a GPU's: every projection and expert on the int4/int8 path, exact
    against their dequantized weights (the reference path), the embedding table and head as floats."""
    from gapless.model import loader

    monkeypatch.setattr(loader, "gguf_kept", lambda path, device: "int4" if path.suffix == ".gguf" else "")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread; more threads only add synchronisation (and contend in CI)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: over ~10 s on 2 cores; `make test` leaves it out, `make test-slow` (CI) runs it"
    )
    config.addinivalue_line(
        "markers", "whole_gpu: sizes things from the GPU's free memory, so runs with no other test on the GPU"
    )


@contextlib.contextmanager
def _gpu_turn(root: Path, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock across pytest-xdist's workers: any number of tests share the GPU, a
    `whole_gpu` test has it alone. A writer holds the gate while it waits, so readers cannot starve it."""
    with open(root / "gpu.gate", "a") as gate, open(root / "gpu.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _share_the_gpu(request, tmp_path_factory):
    """On a GPU under pytest-xdist (`-n`), `whole_gpu` tests wait for the others and run alone; elsewhere
    (no GPU, or one process) nothing changes."""
    if not torch.cuda.is_available() or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    root = tmp_path_factory.getbasetemp().parent  # one folder every worker of the run shares
    with _gpu_turn(root, request.node.get_closest_marker("whole_gpu") is not None):
        yield
