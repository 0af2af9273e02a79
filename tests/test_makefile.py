"""The README's set-up commands: `make serve` passes ARGS to the server (`make serve ARGS="--port 8001"`);
`make test` runs the suite but its slow tier in two processes, each file's tests in one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_passes_args_to_the_server():
    done = subprocess.run(
        ["make", "-n", "serve", "ARGS=--port 8001 --page-size 16"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    serve = [line for line in done.stdout.splitlines() if "-m gapless serve" in line]
    assert serve and serve[-1].endswith("-m gapless serve --port 8001 --page-size 16"), done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_runs_two_processes_a_file_in_one():
    done = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    run = [line for line in done.stdout.splitlines() if "-m pytest" in line]
    assert run and run[-1].endswith('-m pytest -q -m "not slow" -n 2 --dist loadfile'), done.stdout
