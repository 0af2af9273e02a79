"""Options chosen for the device at start-up (gapless.engine.defaults): the rule from fake figures, an
explicit value always kept, the choice logged, and the scheduler prefilling with the runner's choice."""

from __future__ import annotations

import logging

import pytest

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine import defaults
from gapless.engine.defaults import apply_device_defaults, choose_chunked_prefill_size

GiB = 2**30


@pytest.mark.parametrize(
    "device_type, memory, size",
    [
        ("cpu", None, 2048),
        ("cpu", 512 * GiB, 2048),  # the CPU's RAM plays no part
        ("cuda", 16 * GiB, 2048),  # T4, RTX 4080
        ("cuda", 24 * GiB, 2048),  # A10, RTX 4090
        ("cuda", 40 * GiB, 4096),  # A100 40GB, L40S
        ("cuda", int(79.2 * GiB), 16384),  # H100 80GB as torch reports it: measured best there
        ("cuda", 139 * GiB, 16384),  # H200
    ],
)
def test_chunked_prefill_size_is_chosen_from_the_device_and_its_memory(device_type, memory, size):
    assert choose_chunked_prefill_size(device_type, memory) == size


def test_an_explicit_value_wins_and_the_choice_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="gapless.engine.defaults")
    given = EngineConfig(model="m", chunked_prefill_size=512)
    assert apply_device_defaults(given, "cuda", 80 * GiB) is given
    assert caplog.messages == []
    chosen = apply_device_defaults(EngineConfig(model="m"), "cuda", 80 * GiB)
    assert chosen.chunked_prefill_size == 16384
    assert caplog.messages == [
        "device defaults: chunked_prefill_size=16384 (chosen for cuda, 80.0 GiB; set it to override)"
    ]
    with pytest.raises(ValueError, match="chunked_prefill_size=0: must be >= 1"):
        EngineConfig(model="m", chunked_prefill_size=0)


def test_the_scheduler_prefills_with_the_budget_the_runner_chose(ckpt_factory, monkeypatch):
    """With the CPU default patched to 16 tokens, a 40-token prompt is prefilled in 3 chunks: the runner's
    choice reaches the scheduler (and RunnerInfo); an explicit 64 prefills it in one."""
    qwen3 = str(ckpt_factory("qwen3"))
    monkeypatch.setattr(defaults, "CPU_CHUNKED_PREFILL_SIZE", 16)
    prompt = list(range(1, 41))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for options, size, batches in (({}, 16, 3), ({"chunked_prefill_size": 64}, 64, 1)):
        with LLM(qwen3, device="cpu", kv_cache_tokens=1024, overlap=False, **options) as llm:
            assert llm.engine.info.chunked_prefill_size == llm.engine.cfg.chunked_prefill_size == size
            llm.generate([prompt], params)
            assert llm.get_stats()["prefill_batches"] == batches
