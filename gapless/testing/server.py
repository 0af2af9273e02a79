"""Run `gapless serve` as a child process for tests and benchmarks: start, wait for its URL, stop, and
list every process it started (to check none outlives it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

_URL = re.compile(r"serving \S+ at (http://\S+)")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class ServerProcess:
    """`python -m gapless serve --port 0 ...ARGS`; `url` once it printed its ready line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "gapless", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(startup_timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.output)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _URL.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited before it was ready

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def workers(self) -> set[int]:
        return descendants(self.proc.pid)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in self.workers():
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
        return self.proc.wait()


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds passed; its last truth value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
