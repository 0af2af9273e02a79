"""The sort-free top-p floor (`gapless.sampling.triton_nucleus`) against the sort
(`gapless.sampling.sampler._nucleus_floor` on the sorted row), under Triton's interpreter on CPU
(tests/conftest.py sets TRITON_INTERPRET before anything imports Triton): the sort's floor wherever it lies
clear of float32 rounding, and where it does not, a floor the exact (float64) rule allows within that
rounding; ties, masked tokens, top-p 1, rows with no finite logit, vocabularies below, at and past the
block; the sampler's top-k + top-p through it keeping the sort path's tokens; and how
`gapless.sampling.fused.nucleus_kernel` chooses it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from gapless.sampling.filters import PARTIAL_SORT_MAX_K, _nucleus_floor
from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams
from gapless.testing.triton import import_kernels_or_skip

tn = import_kernels_or_skip("gapless.sampling.triton_nucleus")

from gapless.sampling import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")


def _sorted_floor(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return _nucleus_floor(logits.sort(dim=-1).values, top_p)


def _mass_above(row: torch.Tensor, v: float) -> float:
    """The exact (float64) probability of the row's tokens with logits above v."""
    p = row.double().softmax(dim=-1)
    return float(p[row.double() > v].sum())


# (the largest vocabulary, ~8 s, in the slow tier)
@pytest.mark.parametrize("vocab", [5, 512, 1500, pytest.param(4099, marks=pytest.mark.slow)])
def test_the_floor_is_the_sorts_or_one_the_exact_rule_allows(vocab: int) -> None:
    """Random rows at several scales (peaked and flat), with masked tokens and ties: the kernel's floor is
    the sort's, and where a boundary lies within float32 rounding of top-p, still a floor the exact rule
    keeps: the mass above it under top-p and the mass from it up at least top-p, within 1e-5."""
    g = torch.Generator().manual_seed(vocab)
    rows, ps = [], []
    for scale in (0.5, 2.0, 6.0):
        for p in (0.1, 0.5, 0.9, 0.95, 0.999):
            x = torch.randn(vocab, generator=g) * scale
            if vocab > 4:
                x[:: max(2, vocab // 7)] = NEG_INF  # masked by an earlier filter
                x[1::5] = x[1::5].round()  # ties
            rows.append(x)
            ps.append(p)
    logits, top_p = torch.stack(rows).to(DEVICE), torch.tensor(ps, device=DEVICE)
    got = tn.nucleus_floor(logits, top_p).cpu()
    want = _sorted_floor(logits, top_p).cpu()
    differ = 0
    for i in range(len(rows)):
        g_, w = got[i, 0].item(), want[i, 0].item()
        if g_ == w:
            continue
        differ += 1
        row, p = logits[i].cpu(), ps[i]
        below_g = row[row < g_].max().item() if (row < g_).any() else NEG_INF
        assert _mass_above(row, g_) < p + 1e-5 and _mass_above(row, below_g) >= p - 1e-5, (i, g_, w)
    assert differ <= 1  # rounding-close boundaries are rare


@pytest.mark.parametrize("vocab", [100, 513, 2048, 5000])
def test_clear_boundaries_give_the_sorts_floor_exactly(vocab: int) -> None:
    """The rows the start-up check uses (`fused.nucleus_rows`: halving probabilities, top-p mid-way between
    cumulative sums, a tied masked tail kept whole, top-p 1): the sort's floors, bit for bit."""
    logits, top_p = fused.nucleus_rows(vocab, DEVICE)
    assert torch.equal(tn.nucleus_floor(logits, top_p), _sorted_floor(logits, top_p))


def test_edge_rows() -> None:
    """No finite logit: -inf (nothing to keep but what is there); one finite logit: it; equal logits: all
    kept; a tiny top-p: the largest alone; top-p 1: -inf; and no rows at all."""
    x = torch.tensor(
        [
            [NEG_INF] * 6,
            [NEG_INF, 2.5, NEG_INF, NEG_INF, NEG_INF, NEG_INF],
            [1.0] * 6,
            [0.0, -0.0, 3.0, 1.0, 2.0, -1.0],
            [0.0, -0.0, 3.0, 1.0, 2.0, -1.0],
        ],
        device=DEVICE,
    )
    top_p = torch.tensor([0.9, 0.9, 0.5, 1e-6, 1.0], device=DEVICE)
    got = tn.nucleus_floor(x, top_p).flatten().tolist()
    assert got == [NEG_INF, 2.5, 1.0, 3.0, NEG_INF]
    assert tn.nucleus_floor(x[:0], top_p[:0]).shape == (0, 1)


PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.9),  # top-p alone: the kernel (the sort without it)
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8),  # bounded by top-k: the window, either way
    SamplingParams(temperature=0.9, top_k=1200, top_p=0.95),  # top-k past the window: kernel over its k
    SamplingParams(temperature=1.1, top_k=2000),  # top-k alone, past the window
    SamplingParams(temperature=0.8),
]


def test_sampler_keeps_the_sort_paths_tokens_with_the_kernel() -> None:
    """A Sampler with the nucleus kernel filters each row of a mixed batch as the sort path does (on rows
    whose boundaries are clear: `fused.nucleus_rows`, scaled per row by its temperature), and draws the
    same seeded tokens over several steps."""
    vocab = 2 * PARTIAL_SORT_MAX_K + 500
    plain, searched = Sampler(vocab, 8, DEVICE), Sampler(vocab, 8, DEVICE)
    searched.nucleus_kernel = fused.nucleus_kernel("triton", vocab, DEVICE)
    assert searched.nucleus_kernel is not None
    params = [p.resolved() for p in PARAMS]
    n = len(params)
    rows, _ = fused.nucleus_rows(vocab, DEVICE)
    logits = rows[:n].clone()
    batch = SamplingBatch.build(params, [0] * n, list(range(n)), [5 * i for i in range(n)], DEVICE, vocab)
    scaled = logits / batch.temperature.unsqueeze(1)
    want = plain.apply_filters(scaled.clone(), batch)
    got = searched.apply_filters(scaled.clone(), batch)
    assert torch.equal(got.isinf(), want.isinf())
    kept = (~got.isinf()).sum(dim=1).tolist()
    assert all(0 < k < vocab for k in kept[:4]), kept  # each filtering row masked something
    for step in range(4):
        batch = SamplingBatch.build(
            params, [step] * n, list(range(n)), [5 * i for i in range(n)], DEVICE, vocab
        )
        assert torch.equal(searched.sample(logits, batch), plain.sample(logits, batch))


def test_sampler_sorts_without_the_kernel_or_an_unknown_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sort stays where the kernel is not chosen, and where the host does not know the batch's largest
    top-k (the partial sort that gives the k-th largest needs its width)."""
    vocab = PARTIAL_SORT_MAX_K + 200
    s = Sampler(vocab, 4, DEVICE)
    calls: list[str] = []
    monkeypatch.setattr(
        "gapless.sampling.sampler.apply_top_k_top_p", lambda logits, *a: calls.append("sort") or logits
    )
    params = [SamplingParams(top_p=0.9, top_k=1100).resolved()]
    batch = SamplingBatch.build(params, [0], [0], [0], DEVICE, vocab)
    s.apply_filters(torch.randn(1, vocab, device=DEVICE), batch)
    assert calls == ["sort"]
    s.nucleus_kernel = lambda logits, top_p: calls.append("kernel") or torch.full_like(logits[:, :1], NEG_INF)
    s.apply_filters(torch.randn(1, vocab, device=DEVICE), batch)
    assert calls == ["sort", "kernel"]
    s.apply_filters(torch.randn(1, vocab, device=DEVICE), dataclasses.replace(batch, max_top_k=0))
    assert calls == ["sort", "kernel", "sort"]


def test_top_p_alone_makes_one_float32_copy_and_no_sort() -> None:
    """Temperature + top-p without top-k over bf16 logits, with the kernel: the scaled copy is the one
    float32 [B, V] (the sort made a sorted copy, its int64 indices and a softmax beside it)."""
    from tests.sampling.test_lm_head_sampling import _Watch

    vocab = PARTIAL_SORT_MAX_K + 300
    s = Sampler(vocab, 4, DEVICE)
    s.nucleus_kernel = tn.nucleus_floor
    params = [
        SamplingParams(temperature=0.6, top_p=0.9).resolved(),
        SamplingParams(temperature=0.0).resolved(),
    ]
    batch = SamplingBatch.build(params * 2, [0] * 4, list(range(4)), [1, 2, 3, 4], DEVICE, vocab)
    logits = torch.randn(4, vocab, device=DEVICE).to(torch.bfloat16)
    with _Watch((4, vocab)) as watch:
        s.sample(logits, batch)
    assert watch.new_fp32 == 1 and "sort.default" not in watch.ops, watch.ops


def test_a_row_bounded_by_top_k_keeps_its_tokens_in_any_batch() -> None:
    """A row whose top-k (<= PARTIAL_SORT_MAX_K) bounds its nucleus draws the same tokens alone (the
    partial sort) and beside a top-p row with no top-k (the kernel's batch): its window either way."""
    vocab = PARTIAL_SORT_MAX_K + 300
    s = Sampler(vocab, 4, DEVICE)
    s.nucleus_kernel = tn.nucleus_floor
    bounded = SamplingParams(temperature=1.3, top_k=600, top_p=0.7).resolved()
    free = SamplingParams(temperature=1.0, top_p=0.9).resolved()
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        logits = (torch.randn(2, vocab, generator=g) * 2).to(DEVICE)
        alone = SamplingBatch.build([bounded], [step], [0], [9], DEVICE, vocab)
        mixed = SamplingBatch.build([bounded, free], [step] * 2, [0, 1], [9, 4], DEVICE, vocab)
        assert alone.max_top_p_k <= PARTIAL_SORT_MAX_K < mixed.max_top_p_k
        assert torch.equal(s.sample(logits, mixed)[:1], s.sample(logits[:1], alone))


def test_nucleus_kernel_choice(caplog: pytest.LogCaptureFixture) -> None:
    """'torch' and 'auto' off CUDA: the sort; 'triton': the kernel; the start-up check passes it and refuses
    one that keeps a token more, or fails; 'auto' on CUDA then sorts, saying why."""
    cpu = torch.device("cpu")
    assert fused.nucleus_kernel("torch", 2000, cpu) is None
    assert fused.nucleus_kernel("auto", 2000, cpu) is None
    kernel = fused.nucleus_kernel("triton", 2000, DEVICE)
    assert kernel is tn.nucleus_floor and fused.nucleus_disagreement(kernel, 2000, DEVICE) is None

    def one_more(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        floor = tn.nucleus_floor(logits, top_p)
        below = logits.masked_fill(logits >= floor, NEG_INF).amax(dim=-1, keepdim=True)
        return torch.where(floor > NEG_INF, below, floor)

    assert "differ from the sort's" in fused.nucleus_disagreement(one_more, 2000, DEVICE)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no kernel image")

    assert "failed: RuntimeError: no kernel image" in fused.nucleus_disagreement(broken, 2000, cpu)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        mp.setattr(fused, "nucleus_disagreement", lambda *_: "the Triton nucleus failed: X")
        assert fused.nucleus_kernel("auto", 2000, torch.device("cuda")) is None
    assert "fused sampling: the Triton nucleus failed: X; using torch" in caplog.text
