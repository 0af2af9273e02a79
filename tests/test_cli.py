"""The command line: `gapless chat` through `main` (the server's `gapless serve` is exercised as a
process by tests/server, the README's `make serve` path included)."""

from __future__ import annotations

import builtins

from gapless.__main__ import main


def test_chat_subcommand_streams_and_resets(monkeypatch, ckpt_factory, capsys):
    lines = iter(["hello", "/reset", "hello"])

    def fake_input(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    path = str(ckpt_factory("qwen3"))
    argv = ["chat", "--model", path, "--device", "cpu", "--max-tokens", "5", "--temperature", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "history cleared" in out
    # the same message after /reset gets the same (greedy) reply: the history really was cleared
    lines = [line for line in out.splitlines()[1:] if line.strip()]  # after the banner
    assert len(lines) == 3 and lines[1] == "(history cleared)", out
    assert lines[0] == lines[2] and lines[0], out
