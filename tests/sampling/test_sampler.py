"""The on-device sampler against straightforward references (Hugging Face's logits processors, softmax)."""

from collections.abc import Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_batch(
    params: Sequence[SamplingParams],
    *,
    seeds: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        [p.resolved() for p in params],  # as the engine queues them: no knob unset
        steps=list(steps) if steps is not None else [0] * n,
        rows=list(rows) if rows is not None else list(range(n)),
        seeds=list(seeds) if seeds is not None else list(range(n)),
        device=CPU,
        vocab_size=vocab_size,
    )


def hf_filtered(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: Hugging Face's warpers, one row at a time, in generate()'s order."""
    p = p.resolved()
    scores = logits_row.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k != -1:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(ids, scores)
    return scores[0]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


class OpLog(TorchDispatchMode):
    """Records every aten op run inside the context, to check what the hot path does."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


FILTER_CASES = [
    SamplingParams(top_k=5),
    SamplingParams(top_k=1000),  # larger than the vocab: no filtering
    SamplingParams(top_p=0.7),
    SamplingParams(top_p=0.95, temperature=0.6),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=1.7),
    SamplingParams(top_k=10, top_p=0.8, min_p=0.05, temperature=0.9),
    SamplingParams(top_k=3, top_p=0.5),
    SamplingParams(temperature=1.3),
]


def test_filters_keep_exactly_the_reference_set() -> None:
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(len(FILTER_CASES), vocab) * 2.5
    batch = make_batch(FILTER_CASES, vocab_size=vocab)
    sampler = Sampler(vocab, max_rows=16, device=CPU)
    scaled = logits / batch.temperature.unsqueeze(1)
    ours = sampler.apply_filters(scaled.clone(), batch)
    for i, p in enumerate(FILTER_CASES):
        ref = hf_filtered(logits[i], p)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref)), p
        kept = torch.isfinite(ref)
        torch.testing.assert_close(ours[i][kept], ref[kept])
    # The cases really filter: otherwise the comparison above would prove little.
    assert (torch.isfinite(ours).sum(1) < vocab).sum() >= len(FILTER_CASES) - 2


def case_id(p: SamplingParams) -> str:
    return f"k{p.top_k}-p{p.top_p}-m{p.min_p}-t{p.temperature}"


@pytest.mark.parametrize("p", FILTER_CASES, ids=case_id)
def test_sampled_tokens_cover_exactly_the_allowed_set(p: SamplingParams) -> None:
    torch.manual_seed(1)
    vocab, draws = 24, 4000
    row = torch.randn(vocab) * 1.5
    allowed = torch.isfinite(hf_filtered(row, p))
    probs = torch.softmax(hf_filtered(row, p), dim=-1)
    batch = make_batch([p] * draws, seeds=range(draws), vocab_size=vocab)
    tokens = Sampler(vocab, draws, CPU).sample(row.expand(draws, vocab), batch)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[tokens] = True
    assert not (seen & ~allowed).any(), "sampled a filtered-out token"
    # Every allowed token likely enough to show up in 4000 draws does show up.
    assert torch.equal(seen | (allowed & (probs < 2e-3)), allowed)


def test_top_k_without_vocab_size_at_build_time() -> None:
    vocab = 32
    logits = torch.randn(3, vocab)
    batch = make_batch([SamplingParams(top_k=4), SamplingParams(top_k=500), SamplingParams()])
    out = Sampler(vocab, 4, CPU).apply_filters(logits.clone(), batch)
    assert torch.isfinite(out).sum(1).tolist() == [4, vocab, vocab]


def test_temperature_one_matches_softmax() -> None:
    vocab, n = 8, 40_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    probs = torch.softmax(logits, dim=-1)
    sampler = Sampler(vocab, n, CPU)
    # Across seeds at one step, and across steps of one seed.
    for seeds, steps in (
        (range(n), [0] * n),
        ([12345] * n, range(n)),
    ):
        batch = make_batch([SamplingParams()] * n, seeds=seeds, steps=steps, vocab_size=vocab)
        tokens = sampler.sample(logits.expand(n, vocab), batch)
        assert chi_square(tokens, probs) < 30.0  # df = 7; p ~ 1e-4
        freq = torch.bincount(tokens, minlength=vocab).double() / n
        assert (freq - probs.double()).abs().max() < 0.01


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    vocab, n = 8, 40_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    batch = make_batch([SamplingParams(temperature=temperature)] * n, seeds=range(100, 100 + n))
    tokens = Sampler(vocab, n, CPU).sample(logits.expand(n, vocab), batch)
    assert chi_square(tokens, torch.softmax(logits / temperature, dim=-1)) < 30.0
    assert chi_square(tokens, torch.softmax(logits, dim=-1)) > 500.0


def test_greedy_rows_are_argmax_whatever_the_other_rows_do() -> None:
    torch.manual_seed(2)
    vocab = 100
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(top_p=0.3, min_p=0.2),
        SamplingParams(temperature=0.7, top_k=1),  # greedy through top_k
        SamplingParams(temperature=2.0, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, seed=3),
    ]
    sampler = Sampler(vocab, 8, CPU)
    sampler.init_rows([4], [[1, 2, 3]], [[5, 5]])
    for step in range(20):
        logits = torch.randn(len(params), vocab) * 3
        batch = make_batch(params, seeds=[step * 7 + i for i in range(len(params))], steps=[step] * 6)
        tokens = sampler.sample(logits, batch)
        for i in (0, 3, 5):
            assert tokens[i] == logits[i].argmax()


def test_greedy_with_penalty_takes_argmax_of_penalised_logits() -> None:
    vocab = 10
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    sampler = Sampler(vocab, 4, CPU)
    sampler.init_rows([2], [[1]], [[]])  # token 1 is in the prompt
    batch = make_batch([SamplingParams(temperature=0, repetition_penalty=2.0)], rows=[2])
    assert sampler.sample(logits, batch).tolist() == [2]  # 5 / 2 < 4


def test_all_greedy_without_penalties_is_one_argmax() -> None:
    logits = torch.randn(4, 50)
    batch = make_batch([SamplingParams(temperature=0)] * 3 + [SamplingParams(top_k=1)])
    sampler = Sampler(50, 4, CPU)
    with OpLog() as log:
        tokens = sampler.sample(logits, batch)
    assert log.ops == [torch.ops.aten.argmax.default]
    assert torch.equal(tokens, logits.argmax(-1))


def test_hot_path_never_syncs_with_the_host() -> None:
    vocab = 40
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(temperature=0.5, frequency_penalty=0.3),
    ]
    sampler = Sampler(vocab, 4, CPU)
    sampler.init_rows([0, 1, 2], [[1], [2], [3]], [[], [4], []])
    batch = make_batch(params, vocab_size=vocab)
    with OpLog() as log:
        sampler.sample(torch.randn(3, vocab), batch)
    names = {str(op) for op in log.ops}
    syncing = {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten.unique.default",
        "aten._unique2.default",
    }
    assert not names & syncing, names & syncing


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(3)
    vocab = 50
    penalties = [1.3, 0.7, 1.0, 2.0]
    prompts = [[1, 2, 3, 3, 49], [0, 10, 20], [5], [7, 8]]
    outputs = [[4, 4, 2], [], [5, 6], [9, 7, 7, 1]]
    rows = [3, 0, 6, 1]
    sampler = Sampler(vocab, 8, CPU)
    sampler.init_rows(rows, prompts, outputs)
    logits = torch.randn(4, vocab) * 4
    batch = make_batch([SamplingParams(repetition_penalty=r) for r in penalties], rows=rows)
    ours = sampler.apply_penalties(logits.clone(), batch)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref, rtol=1e-6, atol=0)
    assert not torch.equal(ours[0], logits[0])


def test_presence_and_frequency_penalties_on_output_tokens_only() -> None:
    vocab = 12
    sampler = Sampler(vocab, 4, CPU)
    prompt = [0, 1, 1, 2]
    output = [2, 3, 3, 3, 7]  # counts: 2 -> 1, 3 -> 3, 7 -> 1; prompt tokens 0, 1 do not count
    sampler.init_rows([1], [prompt], [output])
    logits = torch.arange(vocab, dtype=torch.float32) - 5
    batch = make_batch([SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)], rows=[1])
    ours = sampler.apply_penalties(logits[None].clone(), batch)[0]
    expected = logits.clone()
    for token, count in {2: 1, 3: 3, 7: 1}.items():
        expected[token] -= 0.5 + (-0.25) * count
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_rows_without_penalties_are_untouched_by_stale_state() -> None:
    vocab = 20
    sampler = Sampler(vocab, 4, CPU)
    sampler.init_rows([1], [[1, 2, 3]], [[4, 4, 5]])  # row 1 left over from an earlier request
    logits = torch.randn(2, vocab)
    batch = make_batch([SamplingParams(frequency_penalty=1.0), SamplingParams()], rows=[0, 1])
    out = sampler.apply_penalties(logits.clone(), batch)
    assert torch.equal(out[1], logits[1])


def test_sample_counts_tokens_for_penalised_rows_only() -> None:
    vocab = 30
    sampler = Sampler(vocab, 4, CPU)
    sampler.init_rows([0, 2], [[1], [2]], [[], []])
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(), SamplingParams(repetition_penalty=1.1)]
    total = torch.zeros(4, vocab, dtype=torch.int32)
    for step in range(6):
        batch = make_batch(params, rows=[0, 1, 2], steps=[step] * 3)
        tokens = sampler.sample(torch.randn(3, vocab), batch)
        total[0, tokens[0]] += 1
        total[2, tokens[2]] += 1
    assert torch.equal(sampler.output_counts, total)


def test_init_rows_after_retraction_reproduces_penalty_state_and_stream() -> None:
    torch.manual_seed(4)
    vocab, steps = 40, 12
    p = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    prompt = [3, 4, 5, 5, 39]
    step_logits = torch.randn(steps + 1, vocab) * 2

    def run(sampler: Sampler, row: int, start: int, stop: int) -> list[int]:
        out = []
        for s in range(start, stop):
            batch = make_batch([p], seeds=[77], steps=[s], rows=[row])
            out.append(int(sampler.sample(step_logits[s : s + 1], batch)[0]))
        return out

    straight = Sampler(vocab, 8, CPU)
    straight.init_rows([3], [prompt], [[]])
    tokens = run(straight, 3, 0, steps)

    # Retracted after 7 tokens, resumed in another row of a sampler whose state is dirty.
    resumed = Sampler(vocab, 8, CPU)
    resumed.init_rows([6], [[1, 2, 9]], [[1, 1, 8]])
    resumed.init_rows([6], [prompt], [tokens[:7]])
    assert run(resumed, 6, 7, steps) == tokens[7:]
    assert torch.equal(resumed.output_counts[6], straight.output_counts[3])
    assert torch.equal(resumed.prompt_mask[6], straight.prompt_mask[3])
    assert int(straight.output_counts[3].sum()) == steps


def test_seeded_request_is_independent_of_its_batch() -> None:
    torch.manual_seed(5)
    vocab = 200
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.7, top_k=7, seed=9),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.3, repetition_penalty=1.3),
        SamplingParams(top_k=1),
        SamplingParams(temperature=1.1, frequency_penalty=0.4),
        SamplingParams(),
    ]
    for step in range(25):
        logits = torch.randn(vocab) * 2

        def token_at(position: int, batch_size: int, step: int = step, logits: torch.Tensor = logits) -> int:
            rest = others[: batch_size - 1]
            params = rest[:position] + [target] + rest[position:]
            seeds = [1000 + i for i in range(batch_size)]
            seeds[position] = 1234
            rows = list(range(batch_size))
            sampler = Sampler(vocab, 16, CPU)
            sampler.init_rows(rows, [[1, 2]] * batch_size, [[3]] * batch_size)
            all_logits = torch.randn(batch_size, vocab) * 3
            all_logits[position] = logits
            steps = [step + 3 * i + 1 for i in range(batch_size)]
            steps[position] = step
            batch = make_batch(params, seeds=seeds, steps=steps, rows=rows)
            return int(sampler.sample(all_logits, batch)[position])

        alone = token_at(0, 1)
        assert token_at(0, 8) == alone
        assert token_at(5, 8) == alone
        assert token_at(2, 4) == alone


def test_seeds_and_steps_give_different_streams() -> None:
    vocab, steps = 1000, 64
    logits = torch.zeros(steps, vocab)  # uniform: any correlation between streams would show

    def stream(seed: int) -> list[int]:
        batch = make_batch([SamplingParams()] * steps, seeds=[seed] * steps, steps=range(steps))
        return Sampler(vocab, steps, CPU).sample(logits, batch).tolist()

    a, b, again = stream(11), stream(12), stream(11)
    assert a == again
    assert sum(x != y for x, y in zip(a, b, strict=True)) >= steps - 3
    assert len(set(a)) >= steps - 5  # consecutive steps do not repeat the same draw
    huge = stream(2**64 + 11)  # only 64 bits of a seed count, and big seeds are accepted
    assert huge == a


def test_build_maps_settings_to_tensors() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(top_k=-1, top_p=0.5), SamplingParams(top_k=99)]
    batch = make_batch(params, vocab_size=50, steps=[0, 4, 9], rows=[7, 2, 5], seeds=[1, -2, 3])
    assert batch.top_k.tolist() == [50, 50, 50]
    assert batch.temperature.tolist() == [0.0, 1.0, 1.0]
    assert batch.steps.tolist() == [0, 4, 9] and batch.rows.tolist() == [7, 2, 5]
    assert batch.seeds.tolist() == [1, -2, 3]
    assert batch.any_greedy and not batch.all_greedy
    assert not batch.need_top_k and batch.need_top_p and not batch.need_min_p and not batch.need_penalties
    # A greedy row's settings never switch a stage on.
    greedy = make_batch([SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.5)], vocab_size=50)
    assert greedy.all_greedy and not (greedy.need_top_k or greedy.need_top_p or greedy.need_min_p)
    with pytest.raises(ValueError, match="length"):
        SamplingBatch.build(params, [0], [0, 1, 2], [0, 1, 2], CPU)


def test_low_precision_and_padded_logits() -> None:
    torch.manual_seed(6)
    vocab, padded = 30, 32
    logits = torch.randn(3, padded).to(torch.bfloat16)
    logits[:, vocab:] = 100.0  # padding columns must never be chosen
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.9),
        SamplingParams(repetition_penalty=1.2),
    ]
    tokens = Sampler(vocab, 4, CPU).sample(logits, make_batch(params, vocab_size=vocab))
    assert tokens.dtype == torch.int64 and (tokens < vocab).all()
    assert tokens[0] == logits[0, :vocab].argmax()
