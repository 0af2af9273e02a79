"""KV sizing from explicit figures: on the GPU under a foreign allocation (fake numbers, no GPU needed),
and on the CPU a fixed size that does not move with the free RAM, checked against it, and logged."""

from __future__ import annotations

import logging

import pytest

from gapless import LLM
from gapless.engine import runner as runner_module
from gapless.engine.memory_plan import DEFAULT_CPU_KV_GIB, plan_cpu_kv, plan_gpu_kv

GiB = 2**30
MiB = 2**20
QWEN3_TINY_KV_BYTES = 1024  # 2 layers x (K + V) x 2 kv heads x head_dim 32 x 4 bytes (float32)


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


# ---------------------------------------------------------------------------------------------- GPU


def test_gpu_plan_counts_only_what_gapless_holds_against_the_static_share():
    """An 80 GiB GPU where this process already holds a 60 GiB tensor when the runner starts; the runner
    adds 2 GiB of weights. The static share is 85% of 80 GiB less gapless's own 2 GiB, far from binding;
    the foreign 60 GiB is not free, so the free memory bounds the pool. Counting the process's 62 GiB as
    gapless's would have left the static share 6 GiB, less than the memory that is really free."""
    free = 80 * GiB - 62 * GiB - 512 * MiB  # the CUDA context takes some too
    plan = plan_gpu_kv(
        total=80 * GiB,
        free=free,
        allocated=62 * GiB,
        allocated_before=60 * GiB,
        activation_peak=GiB,
        graph_bytes=512 * MiB,
        mem_fraction_static=0.85,
        bytes_per_token=64 * 1024,
        reserve=512 * MiB,
    )
    assert plan.resident == 2 * GiB and plan.foreign == 60 * GiB
    assert plan.static_limit == int(80 * GiB * 0.85) - 2 * GiB
    assert plan.tokens == (free - GiB - 512 * MiB - 512 * MiB) // (64 * 1024)
    assert plan.tokens * 64 * 1024 > 15 * GiB
    line = plan.describe()
    assert line.startswith("limited by free memory")
    assert "less 2.00 GiB gapless holds (not the 60.00 GiB others hold)" in line


def test_gpu_plan_static_share_still_binds_on_an_empty_gpu():
    plan = plan_gpu_kv(
        total=80 * GiB,
        free=70 * GiB,
        allocated=10 * GiB,
        activation_peak=GiB,
        graph_bytes=0,
        mem_fraction_static=0.5,
        bytes_per_token=1,
        reserve=0,
    )
    assert plan.tokens == 30 * GiB and plan.foreign == 0
    assert plan.describe().startswith("limited by mem_fraction_static")


# ---------------------------------------------------------------------------------------------- CPU


def test_cpu_plan_is_a_fixed_size_whatever_ram_is_free():
    kw = dict(most_tokens=10**9, bytes_per_token=QWEN3_TINY_KV_BYTES)
    sizes = {plan_cpu_kv(memory_gib=None, available=ram * GiB, **kw).tokens for ram in (9, 21, 120)}
    assert sizes == {int(DEFAULT_CPU_KV_GIB * GiB) // QWEN3_TINY_KV_BYTES}
    given = {plan_cpu_kv(memory_gib=1.5, available=ram * GiB, **kw).tokens for ram in (2, 21, 120)}
    assert given == {int(1.5 * GiB) // QWEN3_TINY_KV_BYTES}
    plan = plan_cpu_kv(memory_gib=None, available=21 * GiB, **kw)
    assert plan.capped_by is None and plan.describe() == "kv_cache_memory_gib=4 (the default)"


def test_cpu_plan_never_exceeds_what_rows_can_use_or_ram_holds():
    rows = plan_cpu_kv(memory_gib=None, available=21 * GiB, most_tokens=1000, bytes_per_token=1024)
    assert rows.tokens == 1000 and rows.capped_by == "rows"
    assert "capped at what max_running_requests rows" in rows.describe()
    # the default on a machine with 3 GiB available: cut to half of it, and said so
    tight = plan_cpu_kv(memory_gib=None, available=3 * GiB, most_tokens=10**9, bytes_per_token=1024)
    assert tight.tokens == int(1.5 * GiB) // 1024 and tight.capped_by == "ram"
    assert "cut to 50% of the 3.0 GiB of available RAM" in tight.describe()
    # a size the user asked for that cannot fit is an error naming both
    with pytest.raises(ValueError, match=r"kv_cache_memory_gib=8: .*8.00 GiB does not fit in the 3.00 GiB"):
        plan_cpu_kv(memory_gib=8, available=3 * GiB, most_tokens=10**9, bytes_per_token=1024)


@pytest.mark.parametrize("options", [{}, {"kv_cache_memory_gib": 0.125}], ids=["default", "given"])
def test_two_engines_get_the_same_pool_whatever_ram_is_free(qwen3, monkeypatch, options):
    """The same command twice, once on a busy machine (0.6 GiB available) and once on an idle one: the
    same KV pool (the old rule, 30% of the free RAM, gave 184 MiB and then 256 MiB for the default)."""
    tokens = []
    for ram in (0.6 * GiB, 64 * GiB):
        monkeypatch.setattr(runner_module, "available_ram", lambda ram=ram: int(ram))
        with LLM(qwen3, device="cpu", **options) as llm:
            tokens.append(llm.engine.info.kv_tokens)
    assert tokens[0] == tokens[1]
    # the default: every row of the tiny model's context (256 x 1024 tokens, 256 MiB) fits in 4 GiB
    assert tokens[0] == (256 * 1024 if not options else int(0.125 * GiB) // QWEN3_TINY_KV_BYTES)


def test_cpu_pool_size_and_why_are_logged_and_checked(qwen3, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="gapless.engine.runner")
    monkeypatch.setattr(runner_module, "available_ram", lambda: 64 * GiB)
    with LLM(qwen3, device="cpu", max_running_requests=4, max_model_len=512) as llm:
        assert llm.engine.info.kv_tokens == 4 * 512
    assert (
        "KV cache: 2048 tokens (float32, 1024 B/token), 0.00195 GiB, max context 512 (kv_cache_memory_gib=4 "
        "(the default), capped at what max_running_requests rows of the max context can use)"
    ) in caplog.messages
    # the default does not fit in 0.2 GiB: it is cut, with a warning
    monkeypatch.setattr(runner_module, "available_ram", lambda: GiB // 5)
    with LLM(qwen3, device="cpu") as llm:
        assert llm.engine.info.kv_tokens == (GiB // 10) // QWEN3_TINY_KV_BYTES
    assert any(r.levelno == logging.WARNING and "cut to 50%" in r.getMessage() for r in caplog.records)
    # a size asked for that does not fit is refused before the engine starts
    monkeypatch.setattr(runner_module, "available_ram", lambda: GiB // 20)
    with pytest.raises(ValueError, match="kv_cache_memory_gib=0.25: .* does not fit in the 0.05 GiB"):
        LLM(qwen3, device="cpu", kv_cache_memory_gib=0.25)


def test_kv_cache_memory_gib_must_be_positive():
    from gapless.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        EngineConfig(model="m", kv_cache_memory_gib=0)
