"""SIGINT and SIGTERM stop every process of the server within seconds, even mid-request; a dead worker
makes the server exit with an error instead of hanging. Nothing is left behind either way."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from gapless.testing.server import ServerProcess, alive, wait_until

SHUTDOWN_S = 15.0


def _start(
    ckpt_factory, default_model: bool = False, env: dict | None = None
) -> tuple[ServerProcess, set[int]]:
    model = ["--model", "tiny-random" if default_model else str(ckpt_factory("qwen3"))]
    srv = ServerProcess(*model, "--device", "cpu", "--kv-cache-tokens", "8192", env=env)
    workers = srv.workers()
    assert len(workers) >= 3, f"expected tokenizer, scheduler and detokenizer processes, got {workers}"
    return srv, workers


def _stream_in_background(url: str) -> threading.Thread:
    """A long streaming request, so the shutdown happens with work in flight."""

    def run() -> None:
        body = {"text": "go", "stream": True, "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}
        try:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_process(ckpt_factory, tmp_path, sig):
    # SIGINT's server runs the built-in tiny random model (`--model tiny-random`), made on first use
    default = sig == signal.SIGINT
    srv, workers = _start(ckpt_factory, default, env={"GAPLESS_CACHE": str(tmp_path)})
    if default:
        assert "serving tiny-random" in srv.output and (tmp_path / "models").is_dir()
    _stream_in_background(srv.url)
    time.sleep(0.5)
    start = time.monotonic()
    srv.signal(sig)
    assert srv.wait(SHUTDOWN_S) == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 5), "worker processes left behind"
    assert time.monotonic() - start < SHUTDOWN_S


@pytest.mark.parametrize("worker", ["scheduler", "detokenizer"])
def test_dead_worker_makes_the_server_exit_with_an_error(ckpt_factory, worker):
    srv, workers = _start(ckpt_factory)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        pids = c.get("/debug/state").json()["worker_pids"]
        assert set(pids.values()) <= workers
        os.kill(pids[worker], signal.SIGKILL)
        assert srv.wait(SHUTDOWN_S) != 0
    assert f"the {worker} worker exited" in srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 5), "worker processes left behind"
