"""The overlap benchmark and the timeline drawing run end to end on tiny settings."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from gapless.bench import overlap, timeline


@pytest.mark.slow
def test_overlap_bench_smoke(tmp_path):
    res = overlap.main(
        [
            "--size",
            "tiny",
            "--num-seqs",
            "8",
            "--max-running",
            "4",
            "--input",
            "4",
            "8",
            "--output",
            "4",
            "8",
            "--threads",
            "1",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    for mode in overlap.MODES:
        s = res["summary"][mode]
        assert s["tok_s"] > 0 and 0.0 <= s["device_idle_fraction"] < 1.0 and s["host_ms_per_step"] > 0
    assert res["ratio"] > 0 and res["ideal_ratio"] >= 1.0
    assert json.loads((tmp_path / "overlap.json").read_text())["summary"].keys() == overlap.MODES.keys()
    assert Image.open(tmp_path / "timeline.png").size[0] > 1000


def test_timeline_draws_spans_where_they_are(tmp_path):
    trace = {
        "traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "host"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "device"}},
            {"name": "decode", "ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 50_000},  # 0-50 ms
            {"name": "process", "ph": "X", "pid": 1, "tid": 1, "ts": 50_000, "dur": 50_000},  # 50-100 ms
        ]
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    out = tmp_path / "t.png"
    timeline.draw([("t", path)], out, window_ms=100)
    img = Image.open(out).convert("RGB")
    row_y = 10 + 20  # first row (host) of the first panel
    left_quarter = timeline.LEFT + timeline.WIDTH // 4
    right_quarter = timeline.LEFT + 3 * timeline.WIDTH // 4
    host_mid, dev_mid = (
        row_y + timeline.ROW_H // 2,
        row_y + timeline.ROW_H + timeline.GAP + timeline.ROW_H // 2,
    )
    assert img.getpixel((left_quarter, dev_mid)) == timeline.COLORS["decode"]
    assert img.getpixel((right_quarter, dev_mid)) == (255, 255, 255)
    assert img.getpixel((right_quarter, host_mid)) == timeline.COLORS["process"]
    assert img.getpixel((left_quarter, host_mid)) == (255, 255, 255)


def test_timeline_default_window_is_the_whole_run(tmp_path):
    """Without --ms the picture spans every trace to its last span's end (the longest one), not a
    fixed 100 ms that cuts a longer run off."""
    paths = []
    for name, end_us in (("short", 40_000), ("long", 350_000)):
        trace = {
            "traceEvents": [
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "device"}},
                {"name": "decode", "ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": end_us},
            ]
        }
        paths.append((name, tmp_path / f"{name}.json"))
        paths[-1][1].write_text(json.dumps(trace))
    out = tmp_path / "whole.png"
    assert timeline.draw(paths, out) == 350.0
    assert timeline.draw(paths, out, skip_ms=50) == 300.0
    timeline.main([str(p) for _, p in paths] + ["-o", str(out)])
    img = Image.open(out).convert("RGB")
    # the second panel's (the long trace's) device row is filled to the right edge
    panel = 20 + 2 * (timeline.ROW_H + timeline.GAP)
    dev_mid = 10 + panel + 20 + timeline.ROW_H + timeline.GAP + timeline.ROW_H // 2
    assert img.getpixel((timeline.LEFT + timeline.WIDTH - 3, dev_mid)) == timeline.COLORS["decode"]
