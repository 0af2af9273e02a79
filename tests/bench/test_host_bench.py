"""The host benchmark runs end to end on tiny settings, and the engine splits its host time by what each
step launched."""

from __future__ import annotations

import json

import pytest

from gapless import LLM, SamplingParams
from gapless.bench import host
from gapless.engine.meter import BubbleMeter


@pytest.mark.slow  # (a benchmark run, ~8 s)
def test_host_bench_smoke(tmp_path, capsys):
    out = tmp_path / "host.json"
    rows = host.main(
        ["--num-seqs", "8", "--input-len", "4", "--output-len", "6", "--rounds", "1", "--json", str(out)]
    )
    assert [r["mode"] for r in rows] == list(host.MODES)
    for r in rows:
        assert r["prefill_steps"] == 1 and r["decode_steps"] == 5  # all 8 admitted at once, 5 more tokens
        assert r["host_ms_per_prefill_step"] > 0 and r["host_ms_per_decode_step"] > 0 and r["tok_s"] > 0
    assert "host ms/decode step" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["runs"]) == len(host.MODES)


def test_meter_splits_host_time_by_what_a_step_launched():
    m = BubbleMeter()
    m.host_span("schedule", 0.0, 0.010)
    m.step_done("extend")
    for t in (1.0, 2.0):
        m.host_span("schedule", t, t + 0.001)
        m.host_span("process", t + 0.5, t + 0.502)
        m.step_done("decode")
    m.host_span("process", 3.0, 3.004)
    m.step_done(None)  # processed the last batch, launched nothing
    st = m.stats()
    assert (st.steps, st.prefill_steps, st.decode_steps) == (4, 1, 2)
    assert st.mean_host_ms_per_prefill_step == pytest.approx(10.0)
    assert st.mean_host_ms_per_decode_step == pytest.approx(3.0)
    assert st.mean_host_ms_per_step == pytest.approx(20.0 / 4)


def test_get_stats_has_host_ms_per_prefill_and_decode_step(ckpt_factory):
    with LLM(str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=512) as llm:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
        s = llm.get_stats()
    assert s["prefill_steps"] >= 1 and s["decode_steps"] >= 3
    assert s["mean_host_ms_per_prefill_step"] > 0 and s["mean_host_ms_per_decode_step"] > 0


def test_host_bench_prefill_workload_on_another_shape():
    """The prefill-launch measurement: prompts and one output token each, so every step is a prefill, on a
    shape other than the default (`--size`, its own layer count unless `--layers`), chunked as asked."""
    argv = ["--size", "overlap", "--num-seqs", "4", "--input-len", "64", "--output-len", "1", "--rounds", "1"]
    rows = host.main([*argv, "--modes", "plain", "--engine-option", "chunked_prefill_size=128"])
    (r,) = rows
    assert (r["prefill_steps"], r["decode_steps"]) == (2, 0)  # 256 prompt tokens in chunks of 128
    assert r["host_ms_per_prefill_step"] > 0
    assert host._model(host._parse_args(["--size", "overlap"])).name.startswith("qwen3-overlap-")
