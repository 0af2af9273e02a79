"""The tokenizer worker's part, without sockets: one HTTP request's prompts become a SchedReq per prompt
and choice, or one Refused for the whole request; text that cannot fit is refused without being
tokenized, and a chat to a model without a chat template is refused by name."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gapless.sampling_params import SamplingParams
from gapless.server import protocol as P
from gapless.server.workers.tokenizer import PromptTokenizer


@pytest.fixture(scope="module")
def path(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def worker(path):
    return PromptTokenizer(AutoTokenizer.from_pretrained(path))


def request(*prompts: P.PromptIn, n: int = 1, max_prompt_tokens: int = 50, kwargs=None) -> P.TokenizeReq:
    rids = [f"r{i}" for i in range(len(prompts) * n)]
    return P.TokenizeReq(
        rids, list(prompts), [SamplingParams(seed=j) for j in range(n)], max_prompt_tokens, kwargs
    )


def chat(text: str) -> P.PromptIn:
    return P.PromptIn(messages=[P.ChatMessage("user", text)])


def test_every_prompt_and_choice_becomes_a_sched_req(worker):
    out = worker.handle(request(P.PromptIn(text="hello"), P.PromptIn(token_ids=[5, 6]), chat("hi"), n=2))
    assert all(isinstance(m, P.SchedReq) for m in out)
    assert [m.rid for m in out] == [f"r{i}" for i in range(6)]
    assert [m.params.seed for m in out] == [0, 1] * 3
    assert out[0].prompt_ids == out[1].prompt_ids == worker.tokenizer.encode("hello")
    assert out[2].prompt_ids == [5, 6]
    assert worker.tokenizer.decode(out[4].prompt_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("bad", [P.PromptIn(text="word " * 60), chat("word " * 60)])
def test_one_bad_prompt_refuses_the_whole_request(worker, bad):
    [refused] = worker.handle(request(P.PromptIn(text="hi"), bad, n=2))
    assert isinstance(refused, P.Refused)
    assert refused.rids == ["r0", "r1", "r2", "r3"] and refused.status == 400
    assert refused.param == ("messages" if bad.messages else "prompt")


def test_text_that_cannot_fit_is_refused_without_being_tokenized(path, monkeypatch):
    worker = PromptTokenizer(AutoTokenizer.from_pretrained(path))
    longest = max(worker.tokenizer.get_vocab(), key=len)
    assert worker.max_token_chars == len(longest)
    # the bound refuses nothing that fits: the longest token repeated up to the limit is tokenized
    [ok] = worker.handle(request(P.PromptIn(text=longest * 50)))
    assert isinstance(ok, P.SchedReq) and len(ok.prompt_ids) == 50
    calls = []
    monkeypatch.setattr(worker.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    limit = worker.max_chars(50)
    for prompt in (P.PromptIn(text="x" * (limit + 1)), chat("x" * limit)):
        [refused] = worker.handle(request(prompt))
        assert isinstance(refused, P.Refused) and "not tokenized" in refused.message, refused
    assert not calls


def test_a_chat_to_a_model_without_a_chat_template_is_refused_by_name(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = None
    [refused] = PromptTokenizer(tokenizer).handle(request(chat("hi")))
    assert isinstance(refused, P.Refused) and refused.param == "messages"
    assert "no chat template" in refused.message and "/v1/completions" in refused.message


def test_chat_template_kwargs_may_not_set_the_template_call_s_own_arguments(worker):
    for key in ("tokenize", "add_generation_prompt", "messages", "chat_template"):
        [refused] = worker.handle(request(chat("hi"), kwargs={key: True}))
        assert isinstance(refused, P.Refused) and refused.param == "chat_template_kwargs", key
    [ok] = worker.handle(request(chat("hi"), kwargs={"enable_thinking": False}))
    assert isinstance(ok, P.SchedReq)
