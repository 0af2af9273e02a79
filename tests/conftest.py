"""Shared fixtures: tiny random-weight checkpoints (made here, never downloaded) and their HF references."""

from __future__ import annotations

import pytest

from gapless.testing import make_checkpoint


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
