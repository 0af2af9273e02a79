"""SIGINT and SIGTERM stop every process of the server within seconds, even mid-request: an open stream
ends with an error event and `[DONE]`, and no process of the server is left by the time its exit status is
seen. A dead worker makes the server exit with an error instead of hanging, leaving nothing behind either.
Both process layouts are covered (split: a process per stage; merged: tokenizer and detokenizer in one).
The SIGTERM server also runs with every log on, and shows what each prints."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from gapless.testing.server import ServerProcess, alive

SHUTDOWN_S = 15.0
LOGS_ON = ("--log-level", "debug", "--log-requests", "--log-stats-interval", "0.2")


def _start(
    ckpt_factory, *args: str, default_model: bool = False, env: dict | None = None
) -> tuple[ServerProcess, set[int]]:
    # MODEL as the first argument; the built-in tiny random model by name (no model would fetch SmolLM2)
    model = ["tiny-random"] if default_model else [str(ckpt_factory("qwen3"))]
    srv = ServerProcess(*model, "--device", "cpu", "--kv-cache-tokens", "8192", *args, env=env)
    workers = srv.workers()
    assert len(workers) >= 3, f"expected tokenizer, scheduler and detokenizer processes, got {workers}"
    return srv, workers


class _Stream(threading.Thread):
    """A long streaming request, read in the background: its data lines, and an event set once the
    first arrived (the request runs)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.events, self.running = url, [], threading.Event()
        self.start()

    def run(self) -> None:
        body = {"text": "go", "stream": True, "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}
        with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.running.set()


def _left(workers: set[int]) -> list[int]:
    return [p for p in workers if alive(p)]


# (SIGTERM in `make test`; SIGINT, the same path from another signal, in the slow tier: ~8 s a case)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM])
def test_signal_ends_open_streams_and_stops_every_process(ckpt_factory, tmp_path, sig):
    # SIGINT's server runs the built-in tiny random model, made on first use (not in ~)
    default = sig == signal.SIGINT
    logs = () if default else LOGS_ON
    # each layout (gapless.server.layout) once: SIGINT's server the merged one, SIGTERM's the split one
    logs += ("--process-layout", "merged" if default else "split")
    srv, workers = _start(ckpt_factory, *logs, default_model=default, env={"GAPLESS_CACHE": str(tmp_path)})
    if default:
        assert "serving tiny-random" in srv.output and (tmp_path / "models").is_dir()
    else:  # a finished request, for the request lines
        r = httpx.post(f"{srv.url}/generate", json={"text": "hi", "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 200, r.text
    stream = _Stream(srv.url)
    assert stream.running.wait(30), srv.output
    time.sleep(0.5)  # a few stats lines' worth
    start = time.monotonic()
    srv.signal(sig)
    assert srv.wait(SHUTDOWN_S) == 0, srv.output
    assert not _left(workers), "processes outlived the server"  # at once: it waited for them
    assert time.monotonic() - start < SHUTDOWN_S
    stream.join(10)
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    error = json.loads(stream.events[-2])["error"]
    assert error["message"] == "server is shutting down" and error["code"] == 503, stream.events[-3:]
    assert len(stream.events) > 3  # tokens streamed before the error
    if not default:
        _check_logs(srv.output)


def _check_logs(out: str) -> None:
    """What the server printed with every log on: start-up progress, debug records of each scheduler step,
    the periodic stats line, and a line per request (the scheduler's and the HTTP access line)."""
    assert "gapless: starting " in out and "loading weights" in out and "KV cache: 8192 tokens" in out
    assert "gapless-scheduler DEBUG prefill batch: 1 requests" in out, out
    assert "gapless-scheduler DEBUG decode batch: 1 requests" in out
    assert "gapless-scheduler INFO engine: prompt " in out and " tok/s, running 1, waiting 0, KV " in out
    assert "prompt tokens (0 cached), 3 output tokens, finish length, first token " in out
    assert '"POST /generate HTTP/1.1" 200' in out


@pytest.mark.parametrize(
    ("worker", "layout"),
    [
        ("scheduler", "split"),
        # (the same split layout as the scheduler's case, another worker; the merged layout's worker:
        # the slow tier, ~8 s a case)
        pytest.param("detokenizer", "split", marks=pytest.mark.slow),
        pytest.param("tokenizer+detokenizer", "merged", marks=pytest.mark.slow),
    ],
)
def test_dead_worker_makes_the_server_exit_with_an_error(ckpt_factory, worker, layout):
    srv, workers = _start(ckpt_factory, "--process-layout", layout)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        pids = c.get("/debug/state").json()["worker_pids"]
        assert set(pids.values()) <= workers
        os.kill(pids[worker], signal.SIGKILL)
        assert srv.wait(SHUTDOWN_S) != 0
    assert f"the {worker} worker exited" in srv.output
    assert not _left(workers), "processes outlived the server"


def _failing_worker(api: str, parent_pid: int) -> None:
    from gapless.server.workers.child import run_worker
    from gapless.server.workers.sockets import Sockets

    def body(socks: Sockets) -> None:
        raise ValueError("no such layer " + "x" * 200_000)  # a long traceback: several sends' worth

    run_worker("scheduler", parent_pid, lambda: Sockets((), {}, (api,)), body)


def test_a_failing_worker_reports_its_error_before_it_exits(tmp_path, capfd):
    """A worker whose body raises (a start-up that fails) sends `Failed` with its traceback to the API
    server, and the message is delivered before the process exits: closing its sockets at once dropped
    it one time in four here, leaving the server to say only that the worker exited. The worker prints
    nothing itself (the server prints the traceback it was sent: once) and exits with status 1."""
    import multiprocessing as mp

    import zmq

    from gapless.server import protocol as P

    ctx = zmq.Context()
    api = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path / 'api'}"
    api.bind(addr)
    try:
        for _ in range(12):
            proc = mp.get_context("fork").Process(target=_failing_worker, args=(addr, os.getpid()))
            proc.start()
            proc.join(10)
            assert proc.exitcode == 1
            assert api.poll(2000), "the worker exited without its Failed message"
            msg = P.decode(api.recv())
            assert isinstance(msg, P.Failed) and msg.worker == "scheduler"
            assert "ValueError: no such layer" in msg.error
        assert "no such layer" not in capfd.readouterr().err
    finally:
        api.close(linger=0)
        ctx.term()


def test_api_server_runs_on_uvloop_when_installed(monkeypatch, capsys):
    """The API server's loop is uvloop's when `import uvloop` works (a stand-in module here, whose
    factory makes a plain asyncio loop it can recognise), asyncio's otherwise; the start-up says which."""
    import asyncio
    import sys
    import types

    from gapless.server import api_process

    made: list[asyncio.AbstractEventLoop] = []

    def new_event_loop() -> asyncio.AbstractEventLoop:
        made.append(asyncio.new_event_loop())
        return made[-1]

    async def main() -> int:
        return 7 if asyncio.get_running_loop() in made else 0

    fake = types.SimpleNamespace(new_event_loop=new_event_loop, __version__="9.9")
    monkeypatch.setitem(sys.modules, "uvloop", fake)
    assert api_process.run_event_loop(main()) == (7 if sys.version_info >= (3, 11) else 0)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails
    made.clear()
    assert api_process.run_event_loop(main()) == 0
    out = capsys.readouterr().out.splitlines()
    if sys.version_info >= (3, 11):
        assert out == ["gapless: event loop uvloop 9.9", "gapless: event loop asyncio (uvloop not installed)"]
