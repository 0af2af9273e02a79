"""`python -m gapless.bench.latency` on the CPU with a tiny model: offline and served, each concurrency
level runs its requests to their length, and the figures agree with each other (a lone request's TTFT and
TPOT add up to no more than the level's wall time, percentiles in order)."""

from __future__ import annotations

import json

import pytest

from gapless.bench import latency

OUT = 5


def _check_row(r: dict, concurrency: int, requests: int) -> None:
    assert (r["concurrency"], r["requests"]) == (concurrency, requests)
    assert r["output_tokens"] == requests * OUT  # ignore_eos: every request to its length
    ttft, tpot = r["ttft_ms"], r["tpot_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] and 0 < tpot["p50"] <= tpot["p90"]
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    if concurrency == 1:  # one request after another: each one's TTFT + its later tokens fit in the wall
        per_request_s = (ttft["mean"] + (OUT - 1) * tpot["mean"]) / 1e3
        assert per_request_s * requests <= r["wall_s"] * 1.001


@pytest.mark.slow  # (a benchmark run offline and served, ~9 s)
def test_latency_bench_offline_and_served_on_cpu(tmp_path):
    out = tmp_path / "latency.json"
    argv = "--size tiny --device cpu --dtype float32 --prompt-len 12 --concurrency 1 3 --requests 1"
    argv += f" --min-requests 2 --output-len {OUT} --engine-option kv_cache_tokens=1024 --json {out}"
    res = latency.main(argv.split())
    assert res["errors"] == []
    rows = {(r["mode"], r["concurrency"]): r for r in res["rows"]}
    assert list(rows) == [("offline", 1), ("offline", 3), ("served", 1), ("served", 3)]
    for (_, c), r in rows.items():
        _check_row(r, c, max(c, 2))
    saved = json.loads(out.read_text())
    assert saved["report"] == res["report"] and "| served | 3 | 3 |" in res["report"]
    assert "TPOT at concurrency 1, offline" in res["report"]


def test_percentiles_and_flags():
    assert latency.percentiles([4.0, 1.0, 3.0, 2.0]) == dict(mean=2.5, p50=2.0, p90=4.0)
    assert latency.percentiles([]) == dict(mean=None, p50=None, p90=None)
    with pytest.raises(SystemExit):
        latency.parse_args(["--device", "cpu", "--output-len", "1"])
