"""`bench/gpu_session.sh` is run only when a session is lent a GPU, for at most 30 minutes: a misspelt flag
there costs a part. Each part runs here with a stand-in for Python that checks instead of running: a
benchmark's command line goes through that benchmark's own argument parser, a pytest command collects
its tests (and must select some), pip installs nothing; anything else runs as it is. Every step must
exit 0. (A parser is asked with CUDA reported available, as on the GPU machine.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tests", "bench", "serve", "prefill", "suite")

CHECKER = textwrap.dedent(
    """\
    import importlib, os, subprocess, sys
    args = sys.argv[1:]
    if args[:1] == ["-m"] and args[1].startswith("gapless.bench."):
        import torch
        torch.cuda.is_available = lambda: True  # parsed as on the GPU machine, which a parser may ask
        module = importlib.import_module(args[1])
        parse = getattr(module, "parse_args", None) or getattr(module, "_parse_args")
        parse(args[2:])  # exits 2 with argparse's message on a bad flag
        print("parsed", args[1])
        sys.exit(0)
    if args[:2] == ["-m", "pytest"]:
        rest, skip = [], False
        for a in args[2:]:  # pytest-xdist's -n N: not installed here, and beside the point
            if skip or a == "-n":
                skip = not skip
                continue
            rest.append(a)
        sys.exit(subprocess.call([sys.executable, "-m", "pytest", "--collect-only", "-q", *rest]))
    if args[:2] == ["-m", "pip"]:
        sys.exit(0)
    os.execv(sys.executable, [sys.executable, *args])
    """
)


@pytest.mark.parametrize("part", PARTS)
def test_every_step_of_the_part_takes_its_arguments(part, tmp_path):
    checker = tmp_path / "python"
    checker.write_text(f"#!{sys.executable}\n{CHECKER}")
    checker.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(checker), "OUT": str(out), "GPU_BENCH_TIMEOUT": "120"}
    r = subprocess.run(
        ["bash", "bench/gpu_session.sh", part],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (out / part / "steps.log").read_text() if part != "bench" else ""
    ends = re.findall(r": exit (\d+)$", steps, flags=re.M)
    if part != "bench":
        assert ends and set(ends) == {"0"}, "\n".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((out / part).glob("*.log"))
        )
    else:  # gpu_bench.sh: its one benchmark command, parsed
        assert "parsed gapless.bench.gpu" in (out / part / "gpu_bench.log").read_text()


def test_a_bad_flag_fails_its_step(tmp_path):
    """The check is not vacuous: a flag the benchmark does not take makes its step exit 2."""
    script = tmp_path / "gpu_session.sh"
    text = (ROOT / "bench/gpu_session.sh").read_text()
    script.write_text(text.replace("--rounds 3 --engine-option device=cuda", "--roundz 3", 1))
    (tmp_path / "bench").mkdir()
    shutil.copy(script, tmp_path / "bench/gpu_session.sh")
    checker = tmp_path / "python"
    checker.write_text(f"#!{sys.executable}\n{CHECKER}")
    checker.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(checker), "OUT": str(out), "PYTHONPATH": str(ROOT)}
    subprocess.run(
        ["bash", str(tmp_path / "bench/gpu_session.sh"), "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    steps = (out / "serve/steps.log").read_text()
    assert re.search(r"host: exit 2$", steps, flags=re.M), steps
