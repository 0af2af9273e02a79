"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming the field for every bad value."""

import math

import pytest

from gapless.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    # the knobs a checkpoint may default are unset until the engine resolves them; without checkpoint
    # defaults they resolve to vLLM's
    p = SamplingParams().resolved()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.seed is None and p.skip_special_tokens is True
    assert not p.greedy and not p.has_penalties


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=("a",)).stop == ["a"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_numbers_are_coerced() -> None:
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", None),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "0.7"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_p", "1"),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 3.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", math.nan),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", 7),
        ("seed", 1.5),
        ("seed", "42"),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
    ],
)
def test_bad_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1e-6),
        dict(top_k=1),
        dict(min_p=1.0),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(seed=-5),
        dict(seed=2**70),
        dict(max_tokens=1),
        dict(logprobs=0),
        dict(logprobs=20),
    ],
)
def test_edge_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


def test_greedy_and_has_penalties() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1, temperature=1.5).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_unset_knobs_are_none_and_resolve_checkpoint_then_library_defaults() -> None:
    p = SamplingParams(temperature=None, top_k=5)  # None is "unset", not a bad value
    assert p.unset == ("temperature", "top_p", "min_p", "repetition_penalty")
    assert p.temperature is None and not p.greedy and not p.has_penalties  # as the library's defaults
    checkpoint = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.3}
    r = p.resolved(checkpoint)
    assert (r.temperature, r.top_k, r.top_p, r.min_p, r.repetition_penalty) == (0.6, 5, 1.0, 0.0, 1.3)
    assert r.unset == () and r.has_penalties and p.temperature is None  # a copy; p stays unset
    # an explicit value equal to the library's default is still explicit: the checkpoint's does not win
    explicit = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    assert explicit.resolved(checkpoint) is explicit
    # dataclasses.replace keeps what was unset unset, and an explicit replacement wins
    from dataclasses import replace

    assert replace(p, seed=3).resolved(checkpoint).temperature == 0.6
    assert replace(p, temperature=1.0).resolved(checkpoint).temperature == 1.0
