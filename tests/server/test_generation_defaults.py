"""The server samples a request's unset knobs with the checkpoint's defaults (its generation_config.json),
says so at start-up, and lets explicit values win, the library's default values included: a field absent
from the body stays unset all the way to the engine, on the OpenAI endpoints and the native one."""

from __future__ import annotations

import httpx
import openai
import pytest

from gapless.testing.server import ServerProcess
from tests.engine.test_generation_defaults import CHECKPOINT, LIBRARY, with_generation_config

EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(ckpt_factory, tmp_path_factory):
    path = with_generation_config(
        ckpt_factory("qwen3"), tmp_path_factory.mktemp("gen") / "qwen3", **CHECKPOINT
    )
    srv = ServerProcess("--model", str(path), "--device", "cpu", "--kv-cache-tokens", "4096")
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_the_start_up_log_names_the_checkpoint_defaults(server):
    line = (
        "generation defaults from the checkpoint: temperature=0.5, top_p=0.9, top_k=3, repetition_penalty=1.3"
    )
    assert f"{line}; --generation-config vllm to ignore" in server.output


def test_a_request_without_knobs_samples_with_the_checkpoint_defaults(oai):
    def complete(**knobs: float) -> str:
        out = oai.completions.create(
            model=oai.models.list().data[0].id,
            prompt="The quick brown fox",
            max_tokens=12,
            seed=5,
            extra_body={**EXTRA, **knobs},  # temperature and top_p too: absent unless given
        )
        return out.choices[0].text

    unset = complete()
    assert unset == complete(**CHECKPOINT)
    assert unset != complete(**LIBRARY)  # explicit values equal to the library's defaults win


def test_chat_and_the_native_endpoint_too_and_bad_values_are_still_refused(server, oai):
    model = oai.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me a story"}]

    def chat(**knobs: float) -> str | None:
        out = oai.chat.completions.create(
            model=model, messages=messages, max_tokens=10, seed=9, extra_body={**EXTRA, **knobs}
        )
        return out.choices[0].message.content

    assert chat() == chat(**CHECKPOINT)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert chat() == chat(**CHECKPOINT)  # and the server goes on

    def generate(**knobs: float) -> list[int]:
        body = {
            "input_ids": [7, 8, 9],
            "sampling_params": {"max_new_tokens": 10, "seed": 4, **EXTRA, **knobs},
        }
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert generate() == generate(**CHECKPOINT)
    assert generate() != generate(**LIBRARY)
