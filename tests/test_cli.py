"""The command line: `gapless chat` through `main`, with its input piped (the server's `gapless serve` is
exercised as a process by tests/server, the README's `make serve` path included)."""

from __future__ import annotations

import io
import sys

from gapless.__main__ import main


def test_chat_subcommand_streams_and_resets(monkeypatch, ckpt_factory, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nhello\n"))
    path = str(ckpt_factory("qwen3"))
    argv = ["chat", "--model", path, "--device", "cpu", "--max-tokens", "5", "--temperature", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    turns = out.split(">>> ")[1:]  # the prompt before each line read, and once more before EOF
    assert len(turns) == 4, out
    assert "history cleared" in turns[1]
    # the same message after /reset gets the same (greedy) reply: the history really was cleared
    assert turns[0].strip() and turns[0] == turns[2], out


def test_serve_refuses_bad_arguments_before_starting_anything(tmp_path, ckpt_factory, capsys):
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["serve", "--model", str(ckpt_factory("qwen3")), "--page-size", "0"]) == 2
    assert "page_size=0" in capsys.readouterr().err
