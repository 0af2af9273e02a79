"""The fused penalties (`gapless.sampling.triton_penalties`: repetition, frequency and presence in one
Triton kernel) against the torch path (`gapless.sampling.sampler.apply_penalties`), under Triton's
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET before anything imports Triton): the same bits
in fp32/bf16/fp16, rows in any order of the state, neutral rows beside penalised ones, vocabularies that are
not a multiple of the block, one row and none; the same seeded tokens through a Sampler; and how
`gapless.sampling.fused.penalty_kernel` chooses it."""

from __future__ import annotations

import logging

import pytest
import torch

from gapless.sampling import sampler as sampler_mod
from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams
from gapless.testing.triton import import_kernels_or_skip

tp = import_kernels_or_skip("gapless.sampling.triton_penalties")

from gapless.sampling import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_ROWS = 7
# (repetition, frequency, presence) per batch row: repetition only, frequency/presence only, all three,
# neutral, and a repetition below 1 (it favours tokens already seen) with a negative presence
PENALTIES = [(1.3, 0.0, 0.0), (1.0, 0.4, 0.7), (1.7, -0.3, 0.25), (1.0, 0.0, 0.0), (0.8, 0.5, -0.5)]


def _state(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (MAX_ROWS, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(MAX_ROWS, vocab, generator=g) < 0.3  # most tokens never sampled
    prompt_mask = torch.rand(MAX_ROWS, vocab, generator=g) < 0.2
    return counts.to(DEVICE), prompt_mask.to(DEVICE)


def _old_penalties(logits, counts, prompt_mask, rows, repetition, frequency, presence) -> torch.Tensor:
    """The penalties as the sampler computed them before (two float32 `torch.where` branches)."""
    logits = logits.float()
    counts = counts.index_select(0, rows)
    in_output = counts > 0
    seen = prompt_mask.index_select(0, rows).logical_or_(in_output)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * in_output
    return logits


def _args(batch_rows: list[int], vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    logits = (torch.randn(len(batch_rows), vocab, generator=g) * 5).to(device=DEVICE, dtype=dtype)
    if len(batch_rows) and vocab > 3:
        logits[0, :3] = torch.tensor([float("-inf"), 0.0, -0.0])  # masked, and both zeros
    counts, prompt_mask = _state(vocab, seed)
    chosen = [PENALTIES[i % len(PENALTIES)] for i in range(len(batch_rows))]
    rep, freq, pres = (torch.tensor([c[j] for c in chosen], device=DEVICE).reshape(-1) for j in range(3))
    rows = torch.tensor(batch_rows, dtype=torch.int64, device=DEVICE)
    return logits, counts, prompt_mask, rows, rep, freq, pres


@pytest.mark.parametrize(
    ("dtype", "vocab"),
    [
        (torch.float32, 37),
        (torch.bfloat16, 37),
        (torch.float16, 37),
        (torch.bfloat16, 2500),  # several blocks a row, the last one partial
        (torch.float32, 1),
    ],
)
def test_fused_penalties_are_the_torch_penalties(dtype: torch.dtype, vocab: int) -> None:
    """Bit for bit the torch path (and the old `torch.where` formula), rows in any order of the state,
    neutral rows unchanged; the input logits left as they are."""
    args = _args([5, 0, 3, 6, 2], vocab, dtype)
    before = args[0].clone()
    want = sampler_mod.apply_penalties(*args)
    got = tp.apply_penalties(*args)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(want, _old_penalties(*args))
    assert torch.equal(args[0], before)
    assert torch.equal(got[3], args[0][3].float())  # the neutral row
    if vocab > 3:
        assert not torch.equal(got[0], args[0][0].float()) and not torch.equal(got[2], args[0][2].float())
        assert torch.equal(got[0, 2].view(torch.int32), want[0, 2].view(torch.int32))  # -0.0 kept as -0.0


def test_fused_penalties_one_row_and_none() -> None:
    """One row (state row 4), a non-contiguous (sliced) logits tensor, and an empty batch."""
    logits, counts, prompt_mask, rows, rep, freq, pres = _args([4, 1], 300, torch.bfloat16, seed=3)
    one = (logits[1:, :299], counts[:, :299], prompt_mask[:, :299], rows[1:], rep[1:], freq[1:], pres[1:])
    assert torch.equal(tp.apply_penalties(*one), sampler_mod.apply_penalties(*one))
    one = (logits[:1], counts, prompt_mask, rows[:1], rep[:1], freq[:1], pres[:1])
    assert torch.equal(tp.apply_penalties(*one), sampler_mod.apply_penalties(*one))
    none = (logits[:0], counts, prompt_mask, rows[:0], rep[:0], freq[:0], pres[:0])
    empty = tp.apply_penalties(*none)
    assert empty.shape == (0, 300) and empty.dtype == torch.float32
    assert torch.equal(empty, sampler_mod.apply_penalties(*none))


PARAMS = [
    SamplingParams(temperature=0.8, repetition_penalty=1.3, top_k=40),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.2, top_p=0.9),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, repetition_penalty=0.9, min_p=0.05),
]


@pytest.mark.parametrize("rows", [[0, 1, 3], [0, 1, 2, 3, 4]], ids=["no-filters", "filters"])
def test_sampler_draws_the_same_tokens_with_the_kernel(rows: list[int]) -> None:
    """A Sampler with the fused penalties gives the torch Sampler's tokens over many steps (the counts of
    sampled tokens growing), with and without filters, from bf16 logits."""
    vocab = 1500
    params = [PARAMS[i].resolved() for i in rows]
    n = len(rows)
    table_rows = [MAX_ROWS - 1 - i for i in range(n)]
    plain, with_kernel = Sampler(vocab, MAX_ROWS, DEVICE), Sampler(vocab, MAX_ROWS, DEVICE)
    with_kernel.penalty_kernel = fused.penalty_kernel("triton", vocab, DEVICE)
    assert with_kernel.penalty_kernel is not None
    for s in (plain, with_kernel):
        s.init_rows(table_rows, [[1, 2, 3, 9 * i] for i in range(n)], [[]] * n)
    g = torch.Generator().manual_seed(2)
    for step in range(12):
        logits = (torch.randn(n, vocab, generator=g) * 2).to(device=DEVICE, dtype=torch.bfloat16)
        batch = SamplingBatch.build(params, [step] * n, table_rows, [11 * i for i in range(n)], DEVICE, vocab)
        assert torch.equal(with_kernel.sample(logits, batch), plain.sample(logits, batch))
    assert torch.equal(with_kernel.output_counts, plain.output_counts)
    assert int(plain.output_counts.sum()) == 12 * sum(p.has_penalties for p in params)


def test_penalty_kernel_choice(caplog: pytest.LogCaptureFixture) -> None:
    """'torch' and 'auto' off CUDA: torch ops; 'triton': the kernel (on CUDA, or the CPU under the
    interpreter); the start-up check passes the kernel and refuses one that computes other values or
    fails, and 'auto' on CUDA then falls back to torch with the reason."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="fused_kernels='fast': must be one of"):
        fused.penalty_kernel("fast", 100, cpu)
    assert fused.penalty_kernel("torch", 100, cpu) is None
    assert fused.penalty_kernel("auto", 100, cpu) is None
    kernel = fused.penalty_kernel("triton", 100, DEVICE)
    assert kernel is tp.apply_penalties and fused.penalty_disagreement(kernel, 100, DEVICE) is None

    def off_by_an_ulp(logits: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        out = tp.apply_penalties(logits, *args)
        out[1, 7] = torch.nextafter(out[1, 7], torch.tensor(float("inf"), device=out.device))
        return out

    assert "the Triton penalties differ from torch's at [1, 7]" in fused.penalty_disagreement(
        off_by_an_ulp, 100, DEVICE
    )
    bf16 = lambda logits, *_: logits.clone()  # noqa: E731 - the wrong dtype
    assert "gave torch.bfloat16" in fused.penalty_disagreement(bf16, 100, cpu)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no kernel image")

    assert "failed: RuntimeError: no kernel image" in fused.penalty_disagreement(broken, 100, cpu)
    # on CUDA, "auto" runs the check and falls back to torch, saying why
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        mp.setattr(fused, "penalty_disagreement", lambda *_: "the Triton penalties failed: X")
        assert fused.penalty_kernel("auto", 100, torch.device("cuda")) is None
    assert "fused sampling: the Triton penalties failed: X; using torch" in caplog.text
    # and takes the kernel once the check passes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "penalty_disagreement", lambda *_: None)
        assert fused.penalty_kernel("auto", 100, torch.device("cuda")) is tp.apply_penalties
