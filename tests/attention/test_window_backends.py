"""Which backend a model with sliding windows or soft-capping (Gemma 2 and 3) gets: the Triton kernels
have both (tests/attention/test_triton.py checks them against the reference), so "triton" takes such a
model and "auto" checks the kernels on the model's own window and cap at start-up, as for any model."""

from __future__ import annotations

import torch

from gapless.attention import Probe, make_backend
from gapless.attention.selfcheck import disagreement
from gapless.testing.triton import import_kernels_or_skip

tk = import_kernels_or_skip("gapless.attention.triton_kernels")

from gapless.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_triton_takes_windowed_and_capped_models():
    probe = Probe(4, 2, 16, torch.float32, window=24, softcap=4.0)
    assert isinstance(make_backend("triton", DEVICE, probe), TritonBackend)


def test_the_start_up_check_runs_the_models_window_and_cap():
    """ "auto"'s start-up check passes the probe's window and cap to both backends: the kernels agree with
    the reference on them, and a backend that ignored them would be caught."""
    probe = Probe(4, 2, 16, torch.float32, window=24, softcap=4.0)
    assert disagreement(TritonBackend(), probe, DEVICE) is None

    class Ignores(TritonBackend):
        def forward(self, q, k_cache, v_cache, state, scale, window=None, softcap=None):
            return super().forward(q, k_cache, v_cache, state, scale)

    assert "relative error" in disagreement(Ignores(), probe, DEVICE)
