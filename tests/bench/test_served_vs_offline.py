"""`python -m gapless.bench.served_vs_offline`: its ratios come from the runs of the same round (served
over offline at full concurrency only; each layout over the first), and its arguments are checked."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gapless.bench import served_vs_offline as bench


def _run(k: int, mode: str, tok_s: float, c: int | None = None, msgs: int = 10) -> dict:
    hops = {"hop_scheduler_updates_out": msgs, "hop_scheduler_request_updates": 8 * msgs}
    return dict(round=k, mode=mode, output_tokens_per_s=tok_s, concurrency=c, hops=hops)


def test_ratios_are_per_round_then_the_median():
    runs = [
        _run(0, "offline", 100.0),
        _run(0, "split", 90.0, 0),
        _run(0, "merged", 99.0, 0),
        _run(0, "split", 20.0, 1),
        _run(0, "merged", 25.0, 1),
        _run(1, "offline", 50.0),  # the machine got slower for the whole round
        _run(1, "split", 40.0, 0),
        _run(1, "merged", 45.0, 0),
        _run(1, "split", 10.0, 1),
        _run(1, "merged", 10.0, 1),
    ]
    rows = {(r["mode"], r["concurrency"]): r for r in bench.summarize(runs)}
    assert rows[("offline", None)]["output_tokens_per_s"] == 75.0
    assert rows[("split", 0)]["served_over_offline"] == pytest.approx((0.9 + 0.8) / 2)
    assert rows[("merged", 0)]["over_split"] == pytest.approx((1.1 + 45 / 40) / 2)
    assert rows[("split", 1)]["served_over_offline"] is None  # not at full concurrency
    assert rows[("merged", 1)]["over_split"] == pytest.approx((1.25 + 1.0) / 2)
    assert rows[("merged", 1)]["request_updates_per_message"] == 8.0
    report = bench.format_report(bench.summarize(runs), "split")
    assert "| merged | all | 72.0 | 0.945 | 1.113 | 8.0 | - | - |" in report, report


def test_host_step_device_idle_and_gc_pauses_come_from_the_counters_over_each_run():
    """Served runs take the difference of /debug/state's counters around the run, offline ones the meter
    of their own engine; the table shows each mode's median over the rounds beside its tokens/s."""
    figures = bench.meter_figures(
        {
            "decode_host_s": 0.05,
            "decode_steps": 100,
            "device_busy_s": 0.9,
            "device_idle_s": 0.1,
            "gc_pause_s": 0.25,
            "api_gc_pause_s": 0.5,
        }
    )
    assert figures == pytest.approx(
        {"host_ms_per_decode_step": 0.5, "device_idle": 0.1, "gc_pause_s": 0.25, "api_gc_pause_s": 0.5}
    )
    assert bench.meter_figures({}) == dict.fromkeys(figures)
    runs = [
        dict(_run(0, "offline", 100.0), host_ms_per_decode_step=0.4, device_idle=0.02, gc_pause_s=0.1),
        dict(
            _run(0, "merged", 80.0, 0),
            host_ms_per_decode_step=0.6,
            device_idle=0.2,
            gc_pause_s=0.0,
            api_gc_pause_s=0.3,
        ),
        dict(_run(1, "offline", 100.0), host_ms_per_decode_step=0.5, device_idle=0.04, gc_pause_s=0.2),
        dict(
            _run(1, "merged", 80.0, 0),
            host_ms_per_decode_step=0.9,
            device_idle=None,
            gc_pause_s=0.02,
            api_gc_pause_s=0.5,
        ),
    ]
    rows = {r["mode"]: r for r in bench.summarize(runs)}
    assert rows["offline"]["host_ms_per_decode_step"] == pytest.approx(0.45)
    assert rows["merged"]["host_ms_per_decode_step"] == pytest.approx(0.75)
    assert rows["merged"]["device_idle"] == pytest.approx(0.2)  # a run without the figure is left out
    assert rows["merged"]["api_gc_pause_s"] == pytest.approx(0.4)
    report = bench.format_report(list(rows.values()), "merged")
    assert "| offline | - | 100.0 | - | - | - | 0.450 | 3.0% | 0.150 | - |" in report, report
    assert "| merged | all | 80.0 | 0.800 | 1.000 | 8.0 | 0.750 | 20.0% | 0.010 | 0.400 |" in report, report


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layouts", "single"], "--layouts takes"),
        (["--max-concurrency", "1,x"], "whole numbers"),
        (["--api-server-counts", "1,two"], "whole numbers"),
        (["--api-server-counts", "0"], "--api-server-counts values must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench._parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_layout_is_served_with_each_count_of_api_servers():
    args = bench._parse_args(["--layouts", "split,merged", "--api-server-counts", "1,2"])
    assert args.api_servers == [1, 2]
    modes = [bench.served_mode(layout, n) for layout in args.layouts for n in args.api_servers]
    assert modes == ["split", "split x2 API", "merged", "merged x2 API"]


def test_cpu_per_token_and_cores_busy_are_the_median_per_process_and_reported():
    runs = [
        dict(
            _run(0, "split", 90.0, 0),
            cpu_us_per_token={"api": 40.0, "scheduler": 100.0},
            cores_busy={"api": 0.5, "scheduler": 0.9},
        ),
        dict(
            _run(1, "split", 80.0, 0),
            cpu_us_per_token={"api": 50.0, "scheduler": 120.0},
            cores_busy={"api": 0.7, "scheduler": 1.0},
        ),
        dict(
            _run(2, "split", 70.0, 0),
            cpu_us_per_token={"api": 45.0, "scheduler": 90.0},
            cores_busy={"api": 0.6, "scheduler": 0.8},
        ),
    ]
    (row,) = bench.summarize(runs)
    assert row["cpu_us_per_token"] == {"api": 45.0, "scheduler": 100.0}
    assert row["cores_busy"] == pytest.approx({"api": 0.6, "scheduler": 0.9})
    report = bench.format_report([row], "split")
    assert "| mode | max concurrency | api | scheduler |" in report
    assert "| split | all | 45.0 | 100.0 |" in report
    assert "| split | all | 0.60 | 0.90 |" in report


def test_process_cpu_reads_a_process_tree_from_proc():
    """The API server's own CPU time, and each worker's with its children's: here this test process as the
    API server and as a worker whose child burns CPU (counted in the worker's figure only)."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux's /proc")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        state = {"worker_pids": {"worker": os.getpid()}}
        while True:
            cpu = bench.process_cpu_s(os.getpid(), state)
            if cpu["worker"] - cpu["api"] >= 0.25 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert set(cpu) == {"api", "worker"}
        assert cpu["api"] > 0 and cpu["worker"] - cpu["api"] >= 0.25  # the child's 0.3 s, in the worker's
    finally:
        child.communicate(b"\n", timeout=30)
