"""The sort-free draw (`gapless.sampling.triton_sample`: temperature, top-k, top-p, min-p, Gumbel noise and
the argmax, each launch split across the vocabulary) under Triton's interpreter on CPU (tests/conftest.py
sets TRITON_INTERPRET before anything imports Triton), against the torch path: the same tokens where no
filter runs; the sort path's kept set for every filter and their mixes, with the edge cases (top-k 1,
tiny top-p, rows masked but for one token, ties at the threshold); draws that follow the exact filtered
softmax (chi-square); a seeded row's token in any batch; the sampler's stages before it (penalties,
logit bias, token masks); and how `gapless.sampling.fused.draw_kernel` chooses it. Small vocabularies
and small chunks, so a row still spans several programs: the interpreter runs one program at a time."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gapless.sampling import draw_floors
from gapless.sampling import sampler as sampler_mod
from gapless.sampling.filters import apply_min_p, apply_top_k_top_p
from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams
from gapless.tensors import dataclass_to_device
from gapless.testing.triton import import_kernels_or_skip

ts = import_kernels_or_skip("gapless.sampling.triton_sample")

from gapless.sampling import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OFF = (False, False, False)


def _torch_draw(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor):
    keys = sampler_mod._row_keys(seeds, steps)
    hashes = sampler_mod._bits_as_int32(sampler_mod._column_hashes(logits.shape[1], logits.device))
    return sampler_mod.gumbel_argmax(logits, temperature, keys, hashes, True)


@pytest.mark.parametrize(
    ("dtype", "vocab", "chunk"),
    [
        (torch.float32, 1, 16),
        (torch.float32, 37, 8),
        (torch.float16, 37, 16),
        (torch.bfloat16, 37, 64),
        (torch.bfloat16, 2500, ts.CHUNK),
    ],
)
def test_unfiltered_draw_is_the_torch_draw(dtype: torch.dtype, vocab: int, chunk: int) -> None:
    """Temperatures, greedy rows (temperature 0) and an all -inf row; chunks that split each row over
    several programs (the last to finish picks the row's token) or one."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 3).to(device=DEVICE, dtype=dtype)
    logits[5] = float("-inf")
    temperature = torch.tensor([0.7, 0.0, 1.3, 1.0, 2.5, 1.0], device=DEVICE)
    seeds = torch.tensor([1, 2, 3, -5, 2**40, 9], device=DEVICE)
    ones, zeros, off = (
        torch.ones(6, device=DEVICE),
        torch.zeros(6, device=DEVICE),
        torch.full((6,), vocab, device=DEVICE),
    )
    for step in range(2):
        steps = torch.full((6,), step, device=DEVICE)
        got = ts.draw(logits, temperature, off, ones, zeros, seeds, steps, OFF, chunk)
        assert got.dtype == torch.int64 and torch.equal(got, _torch_draw(logits, temperature, seeds, steps))
    empty = ts.draw(logits[:0], temperature[:0], off[:0], ones[:0], zeros[:0], seeds[:0], seeds[:0], OFF)
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.slow  # (over 10 s under the interpreter)
def test_256_rows_of_flat_logits_draw_the_noise_column_by_column() -> None:
    """Flat logits: each token is the argmax of the noise alone, so 256 rows check the in-kernel row keys
    (`_row_keys` of each row's seed and step) and the column hashes against torch's, with and without
    a filter's passes."""
    rows, vocab = 256, 23
    flat = torch.zeros(rows, vocab, device=DEVICE)
    seeds = torch.arange(rows, device=DEVICE) * 7919 - 100
    steps = torch.arange(rows, device=DEVICE) % 5
    ones = torch.ones(rows, device=DEVICE)
    off = torch.full((rows,), vocab, device=DEVICE)
    got = ts.draw(flat, ones, off, ones, ones * 0, seeds, steps, OFF, 32)
    assert torch.equal(got, _torch_draw(flat, ones, seeds, steps))
    assert len(set(got.tolist())) == vocab  # the draws spread over the vocabulary
    # min-p on flat rows keeps every token: the bounds pass over 256 rows changes nothing
    assert torch.equal(ts.draw(flat, ones, off, ones, ones / 2, seeds, steps, (False, False, True), 32), got)


def _edge_rows(vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Rows and settings covering every filter, their mixes and the edge cases."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(14, vocab, generator=g) * 2
    logits[4] = logits[4].clamp(max=2.0)
    logits[4, 5:12] = 2.5  # ties at the top-k threshold: all kept
    logits[6] = float("-inf")  # masked but for one token
    logits[6, vocab - 2] = 0.3
    logits[7, 3:9] = 9.0  # a tied head holds the nucleus: every tie kept
    logits[8, ::3] = float("-inf")
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_k=5, temperature=0.7),
        SamplingParams(top_p=1e-6),  # tiny top-p: the largest alone
        SamplingParams(top_p=0.6, temperature=1.3),
        SamplingParams(top_k=3),
        SamplingParams(min_p=0.1),
        SamplingParams(top_k=4, top_p=0.5, min_p=0.2),
        SamplingParams(top_p=0.3),
        SamplingParams(top_k=7, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=vocab + 5, top_p=0.95),
        SamplingParams(top_k=2, min_p=0.5, temperature=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(top_p=0.999, min_p=0.01),
    ]
    return logits.to(DEVICE), params


def _batch(params: list[SamplingParams], vocab: int, steps: list[int] | None = None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        [p.resolved() for p in params],
        steps or [0] * n,
        list(range(n)),
        [17 * i for i in range(n)],
        DEVICE,
        vocab,
    )


def _reference_kept(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sort path's kept set (float32, as the torch sampler rounds) of temperature-scaled logits."""
    t = batch.temperature.masked_fill(batch.temperature == 0, 1.0)[:, None]
    y = apply_top_k_top_p(logits.float() / t, batch.top_k, batch.top_p)
    return torch.isfinite(apply_min_p(y, batch.min_p))


def _args(batch: SamplingBatch) -> tuple[torch.Tensor, ...]:
    return (batch.temperature, batch.top_k, batch.top_p, batch.min_p)


@pytest.mark.parametrize(
    ("dtype", "window"),
    [
        (torch.float32, ts.WINDOW),
        pytest.param(torch.bfloat16, ts.WINDOW, marks=pytest.mark.slow),  # (~7 s each)
        pytest.param(torch.bfloat16, 4, marks=pytest.mark.slow),
    ],
)
def test_floors_keep_the_sort_paths_tokens(dtype: torch.dtype, window: int) -> None:
    """Every filter, their mixes and the edge cases, 37 columns in five chunks: the floors keep exactly
    the sort's tokens (top-k 1 is greedy: `SamplingParams` resolves it so): searched (float32), from the
    window for every top-k row (bf16, a window past the vocabulary), or mixed (a window of 4: top-k 3
    with ties of its third beyond the window, top-k 5 and 7 searched)."""
    vocab = 37
    logits, params = _edge_rows(vocab)
    logits = logits.to(dtype)
    batch = _batch(params, vocab)
    temperature, top_k, top_p, min_p = _args(batch)
    found = ts.floors(logits, temperature, top_k, top_p, (True, True), chunk=8, window=window)
    got = ts.kept(logits, temperature, top_p, min_p, found)
    want = _reference_kept(logits, batch)
    for i, p in enumerate(params):
        assert torch.equal(got[i], want[i]), (i, p, got[i].nonzero().flatten(), want[i].nonzero().flatten())
    assert batch.temperature[0] == 0 and got[2].sum() == 1 and got[6].sum() == 1
    assert got[4].sum() == 7 and got[7].sum() == 6


def test_the_window_skips_the_searches_no_row_needs() -> None:
    """Qwen3's defaults and other small top-k rows in bf16: every row takes the window, so with the
    batch's largest top-k given the searches are skipped, and the floors and tokens stay the same (and
    the sort's kept sets)."""
    vocab, n = 300, 4
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(DEVICE, torch.bfloat16)
    logits[1, 10:40] = 15.0  # a tied head past the window: all in top-k, all in the nucleus
    params = [
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.5),
        SamplingParams(top_k=50, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    batch = _batch(params, vocab)
    temperature, top_k, top_p, min_p = _args(batch)
    assert (batch.max_top_k, batch.max_top_p_k) == (50, 20)
    with pytest.MonkeyPatch.context() as mp:
        launches: list[bool] = []
        real = ts._search_kernel
        mp.setattr(
            ts,
            "_search_kernel",
            type("Spy", (), {"__getitem__": lambda _, grid: launches.append(1) or real[grid]})(),
        )
        skipped = ts.floors(logits, temperature, top_k, top_p, (True, True), 64, (50, 20))
        assert not launches
        searched = ts.floors(logits, temperature, top_k, top_p, (True, True), 64)
        assert len(launches) == 2 * ts.SEARCH_PASSES
    assert torch.equal(skipped.keys, searched.keys) and torch.equal(skipped.row_max, searched.row_max)
    kept = ts.kept(logits, temperature, top_p, min_p, skipped)
    assert torch.equal(kept, _reference_kept(logits, batch))
    assert kept[1].sum() == 30
    args = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds, batch.steps)
    tokens = ts.draw(logits, *args, (True, True, True), 64, largest_k=(50, 20))
    assert torch.equal(tokens, ts.draw(logits, *args, (True, True, True), 64))
    assert kept[torch.arange(n), tokens.cpu()].all()


def test_a_top_p_row_takes_the_window_when_it_holds_the_nucleus() -> None:
    """Top-p without top-k in bf16: a peaked row (its 64 largest hold over p of the mass) gets its floor
    from the window, a flat one (they hold under p) is left to the search; both keep the sort's tokens,
    and the peaked row's floor is the search's (float32 logits of the same values always search)."""
    vocab, n = 2000, 2
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=g)
    logits[0, :5] += 12.0  # peaked: five tokens hold nearly all the mass
    logits = logits.to(DEVICE, torch.bfloat16)
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.9)]
    batch = _batch(params, vocab)
    temperature, top_k, top_p, min_p = _args(batch)
    windowed = ts.floors(logits, temperature, top_k, top_p, (False, True), 256)
    searched = ts.floors(logits.float(), temperature, top_k, top_p, (False, True), 256)
    assert windowed.row_mass is not None and searched.row_mass is None
    y = logits.float() / temperature[:, None]
    mass = (y - y.amax(-1, keepdim=True)).exp().sum(-1)
    torch.testing.assert_close(windowed.row_mass, mass, rtol=1e-5, atol=0)
    assert torch.equal(windowed.keys, searched.keys)
    assert torch.equal(ts.kept(logits, temperature, top_p, min_p, windowed), _reference_kept(logits, batch))
    # which rows the window served: with every key made a sentinel, only the peaked row's top-p changes
    sentinel = ts.Floors(windowed.row_max, torch.full_like(windowed.keys, -7), windowed.row_mass)
    draw_floors.window_floors(logits, temperature, top_k, top_p, sentinel, ts.WINDOW)
    assert sentinel.keys[0, 2] == searched.keys[0, 2] and (sentinel.keys[1] == -7).all()


def _critical(df: int, z: float = 3.7) -> float:
    """The chi-square statistic exceeded with probability about 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow  # (over 10 s under the interpreter)
def test_draws_follow_the_exact_filtered_softmax() -> None:
    """Top-k, top-p, min-p, all three, and temperature alone, in one batch: each row's floors searched
    once, then drawn from by 160 seeds: every draw is a kept token, and the counts fit the exact
    filtered softmax (float64 over the sort path's kept set) by chi-square."""
    vocab, draws = 11, 160
    logits = _edge_rows(vocab)[0][[1, 3, 5, 8, 12]]
    params = [
        SamplingParams(top_k=5, temperature=0.7),
        SamplingParams(top_p=0.8, temperature=1.3),
        SamplingParams(min_p=0.1),
        SamplingParams(top_k=5, top_p=0.95, min_p=0.05, temperature=1.5),
        SamplingParams(temperature=1.0),
    ]
    batch = _batch(params, vocab)
    temperature, top_k, top_p, min_p = _args(batch)
    found = ts.floors(logits, temperature, top_k, top_p, (True, True), chunk=8)
    n = len(params)
    rep = torch.arange(n, device=DEVICE).repeat(draws)  # row i of each copy: params[i], its own seed
    seeds = torch.arange(n * draws, device=DEVICE) * 104729 + 3
    floors = ts.Floors(found.row_max[rep], found.keys[rep])
    args = (temperature[rep], top_p[rep], min_p[rep], seeds, torch.zeros_like(seeds), floors)
    tokens = ts.draw_with(logits[rep], *args, chunk=16).view(draws, n)
    kept = _reference_kept(logits, batch)
    probs = (logits.double() / temperature.double()[:, None]).masked_fill(~kept, float("-inf")).softmax(-1)
    for i, p in enumerate(params):
        drawn = tokens[:, i]
        assert kept[i, drawn].all(), (i, p)
        observed = torch.bincount(drawn, minlength=vocab).double()
        expected = probs[i] * draws
        big = expected >= 5  # bins expected under 5 pooled into one
        obs = torch.cat([observed[big], observed[~big].sum().view(1)])
        exp = torch.cat([expected[big], expected[~big].sum().view(1)])
        obs, exp = obs[exp > 0], exp[exp > 0]
        assert len(exp) >= 2, (i, p)  # something to test: the filters leave a choice
        stat = float(((obs - exp) ** 2 / exp).sum())
        assert stat < _critical(len(exp) - 1), (i, p, observed.tolist(), expected.tolist())


# (float32, ~7 s, in the slow tier; bfloat16's case stays in `make test`)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    """Top-k + top-p (both searches in float32, the window in bf16) with other rows of every mode before
    or after it: the same token, step by step, as when it is alone (its chunks and sums do not depend on
    the batch)."""
    vocab = 45
    logits, params = _edge_rows(vocab)
    logits = logits.to(dtype)
    target = SamplingParams(top_k=9, top_p=0.8, temperature=0.9, seed=4)
    others = [params[i] for i in (1, 3, 5, 9, 11)]
    for step in range(2):

        def token(position: int, size: int, step: int = step) -> int:
            rest = others[: size - 1]
            mix = rest[:position] + [target] + rest[position:]
            rows = torch.cat([logits[: size - 1][:position], logits[13:14], logits[: size - 1][position:]])
            batch = _batch(mix, vocab, [step if i == position else step + i for i in range(size)])
            seeds = batch.seeds.clone()
            seeds[position] = 4
            args = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, seeds, batch.steps)
            return int(ts.draw(rows, *args, (True, True, True), 16)[position])

        alone = token(0, 1)
        assert token(2, 3) == alone


@pytest.mark.slow  # (~8 s)
def test_sampler_with_the_kernel_samples_after_its_stages() -> None:
    """Penalties, logit bias and a token mask (as `constrain` applies a grammar's) run before the
    kernel: the sampler's tokens are the kernel's on the logits those stages make, and every one is
    allowed by the mask and the filters."""
    vocab, n = 50, 4
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(n, vocab, generator=g) * 2).to(DEVICE, torch.bfloat16)
    params = [
        SamplingParams(temperature=0.8, top_k=6, repetition_penalty=1.3, seed=1),
        SamplingParams(top_p=0.7, logit_bias={3: 5.0, 7: -100.0}, seed=2),
        SamplingParams(min_p=0.2, frequency_penalty=0.5, presence_penalty=0.3, seed=3),
        SamplingParams(temperature=0.0),
    ]
    with_kernel = Sampler(vocab, n, DEVICE)
    with_kernel.draw_kernel = fused.draw_kernel("triton", vocab, DEVICE)
    allowed = torch.rand(n, vocab, generator=g) < 0.6
    allowed[:, 3] = True
    with_kernel.init_rows(list(range(n)), [[1, 2, 3]] * n, [[4, 4, 5]] * n)
    for step in range(3):
        batch = _batch(params, vocab, [step] * n)
        resolved = [p.resolved() for p in params]
        values, _, _ = sampler_mod.RowParams.build(resolved, list(range(n)), [1, 2, 3, 0], vocab)
        with_kernel.write_rows(dataclass_to_device(values, DEVICE))
        # a grammar's mask as `constrain` applies it: forbidden tokens at -inf in a float32 copy
        masked = logits.float().masked_fill(~allowed.to(DEVICE), float("-inf"))
        constrained = with_kernel.constrain(masked, batch, None)
        staged = with_kernel.apply_penalties(constrained, batch)  # (before `sample` counts its tokens)
        got = with_kernel.sample(constrained, batch)
        args = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds, batch.steps)
        assert torch.equal(got, ts.draw(staged, *args, (True, True, True)))
        assert allowed[torch.arange(n), got.cpu()].all()
        assert got[1] != 7 and got[3] == staged[3].argmax()


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
    assert "(temperature) drew [0, 0, 0, 0]" in fused.disagreement(wrong, 100, cpu)

    def filters_wrong(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return logits.argmax(dim=-1) if batch.need_top_p else kernel(logits, batch)

    assert "(filters) drew" in fused.disagreement(filters_wrong, 100, DEVICE)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no kernel image")

    assert "failed: RuntimeError: no kernel image" in fused.disagreement(broken, 100, cpu)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        mp.setattr(fused, "disagreement", lambda *_: "the Triton draw drew [1], torch [2] at step 0")
        assert fused.draw_kernel("auto", 100, torch.device("cuda")) is None
    assert "fused sampling: the Triton draw drew [1], torch [2] at step 0; using torch" in caplog.text
