"""max_model_len above the model's own context length: refused by name before anything loads (offline and
`gapless serve`), or, with GAPLESS_ALLOW_LONG_MAX_MODEL_LEN=1, accepted with a warning and really used."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine import runner as runner_module
from gapless.engine.preflight import ALLOW_LONG_MAX_MODEL_LEN_ENV, check_engine_config
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model

TINY_CONTEXT = 1024  # the tiny checkpoints' max_position_embeddings


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


def test_too_long_max_model_len_is_refused_before_weights_load(qwen3, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the options were checked")

    monkeypatch.setattr(runner_module, "load_model", no_loading)
    for make in (
        lambda: check_engine_config(EngineConfig.from_kwargs(qwen3, max_model_len=TINY_CONTEXT + 1)),
        lambda: LLM(qwen3, device="cpu", max_model_len=4096),
    ):
        with pytest.raises(
            ValueError, match=r"max_model_len=\d+ is more than the model's context length"
        ) as e:
            make()
        assert f"max_position_embeddings={TINY_CONTEXT}" in str(e.value)
        assert ALLOW_LONG_MAX_MODEL_LEN_ENV in str(e.value)
    # at or below the model's length is fine, and "0" does not allow
    assert (
        check_engine_config(EngineConfig(qwen3, max_model_len=TINY_CONTEXT))[0].max_model_len == TINY_CONTEXT
    )
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0")
    with pytest.raises(ValueError, match="more than the model's context length"):
        check_engine_config(EngineConfig(qwen3, max_model_len=TINY_CONTEXT + 1))


def test_allowed_long_max_model_len_warns_and_runs_past_the_model_length(qwen3, monkeypatch, caplog):
    """Allowed, the context really is max_model_len (it used to be cut to the model's silently): a prompt
    longer than max_position_embeddings runs, with RoPE past the trained positions computed as
    transformers computes them."""
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    caplog.set_level(logging.WARNING, logger="gapless.engine.preflight")
    prompt = [(7 * i) % 500 + 3 for i in range(TINY_CONTEXT + 100)]
    with LLM(qwen3, device="cpu", max_model_len=TINY_CONTEXT + 200, kv_cache_tokens=2048) as llm:
        assert llm.engine.max_context == TINY_CONTEXT + 200
        out = llm.generate(
            [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        llm.check_integrity()
    assert any("allowed by GAPLESS_ALLOW_LONG_MAX_MODEL_LEN=1" in m for m in caplog.messages)
    check_greedy(out[0].token_ids, hf_greedy(load_hf_model(qwen3), prompt, 4))


@pytest.mark.slow  # (~9 s: a `gapless serve` process)
def test_serve_refuses_it_in_one_line_before_starting_workers(qwen3, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gapless",
            "serve",
            "--model",
            qwen3,
            "--max-model-len",
            "5000",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("gapless: max_model_len=5000 is more than the model's context length")
    assert "max_position_embeddings=1024" in lines[-1]
    assert "Traceback" not in done.stderr
