"""`bench/gpu_session.sh` is run only when a session is lent a GPU, for at most 30 minutes: a misspelt flag
there costs a part. Each part runs here with a stand-in for Python that records each command line instead
of running it; then every benchmark's command line goes through that benchmark's own argument parser, in
this process (with CUDA reported available, as on the GPU machine, which a parser may ask), and every
pytest command collects its tests, which must select some."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tests", "bench", "serve", "prefill", "suite")
RECORDER = textwrap.dedent(
    """\
    import json, os, sys
    with open(os.environ["GPU_SESSION_COMMANDS"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    """
)
# each pytest command's collection, in one process per part: exits with the first failing command's status
COLLECTOR = textwrap.dedent(
    """\
    import json, subprocess, sys
    for args in json.loads(sys.argv[1]):
        rc = subprocess.call([sys.executable, "-m", "pytest", "--collect-only", "-q", *args])
        if rc:
            print("collecting failed:", args)
            sys.exit(rc)
    """
)


def _run_part(script: Path, part: str, tmp_path: Path, cwd: Path) -> list[list[str]]:
    """Run `script`'s part with the recorder as Python; the command lines it ran Python with."""
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\n{RECORDER}")
    recorder.chmod(0o755)
    commands = tmp_path / "commands.jsonl"
    env = {
        **os.environ,
        "PY": str(recorder),
        "OUT": str(tmp_path / "out"),
        "GPU_SESSION_COMMANDS": str(commands),
        "PYTHONPATH": str(ROOT),
    }
    r = subprocess.run(
        ["bash", str(script), part], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in commands.read_text().splitlines()]


def _parse_bench(args: list[str], monkeypatch) -> None:
    """`python -m gapless.bench.X ARGS` through X's own parser; SystemExit (argparse's 2) on a bad flag."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    module = importlib.import_module(args[1])
    parse = getattr(module, "parse_args", None) or module._parse_args
    parse(args[2:])


def _pytest_args(args: list[str]) -> list[str]:
    """A pytest command's arguments without pytest-xdist's `-n N` (not installed here, and beside the
    point)."""
    rest, skip = [], False
    for a in args[2:]:
        if skip or a == "-n":
            skip = not skip
            continue
        rest.append(a)
    return rest


@pytest.mark.parametrize("part", PARTS)
def test_every_step_of_the_part_takes_its_arguments(part, tmp_path, monkeypatch):
    commands = _run_part(ROOT / "bench/gpu_session.sh", part, tmp_path, ROOT)
    benches = [c for c in commands if c[:1] == ["-m"] and c[1].startswith("gapless.bench.")]
    tests = [_pytest_args(c) for c in commands if c[:2] == ["-m", "pytest"]]
    assert benches or tests, commands
    for args in benches:
        try:
            _parse_bench(args, monkeypatch)
        except SystemExit as e:
            pytest.fail(f"{' '.join(args)}: the parser refused it (exit {e.code})")
    if part == "bench":  # gpu_bench.sh: its one benchmark
        assert [c[1] for c in benches] == ["gapless.bench.gpu"]
    if tests:
        r = subprocess.run(
            [sys.executable, "-c", COLLECTOR, json.dumps(tests)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = (tmp_path / "out" / part / "steps.log").read_text() if part != "bench" else ""
    assert set(re.findall(r": exit (\d+)$", steps, flags=re.M)) <= {"0"}, steps


def test_a_bad_flag_is_refused(tmp_path, monkeypatch, capsys):
    """The check is not vacuous: a flag the benchmark does not take is refused by its parser."""
    (tmp_path / "bench").mkdir()
    script = tmp_path / "bench/gpu_session.sh"
    text = (ROOT / "bench/gpu_session.sh").read_text()
    script.write_text(text.replace("--rounds 3 --engine-option device=cuda", "--roundz 3", 1))
    shutil.copy(ROOT / "bench/gpu_bench.sh", tmp_path / "bench/gpu_bench.sh")
    commands = _run_part(script, "serve", tmp_path, tmp_path)
    (host,) = [c for c in commands if c[:2] == ["-m", "gapless.bench.host"] and "--roundz" in c]
    with pytest.raises(SystemExit) as e:
        _parse_bench(host, monkeypatch)
    assert e.value.code == 2 and "--roundz" in capsys.readouterr().err
