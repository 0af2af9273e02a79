"""Which backend a model with sliding windows or soft-capping (Gemma 2) gets: the Triton kernels lack
both, so "auto" keeps such a model on the torch reference and says why, "triton" refuses it by name, and
the Triton backend itself refuses to be asked for either rather than ignore it."""

from __future__ import annotations

import logging

import pytest
import torch

from gapless.attention import Probe, TorchRefBackend, make_backend

PLAIN = Probe(4, 2, 16, torch.float32)


@pytest.mark.parametrize(
    ("probe", "named"),
    [
        (Probe(4, 2, 16, torch.float32, window=24), "sliding window"),
        (Probe(4, 2, 16, torch.float32, softcap=50.0), "soft-capping"),
        (Probe(4, 2, 16, torch.float32, window=24, softcap=50.0), "sliding window and soft-capping"),
    ],
)
def test_auto_keeps_windowed_or_capped_models_on_the_reference(caplog, probe, named):
    # on a CUDA device "auto" would otherwise take the Triton kernels; the choice is made before any
    # CUDA call, so this runs without a GPU
    with caplog.at_level(logging.WARNING, logger="gapless.attention"):
        backend = make_backend("auto", "cuda", probe)
    assert isinstance(backend, TorchRefBackend)
    assert f"the model needs {named}, which the Triton kernels lack" in caplog.text
    assert probe.needs and not PLAIN.needs


def test_triton_refuses_windowed_models_and_forward_arguments():
    pytest.importorskip("triton", reason="triton is not installed (or does not import here)")
    with pytest.raises(RuntimeError, match="needs sliding window, which the Triton kernels lack"):
        make_backend("triton", "cpu", Probe(4, 2, 16, torch.float32, window=24))
    from gapless.attention.triton_backend import TritonBackend

    q = torch.zeros(1, 4, 16)
    for kw in ({"window": 8}, {"softcap": 2.0}):
        with pytest.raises(
            NotImplementedError, match="no sliding-window attention or attention soft-capping"
        ):
            TritonBackend().forward(q, q, q, None, 0.25, **kw)
