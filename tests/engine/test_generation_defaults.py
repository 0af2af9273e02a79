"""Sampling defaults from the checkpoint (its generation_config.json, or a GGUF's general.sampling.*):
a request's unset knobs take them, explicit values win (the library's default values included), and
generation_config="vllm" ignores them; resolved once, where the engine queues a request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gapless import LLM, SamplingParams
from gapless.chat import add_chat_args, sampling_from_args
from gapless.config import EngineConfig
from gapless.engine.preflight import check_engine_config
from gapless.model.generation_config import generation_defaults
from gapless.testing.gguf_files import write_gguf

# what the checkpoint below ships: each differs from the library's default
CHECKPOINT = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "repetition_penalty": 1.3}
LIBRARY = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
PROMPT = [7, 8, 9, 10]


def with_generation_config(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of the checkpoint `src` whose generation_config.json also holds `fields`."""
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    return dst


@pytest.fixture(scope="module")
def ckpt(ckpt_factory, tmp_path_factory) -> Path:
    return with_generation_config(
        ckpt_factory("qwen3"), tmp_path_factory.mktemp("gen") / "qwen3", **CHECKPOINT
    )


def knobs(p: SamplingParams) -> dict[str, float | int | None]:
    return {name: getattr(p, name) for name in LIBRARY}


def sample(llm: LLM, **params: object) -> list[int]:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
    return out[0].token_ids


def test_the_tiny_test_checkpoints_ship_no_sampling_defaults(ckpt_factory):
    # so no other test samples with anything but what it asks for
    for arch in ("qwen3", "llama"):
        assert generation_defaults(ckpt_factory(arch)) == {}


def test_unset_knobs_take_the_checkpoint_defaults_and_explicit_ones_win(ckpt):
    with LLM(str(ckpt), device="cpu", kv_cache_tokens=512) as llm:
        engine = llm.engine
        assert engine.sampling_defaults == CHECKPOINT
        assert knobs(llm.get_default_sampling_params()) == {**CHECKPOINT, "min_p": 0.0}
        unset = engine.add_request(PROMPT, SamplingParams(max_tokens=2))
        assert knobs(unset.params) == {**CHECKPOINT, "min_p": 0.0}  # min_p: the checkpoint has none
        # explicit values equal to the library's defaults are explicit all the same
        explicit = engine.add_request(PROMPT, SamplingParams(max_tokens=2, **LIBRARY))
        assert knobs(explicit.params) == LIBRARY
        mixed = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=1.0))
        assert knobs(mixed.params) == {**CHECKPOINT, "min_p": 0.0, "temperature": 1.0}
        while engine.has_unfinished():
            engine.step()
        # what it samples: the checkpoint's knobs, seeded, are what a request without them samples
        assert sample(llm, seed=11) == sample(llm, seed=11, **CHECKPOINT)
        assert sample(llm, seed=11) != sample(llm, seed=11, **LIBRARY)
        # a bad explicit value is still refused by name, and the engine goes on
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0.0)
        assert sample(llm, temperature=0.0) == sample(llm, temperature=0.0, top_k=-1, top_p=1.0)


def test_generation_config_vllm_ignores_the_checkpoint(ckpt):
    with LLM(str(ckpt), device="cpu", kv_cache_tokens=512, generation_config="vllm") as llm:
        assert llm.engine.sampling_defaults == {}
        assert knobs(llm.engine.add_request(PROMPT, SamplingParams(max_tokens=1)).params) == LIBRARY
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert sample(llm, seed=11) == sample(llm, seed=11, **LIBRARY)


def test_a_folder_of_defaults_where_temperature_zero_makes_unset_requests_greedy(ckpt, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 0}))
    assert generation_defaults(ckpt, str(tmp_path)) == {"temperature": 0.0, "top_k": -1}  # 0: off
    with LLM(str(ckpt), device="cpu", kv_cache_tokens=512, generation_config=str(tmp_path)) as llm:
        greedy = sample(llm, temperature=0.0)
        assert sample(llm, seed=3) == greedy  # unset: the folder's temperature 0, greedy
        assert sample(llm, seed=3, temperature=1.0) != greedy  # explicit 1.0 (the library's): sampled
        # LLM.chat queues through the same engine: an unset temperature is greedy there too
        chat = [{"role": "user", "content": "hi"}]
        replies = [llm.chat(chat, SamplingParams(max_tokens=8, seed=s), use_tqdm=False)[0] for s in (1, 2)]
        assert replies[0].token_ids == replies[1].token_ids


def test_bad_checkpoint_defaults_and_a_folder_without_the_file_are_one_line_before_loading(ckpt, tmp_path):
    bad = with_generation_config(ckpt, tmp_path / "bad", top_p=0.0)
    with pytest.raises(ValueError, match=r"generation_config\.json.*top_p.*--generation-config vllm"):
        check_engine_config(EngineConfig(str(bad), device="cpu"))
    check_engine_config(EngineConfig(str(bad), device="cpu", generation_config="vllm"))  # ignored: fine
    with pytest.raises(ValueError, match="generation_config=.*auto, vllm, or a folder"):
        check_engine_config(EngineConfig(str(ckpt), device="cpu", generation_config=str(tmp_path / "none")))


def test_a_gguf_carries_the_defaults_as_general_sampling_metadata(ckpt, ckpt_factory, tmp_path):
    path = write_gguf(ckpt, tmp_path / "tiny.gguf", "Q8_0")
    assert generation_defaults(path) == pytest.approx(CHECKPOINT)  # float32 in the file
    assert generation_defaults(path, "vllm") == {}
    plain = write_gguf(ckpt_factory("qwen3"), tmp_path / "plain.gguf", "Q8_0")
    assert generation_defaults(plain) == {}  # as most GGUF files, the default model's included


def test_gapless_chat_leaves_the_knobs_unset_unless_given():
    import argparse

    parser = add_chat_args(argparse.ArgumentParser())
    params = sampling_from_args(parser.parse_args(["--model", "m"]))
    assert {"temperature", "top_p", "top_k"} <= set(params.unset)
    params = sampling_from_args(parser.parse_args(["--model", "m", "--temperature", "1.0"]))
    assert params.temperature == 1.0 and "temperature" not in params.unset
