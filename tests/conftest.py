"""Shared fixtures: tiny random-weight checkpoints (made here, never downloaded) and their HF references."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread; more threads only add synchronisation (and contend in CI)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
