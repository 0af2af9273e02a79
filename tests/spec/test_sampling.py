"""Sampled requests under speculation: rejection sampling keeps the target distribution (a chi-square
test on a tiny vocabulary: top_k=3 leaves each step three tokens to draw), and a seeded request draws the
same tokens with speculation and without."""

from __future__ import annotations

import collections

import pytest
import torch

import gapless.engine.spec.device
from gapless import LLM, SamplingParams

TOP_K = 3
REQUESTS = 600
POSITION = 3  # compared: each request's output tokens 1..3 as one category (one sample per request, so
# the samples are independent; token 0 comes from the prefill, the rest may come from accepted drafts)
SPEC = {
    "speculative_algorithm": "ngram",
    "speculative_num_draft_tokens": 3,
    "speculative_disable_batch_size": 1024,
}
Z = 4.75  # the normal quantile of p = 1e-6: the runs are seeded, so the statistic is one fixed number and
# this margin is for a change of seeds or numerics, not for flakiness


@pytest.fixture(scope="module")
def tiny_vocab(ckpt_factory):
    return str(ckpt_factory("qwen3"))


def _counts(path: str, seed: int, **options) -> tuple[collections.Counter, dict]:
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2] for _ in range(REQUESTS)]
    params = SamplingParams(max_tokens=POSITION + 1, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    with LLM(
        path, device="cpu", seed=seed, max_running_requests=REQUESTS, kv_cache_tokens=65536, **options
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.check_integrity()
        stats = llm.get_stats()
    return collections.Counter(tuple(o.token_ids[1 : POSITION + 1]) for o in outs), stats


def _chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, float]:
    """Two-sample chi-square statistic of two histograms, categories expected fewer than 5 times pooled into
    one category; and its critical value at p = 1e-6 (Wilson-Hilferty's approximation)."""
    na, nb = sum(a.values()), sum(b.values())
    rare = [t for t in set(a) | set(b) if (a[t] + b[t]) * min(na, nb) / (na + nb) < 5]
    a, b = collections.Counter(a), collections.Counter(b)
    for t in rare:
        a[()], b[()] = a[()] + a.pop(t, 0), b[()] + b.pop(t, 0)
    stat = 0.0
    for tok in set(a) | set(b):
        total = a[tok] + b[tok]
        for count, n in ((a[tok], na), (b[tok], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected if expected else 0.0
    df = len(set(a) | set(b)) - 1
    return stat, df * (1 - 2 / (9 * df) + Z * (2 / (9 * df)) ** 0.5) ** 3


def _accept_everything(targets, inputs, batch_index, offsets, batch, max_drafts):
    """A broken verify: every draft accepted, checked or not."""
    return torch.zeros(batch, dtype=torch.int64).scatter_reduce(0, batch_index, offsets, "amax")


def _spec(algorithm: str, path: str) -> dict:
    """SPEC with `algorithm`; a draft model is the target itself (its greedy drafts are a point mass, as
    n-gram drafts are)."""
    return (
        SPEC
        if algorithm == "ngram"
        else {**SPEC, "speculative_algorithm": "draft", "speculative_draft_model": path}
    )


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_distribution_matches_without_speculation(tiny_vocab, monkeypatch, algorithm):
    plain, _ = _counts(tiny_vocab, seed=1, overlap=False)
    spec, stats = _counts(
        tiny_vocab, seed=2, overlap=True, cpu_worker="thread", **_spec(algorithm, tiny_vocab)
    )
    assert stats["spec_accepted_tokens"] > 100, "too few accepted drafts to test their distribution"
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, "drafts always or never right: nothing to test"
    stat, critical = _chi_square(plain, spec)
    assert stat < critical, (stat, critical, plain, spec)
    # the test can fail: with drafts accepted unchecked, the distribution is far past the margin
    monkeypatch.setattr(gapless.engine.spec.device, "accept_lengths", _accept_everything)
    broken, _ = _counts(tiny_vocab, seed=2, overlap=False, **_spec(algorithm, tiny_vocab))
    stat, critical = _chi_square(plain, broken)
    assert stat > critical, (stat, critical)


def test_seeded_requests_are_reproducible(tiny_vocab):
    """A seeded request samples from the same random stream per output step, so with speculation it gets
    the tokens it gets without, alone or in any batch."""
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5, 4], [7]]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_k=8, top_p=0.9, seed=s, ignore_eos=True)
        for s in (5, 6, 7)
    ]
    results = []
    for options in (
        {"overlap": False},
        {"overlap": False, **SPEC},
        {"overlap": True, "cpu_worker": "thread", **SPEC},
        {"overlap": True, "cpu_worker": "thread", **_spec("draft", tiny_vocab)},
    ):
        with LLM(tiny_vocab, device="cpu", kv_cache_tokens=2048, **options) as llm:
            together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            alone = [llm.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
            assert together == alone
            results.append(together)
            llm.check_integrity()
    assert results[0] == results[1] == results[2] == results[3]
