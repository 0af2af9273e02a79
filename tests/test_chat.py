"""`gapless chat`: scripted conversations with the tiny model, greedy, a few tokens per reply."""

from __future__ import annotations

import argparse

import pytest

from gapless.chat import ChatSession, add_chat_args, chat_main, end_of_turn_ids, run_chat
from gapless.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return str(ckpt_factory("qwen3"))


def make_engine(model: str, **kw) -> Engine:
    options = dict(device="cpu", cpu_worker="inline", overlap=False, kv_cache_tokens=2048)
    return Engine(EngineConfig.from_kwargs(model, **{**options, **kw}))


@pytest.fixture(scope="module")
def engine(model):
    engine = make_engine(model)
    yield engine
    engine.shutdown()


class Script:
    """Feeds `lines` to the chat one per prompt, then end of input; records what was written between
    prompts (one segment per prompt) and every request the chat queued meanwhile."""

    def __init__(self, lines: list[str], queued: list) -> None:
        self.lines, self.segments, self.prompts = list(lines), [[]], []
        self._queued, self._since = queued, len(queued)

    @property
    def reqs(self) -> list:
        return self._queued[self._since :]

    def input(self, prompt: str) -> str:
        self.prompts.append(prompt)
        self.segments.append([])
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)

    def write(self, text: str) -> None:
        self.segments[-1].append(text)

    def replies(self) -> list[str]:
        return ["".join(seg) for seg in self.segments[1:]]


@pytest.fixture()
def script(engine, monkeypatch):
    """Makes Scripts; the engine records the requests queued during the test."""
    queued, add = [], engine.add_request

    def recording_add(*a, **kw):
        queued.append(add(*a, **kw))
        return queued[-1]

    monkeypatch.setattr(engine, "add_request", recording_add)
    return lambda lines: Script(lines, queued)


def test_chat_streams_keeps_history_and_resets(engine, script):
    s = script(["hello there", "and café?", "/reset", "hello there"])
    session = run_chat(engine, GREEDY, input_fn=s.input, write=s.write)
    assert len(s.prompts) == 5  # four lines, then end of input: a clean exit
    first, second, third = s.reqs
    replies = s.replies()
    # what streamed is exactly the engine's own decode of each reply (plus the newline after it)
    assert replies[0] == engine.output_text(first) + "\n"
    assert replies[1] == engine.output_text(second) + "\n"
    assert replies[2] == "(history cleared)\n"
    assert replies[3] == engine.output_text(third) + "\n"
    assert replies[4] == "\n"  # end of input leaves the terminal on a fresh line
    assert all(r.finished and len(r.output_ids) >= 1 for r in s.reqs)
    # history grows: the second prompt holds the first exchange, reply included
    tok = engine.tokenizer
    second_prompt = tok.decode(second.prompt_ids)
    assert "hello there" in second_prompt and engine.output_text(first) in second_prompt
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert len(second.prompt_ids) > len(first.prompt_ids) + len(first.output_ids) // 2
    # /reset: the prompt is back to one message, and greedy gives the same reply again
    assert third.prompt_ids == first.prompt_ids
    assert engine.output_text(third) == engine.output_text(first)
    assert session.messages == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": engine.output_text(third)},
    ]
    assert not engine.has_unfinished()


def test_exit_commands_and_blank_lines(engine, script):
    s = script(["", "   ", "/help", "hi", "/exit", "never read"])
    session = run_chat(engine, GREEDY, input_fn=s.input, write=s.write)
    assert s.lines == ["never read"]
    assert len(s.reqs) == 1 and len(session.messages) == 2
    assert "/reset" in "".join(s.replies())  # the help text
    s = script(["/quit"])
    assert run_chat(engine, GREEDY, input_fn=s.input, write=s.write).messages == []
    assert s.reqs == []


def test_system_prompt_survives_reset(engine, script):
    s = script(["hi", "/reset"])
    session = run_chat(engine, GREEDY, input_fn=s.input, write=s.write, system="Be brief.")
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    assert "Be brief." in engine.tokenizer.decode(s.reqs[0].prompt_ids)


def test_stop_strings_cut_the_reply_and_history(engine, script):
    # learn the greedy reply, then stop on a piece of it: the shown reply ends right before that piece
    s = script(["tell me"])
    run_chat(engine, SamplingParams(max_tokens=12, temperature=0.0), input_fn=s.input, write=s.write)
    full = engine.output_text(s.reqs[0])
    assert len(full) >= 4
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
    s = script(["tell me"])
    session = run_chat(engine, params, input_fn=s.input, write=s.write)
    (req,) = s.reqs
    assert req.finish_reason == "stop" and req.stop_str_hit == stop
    assert s.replies()[0] == engine.output_text(req) + "\n" == full[: full.find(stop)] + "\n"
    assert session.messages[-1]["content"] == full[: full.find(stop)]


def test_end_of_turn_token_stops_the_reply(engine):
    tok = engine.tokenizer
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    session = ChatSession(engine, GREEDY)
    assert tok.convert_tokens_to_ids("<|im_end|>") in session.params.stop_token_ids
    assert GREEDY.stop_token_ids == []  # the caller's params are left alone


def test_conversation_too_long_reports_and_keeps_history(model):
    engine = make_engine(model, max_model_len=64, kv_cache_tokens=256)
    try:
        lines = ["hi", "tell me a long story about the sea " * 6, "ok"]
        out, fed = [], iter(lines)

        def read(prompt):
            try:
                return next(fed)
            except StopIteration:
                raise EOFError from None

        session = run_chat(engine, GREEDY, input_fn=read, write=out.append)
        text = "".join(out)
        assert "error: prompt is" in text and "/reset" in text
        # the long message was dropped, the others kept
        assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hi", "ok"]
    finally:
        engine.shutdown()


def test_chat_main_from_command_line_args(model):
    parser = add_chat_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", model, "--device", "cpu", "--disable-overlap", "--cpu-worker", "inline"]
        + ["--kv-cache-tokens", "1024", "--temperature", "0", "--max-tokens", "4"]
    )
    lines, out = ["hello", "/reset", "hello"], []

    def read(prompt):
        if not lines:
            raise EOFError
        return lines.pop(0)

    assert chat_main(args, input_fn=read, write=out.append) == 0
    text = "".join(out)
    assert text.startswith("gapless chat: " + model)
    assert "(history cleared)" in text
    body = text.split("\n", 1)[1]
    first, second = body.split("(history cleared)\n")
    assert first + "\n" == second  # same greedy reply after the reset; the final newline is EOF's
    assert parser.parse_args(["--stop", "a", "--stop", "b"]).stop == ["a", "b"]
    bad = parser.parse_args(["--model", model, "--temperature", "-1"])
    assert chat_main(bad, input_fn=read, write=out.append) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_ctrl_c_stops_the_reply_between_steps_and_the_chat_goes_on(model, overlap):
    """Ctrl-C while a reply streams ends that reply (finish reason "abort") without interrupting an
    engine step, so the engine stays whole and the next message is answered."""
    import os
    import signal

    engine = make_engine(model, overlap=overlap, cpu_worker="thread" if overlap else "inline")
    try:
        session = ChatSession(engine, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        shown: list[str] = []
        launch, launches = engine.scheduler.launch, []

        def launch_and_press_ctrl_c(batch):  # the user presses Ctrl-C in the middle of a step
            launches.append(batch)
            if len(launches) == 4:
                os.kill(os.getpid(), signal.SIGINT)
            return launch(batch)

        engine.scheduler.launch = launch_and_press_ctrl_c
        turn = session.send("tell me a long story", shown.append)
        engine.scheduler.launch = launch
        assert turn.finish_reason == "abort"
        assert 0 < len(turn.output_ids) < 200
        assert turn.text == "".join(shown)
        assert not engine.broken
        again = session.send("and another", lambda s: None)
        assert again.finish_reason == "length" and len(again.output_ids) == 200
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_images_go_with_the_first_message_and_again_after_reset(tmp_path, model, capsys):
    """`gapless chat --image A --image B` on a tiny LLaVA: both images go with the first message and stay
    in the history (the second turn reuses their KV from the prefix cache), the reply equals `LLM.chat`'s
    for the same message, and /reset sends them again; a missing file or a text model exits 2 at once."""
    import numpy as np
    from PIL import Image

    from gapless import LLM
    from gapless.testing.vision_checkpoints import make_llava_checkpoint

    ckpt = str(make_llava_checkpoint(tmp_path / "llava"))
    paths = []
    for seed, (h, w) in enumerate([(40, 70), (90, 30)]):
        pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
        paths.append(str(tmp_path / f"im{seed}.png"))
        Image.fromarray(pixels).save(paths[-1])
    engine = make_engine(ckpt)
    queued, add = [], engine.add_request
    engine.add_request = lambda *a, **kw: queued.append(add(*a, **kw)) or queued[-1]
    try:
        s = Script(["Describe", "more?", "/reset", "Describe"], queued)
        session = run_chat(engine, GREEDY, input_fn=s.input, write=s.write, images=paths)
        first, second, third = s.reqs
        assert len(first.images) == len(second.images) == len(third.images) == 2
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
        assert second.cached_tokens >= first.images[1].start + first.images[1].length  # both images hit
        assert third.prompt_ids == first.prompt_ids and third.output_ids == first.output_ids
        assert [p["type"] for p in session.messages[0]["content"]] == ["image", "image", "text"]
        reply = engine.output_text(first)
    finally:
        engine.shutdown()
    parts = [{"type": "image", "image": p} for p in paths] + [{"type": "text", "text": "Describe"}]
    with LLM(ckpt, device="cpu", kv_cache_tokens=2048) as llm:
        assert llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0].text == reply

    parser = add_chat_args(argparse.ArgumentParser())
    for argv, said in [
        ([ckpt, "--image", paths[0], "--image", str(tmp_path / "none.png")], "none.png: cannot read"),
        ([model, "--image", paths[0]], "is a text model, it takes no images"),
    ]:
        assert chat_main(parser.parse_args([*argv, "--device", "cpu"]), input_fn=input) == 2
        assert said in capsys.readouterr().err
