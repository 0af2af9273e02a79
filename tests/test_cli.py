"""`python -m gapless serve` (the README's `make serve`) runs its offline generation on the default model."""

from __future__ import annotations

from gapless.__main__ import main


def test_serve_runs_an_offline_generation(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GAPLESS_CACHE", str(tmp_path))  # the default model is built here, not in ~
    assert main(["serve", "--device", "cpu", "--max-tokens", "3", "--disable-overlap"]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen3" in out and "(3 tokens, length)" in out
    assert (tmp_path / "models").is_dir()
