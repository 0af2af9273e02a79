"""Smoke test of the detokenizer benchmark: every mode times its steps and streams the same text."""

from __future__ import annotations

from gapless.bench import detokenize


def test_detokenize_bench_times_every_mode_and_their_texts_agree(capsys):
    res = detokenize.main(["--requests", "5", "--steps", "40", "--tokens-per-step", "2", "--rounds", "1"])
    assert res["texts_identical"]
    assert set(res["median_ms_per_step"]) == set(detokenize.MODES)
    assert all(ms > 0 for ms in res["median_ms_per_step"].values())
    out = capsys.readouterr().out
    assert "texts identical in every mode" in out
    for mode in detokenize.MODES:
        assert f"| {mode} |" in out


def test_detokenize_bench_streams_are_real_text():
    """Each stream is text from its own offset, long enough for the steps asked for."""
    from gapless.testing import build_tokenizer

    tok = build_tokenizer()
    ids = detokenize.streams(tok, 3, 100)
    assert [len(s) for s in ids] == [100] * 3 and ids[0] != ids[1]
    _, texts = detokenize.run_mode("whole step", tok, ids, 4)
    assert texts[0] and texts[0] in tok.decode(ids[0])
