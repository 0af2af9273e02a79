"""Scoring through the server: `echo` on /v1/completions (OpenAI's legacy logprobs layout, streamed and
not, `max_tokens` 0, string, token-id and batched prompts), vLLM's `prompt_logprobs` on both OpenAI
endpoints, SGLang's logprob options on /generate, /tokenize and /detokenize; logprobs equal transformers'
log-softmax of the same checkpoint; bad values are 400s naming the field, and the server keeps serving,
leaking nothing."""

from __future__ import annotations

import json

import pytest
import torch

from gapless.testing.hf_reference import hf_logits, load_hf_model
from tests.server.conftest import wait_idle_and_clean

TOL = 1e-4
IDS = [[5, 17, 300, 42, 7, 99, 120], [8, 9, 10]]


@pytest.fixture(scope="module")
def hf(ckpt_factory):
    return load_hf_model(ckpt_factory("qwen3"))


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first."""
    lps = hf_logits(hf, ids).log_softmax(-1)
    return lps[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"max_tokens": 1, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_token_id_prompts_with_max_tokens_0(client, hf):
    out = completion(client, prompt=IDS, echo=True, logprobs=2, max_tokens=0)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == sum(map(len, IDS))
    for ids, choice in zip(IDS, out["choices"]):
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"][1:]), ref_logprobs(hf, ids), atol=TOL, rtol=0
        )
        # the top holds the prompt token itself and the 2 most likely
        for token, tok_lp, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[token] == tok_lp and 2 <= len(top) <= 3
        assert choice["text"] == "".join(lp["tokens"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_of_text_with_a_generated_token_and_without_logprobs(client):
    scored = completion(client, prompt="hello world", echo=True, logprobs=1, max_tokens=1, ignore_eos=True)
    choice = scored["choices"][0]
    n_prompt = scored["usage"]["prompt_tokens"]
    plain = completion(client, prompt="hello world", max_tokens=1, ignore_eos=True, logprobs=1)["choices"][0]
    assert choice["text"] == "hello world" + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == n_prompt + 1 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0], abs=TOL)
    assert lp["text_offset"][-1] == len("hello world")  # the generated token follows the echoed prompt
    bare = completion(client, prompt="hello world", echo=True, max_tokens=2, ignore_eos=True)["choices"][0]
    assert bare["logprobs"] is None and bare["text"].startswith("hello world")


def test_echo_streamed_equals_whole(client):
    body = {
        "prompt": IDS[0],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 3,
        "ignore_eos": True,
        "temperature": 0,
    }
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    text, token_logprobs = "", []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    token_logprobs += (c["logprobs"] or {}).get("token_logprobs", [])
    assert text == whole["text"]
    assert token_logprobs == whole["logprobs"]["token_logprobs"]


def test_prompt_logprobs_on_both_endpoints(client, hf):
    out = completion(client, prompt=IDS[0], prompt_logprobs=1)
    got = out["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(IDS[0])
    ref = ref_logprobs(hf, IDS[0])
    for pos in range(1, len(IDS[0])):
        entry = got[pos][str(IDS[0][pos])]
        assert entry["logprob"] == pytest.approx(float(ref[pos - 1]), abs=TOL) and entry["rank"] >= 1
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    plp = chat.json()["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])
    assert len(plp) == chat.json()["usage"]["prompt_tokens"]


def test_generate_returns_sglang_logprobs(client, hf):
    body = {
        "input_ids": IDS[0],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    ref = ref_logprobs(hf, IDS[0])
    assert [t for _, t, _ in meta["input_token_logprobs"]] == IDS[0][3:]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"]]), ref[2:], atol=TOL, rtol=0
    )
    assert all(len(top) == 2 for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == 2 and len(meta["output_top_logprobs"][0]) == 2
    first = client.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    assert first["input_token_logprobs"][0][0] is None and len(first["input_token_logprobs"]) == len(IDS[0])
    past = client.post("/generate", json={**body, "logprob_start_len": 2**62}).json()["meta_info"]
    assert past["input_token_logprobs"] == [] and len(past["output_token_logprobs"]) == 2


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200, r.text
    tok = r.json()
    usage = completion(client, prompt="hello world")["usage"]
    assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"] and tok["max_model_len"] == 512
    back = client.post("/detokenize", json={"tokens": tok["tokens"]})
    assert back.status_code == 200 and "hello world" in back.json()["prompt"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1


BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1.5}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1000}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "3"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [5] * 600, "echo": True, "logprobs": 1}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 600, "echo": True, "max_tokens": 0}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 99},
        "prompt_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1000},
        "top_logprobs",
    ),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_scoring_values_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert completion(client, prompt=IDS[1], echo=True, logprobs=1)["choices"][0]["logprobs"]["tokens"]


def test_nothing_leaked(client):
    wait_idle_and_clean(client)
