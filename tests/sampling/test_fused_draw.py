"""The fused seeded draw (`gapless.sampling.triton_gumbel`: temperature, Gumbel noise and argmax in one
Triton kernel) against the torch path (`gapless.sampling.sampler.gumbel_argmax`), under Triton's
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET before anything imports Triton): the same
tokens for the same seeds, in fp32/bf16/fp16, odd vocabularies, several programs a row, greedy rows, empty
batches; and how `gapless.sampling.fused.draw_kernel` chooses it."""

from __future__ import annotations

import logging

import pytest
import torch

from gapless.sampling import sampler as sampler_mod
from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams
from gapless.testing.triton import import_kernels_or_skip

tg = import_kernels_or_skip("gapless.sampling.triton_gumbel")

from gapless.sampling import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _draws(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, step: int, scale: bool):
    keys = sampler_mod._row_keys(seeds, torch.full_like(seeds, step))
    hashes = sampler_mod._bits_as_int32(sampler_mod._column_hashes(logits.shape[1], logits.device))
    want = sampler_mod.gumbel_argmax(logits, temperature, keys, hashes, scale)
    got = tg.gumbel_argmax(logits, temperature, sampler_mod._bits_as_int32(keys), scale)
    return got, want


@pytest.mark.parametrize(
    ("dtype", "vocab"),
    [
        (torch.float32, 1),
        (torch.float32, 37),
        (torch.float16, 37),
        (torch.bfloat16, 37),
        (torch.bfloat16, 2500),
    ],
)
def test_fused_draw_is_the_torch_draw(dtype: torch.dtype, vocab: int) -> None:
    """Scaled by the kernel and already scaled; greedy rows (temperature 0) and an all -inf row among
    sampled ones; 2500 columns make several programs a row (the second stage picks among them)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 3).to(device=DEVICE, dtype=dtype)
    logits[5] = float("-inf")
    temperature = torch.tensor([0.7, 0.0, 1.3, 1.0, 2.5, 1.0], device=DEVICE)
    seeds = torch.tensor([1, 2, 3, -5, 2**40, 9], device=DEVICE)
    for step in range(2):
        for scale in (True, False):
            x = logits if scale else logits.float() / temperature.masked_fill(temperature == 0, 1)[:, None]
            got, want = _draws(x, temperature, seeds, step, scale)
            assert got.dtype == torch.int64 and torch.equal(got, want), (step, scale)


def test_fused_draw_orders_the_noise_as_torch_does() -> None:
    """Flat logits: each token is the argmax of the noise alone, so 24 rows x 2 steps of equal tokens
    check the hash and the noise column by column, across program boundaries; and an empty batch."""
    vocab = 3000
    seeds = torch.arange(24, device=DEVICE) * 7919 - 100
    flat = torch.zeros(24, vocab, device=DEVICE)
    temperature = torch.ones(24, device=DEVICE)
    for step in range(2):
        got, want = _draws(flat, temperature, seeds, step, True)
        assert torch.equal(got, want)
    assert len(set(want.tolist())) > 20  # the draws spread over the vocabulary
    empty = tg.gumbel_argmax(flat[:0], temperature[:0], seeds[:0].int(), True)
    assert empty.shape == (0,) and empty.dtype == torch.int64


PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.2, top_k=40),
    SamplingParams(temperature=0.6, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
]


@pytest.mark.parametrize("rows", [[0, 1], [0, 1, 2, 3, 4]], ids=["no-filters", "filters"])
def test_sampler_draws_the_same_tokens_with_the_kernel(rows: list[int]) -> None:
    """A Sampler with the fused draw gives the torch Sampler's tokens, seeded rows over many steps, with
    and without filters (the kernel then scales the logits itself, reading them in their bf16)."""
    vocab = 1500
    params = [PARAMS[i].resolved() for i in rows]
    logits = (torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(2)) * 2).to(DEVICE)
    logits = logits.to(torch.bfloat16)
    plain, with_kernel = Sampler(vocab, 8, DEVICE), Sampler(vocab, 8, DEVICE)
    with_kernel.draw_kernel = fused.draw_kernel("triton", vocab, DEVICE)
    assert with_kernel.draw_kernel is not None
    for step in range(8):
        n = len(rows)
        batch = SamplingBatch.build(
            params, [step] * n, list(range(n)), [11 * i for i in range(n)], DEVICE, vocab
        )
        assert torch.equal(with_kernel.sample(logits, batch), plain.sample(logits, batch))


def test_draw_kernel_choice(caplog: pytest.LogCaptureFixture) -> None:
    """'torch' and 'auto' off CUDA: torch ops; 'triton': the kernel (on CUDA, or the CPU under the
    interpreter); the start-up check passes the kernel and refuses one that draws other tokens or fails,
    and 'auto' on CUDA then falls back to torch with the reason."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="fused_kernels='fast': must be one of"):
        fused.draw_kernel("fast", 100, cpu)
    assert fused.draw_kernel("torch", 100, cpu) is None
    assert fused.draw_kernel("auto", 100, cpu) is None
    kernel = fused.draw_kernel("triton", 100, DEVICE)
    assert kernel is not None and fused.disagreement(kernel, 100, DEVICE) is None
    wrong = lambda logits, *_: torch.zeros(logits.shape[0], dtype=torch.int64)  # noqa: E731
    assert "drew [0, 0, 0, 0]" in fused.disagreement(wrong, 100, cpu)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no kernel image")

    assert "failed: RuntimeError: no kernel image" in fused.disagreement(broken, 100, cpu)
    # on CUDA, "auto" runs the check and falls back to torch, saying why
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        mp.setattr(fused, "disagreement", lambda *_: "the Triton draw drew [1], torch [2] at step 0")
        assert fused.draw_kernel("auto", 100, torch.device("cuda")) is None
    assert "fused sampling: the Triton draw drew [1], torch [2] at step 0; using torch" in caplog.text
