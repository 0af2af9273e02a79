"""Compile every Triton kernel of the engine for a GPU, on a machine without one:
`python -m gapless.testing.triton_compile [--arch 90]`.

Triton compiles for whatever target it is told (its ptxas comes with it), so a CPU machine can take each
kernel down to the GPU's binary and find what a GPU session would otherwise find first: a kernel that runs
under the interpreter but does not compile (a non-constexpr global, a type the compiler refuses, a
constexpr-gated None argument). A stand-in for Triton's driver reports the target and turns every launch
into a compile (Triton's `warmup`), so the engine's own launchers run as on the GPU, with CPU tensors and
no kernel executing: their outputs are garbage, and only compile errors count.

What it launches (`gapless.testing.triton_cases`): the start-up self-checks' own probes. Attention
(`gapless.attention.selfcheck`: an extend batch, and a decode batch split over several programs, in one,
with its whole key blocks unmasked, with an fp8 cache's values read a byte at a time, not in pairs, and
pipelined 5 stages deep) in fp32, bf16 and fp16, with and without a sliding window and soft-capping, at head
dims 64 and 128, and over an fp8 cache, e4m3 or e5m2 (bf16, fp16 queries); the fused model kernels
(`gapless.model.fused.disagreement`) on the tiny models of families whose kernels differ (RMSNorm
arithmetic, q/k norms, activations) in bf16 and fp16; the sampling kernels (`gapless.sampling.fused`); the
MoE grouped GEMM (float, e4m3 and int4/int8 experts, int4 also with act-order); the FP8 GEMM; the int4/int8
weight-only GEMM; the LoRA kernels. Exit status 1, naming each kernel and its error, when any fails to
compile. Run it without TRITON_INTERPRET (the interpreter takes the compiler's place).

With `--resources`, each specialization's registers, spills and shared memory per program, as the
compiled binary records them (`cuobjdump --dump-resource-usage`, which comes with Triton): what decides
how many programs an SM holds, for reading a tuning sweep without a GPU. With `--ops`, its SASS counted
(`instruction_mix`): instructions, matrix instructions, and conversions, which Hopper runs on a slower
pipe than float math (an integer or e4m3 -> bfloat16 conversion a weight value bounds a GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gapless import env
from gapless.testing.sass import instruction_mix, resources
from gapless.testing.triton_cases import GROUPS


class _Driver:
    """Triton's active driver as the launchers and `JITFunction.run` ask it: a device, a stream and the
    target to compile for; nothing launches."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


class Compiler:
    """While installed (`with`): every Triton launch compiles its kernel for `arch` and returns without
    running it; `compiled` names each kernel and specialization built, `failed` each that did not."""

    def __init__(self, arch: int) -> None:
        self.arch = arch
        self.compiled: list[tuple[str, Any]] = []  # (kernel, its compiled specialization)
        self.failed: list[tuple[str, str]] = []  # (kernel, error)

    def __enter__(self) -> Compiler:
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self._driver, self._run = driver, JITFunction.run
        self._active = getattr(driver, "_active", None)  # None: none chosen yet (none can be, here)
        compiler, run = self, JITFunction.run

        def compile_only(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            try:
                kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as e:
                compiler.failed.append((fn.fn.__name__, f"{type(e).__name__}: {e}"))
                raise
            compiler.compiled.append((fn.fn.__name__, kernel))
            return kernel

        JITFunction.run = compile_only
        driver.set_active(_Driver(GPUTarget("cuda", self.arch, 32)))
        return self

    def __exit__(self, *exc: object) -> None:
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._run
        self._driver._active = self._active  # (reset_active would look for a GPU driver)


def compile_all(arch: int) -> Compiler:
    """Launch every case under a `Compiler` for `arch`; the compiler's record of what built and what not."""
    with Compiler(arch) as compiler, torch.inference_mode():
        for group in GROUPS.values():
            for name, case in group().items():
                before = len(compiler.failed)
                try:
                    case()
                except Exception:  # noqa: BLE001 - a compile error is recorded; anything else is named
                    if len(compiler.failed) == before:
                        compiler.failed.append((name, traceback.format_exc(limit=3)))
    return compiler


class Built(NamedTuple):
    """What `compile_cases` compiled: the kernels by name, the compilations, the cases that failed."""

    kernels: list[str]
    compilations: int
    failed: list[str]


def compile_cases(group: str, name_has: str, arch: int = 90) -> Built | None:
    """Compile for `arch`, in a fresh process without TRITON_INTERPRET, the cases of the harness's group
    `group` ("moe", "int4", ...) whose names hold `name_has`: a family's own test of its kernels (the
    whole harness: tests/testing/test_triton_compile.py). None where this Triton has no NVIDIA backend."""
    script = (
        "import json\nfrom gapless.testing.triton_cases import GROUPS\n"
        "from gapless.testing.triton_compile import Compiler\n"
        f"with Compiler({arch}) as c:\n"
        f"    for name, case in GROUPS[{group!r}]().items():\n"
        f"        if {name_has!r} in name:\n"
        "            case()\n"
        "print(json.dumps([sorted({n for n, _ in c.compiled}), len(c.compiled), [n for n, _ in c.failed]]))"
    )
    out = compile_child(script, f"compiling the {group} cases")
    if out is None:
        return None
    kernels, compilations, failed = json.loads(out.strip().splitlines()[-1])
    return Built(kernels, compilations, failed)


def compile_child(script: str, what: str) -> str | None:
    """`script`'s stdout, run by Python in a child process without TRITON_INTERPRET (the compiler's
    place), with this checkout first on its path; None where this Triton has no NVIDIA backend; a
    `RuntimeError` naming `what` with the child's stderr if it fails."""
    child_env = {**os.environ}  # (handed on, less the interpreter's switch)
    child_env.pop(env.TRITON_INTERPRET.name, None)
    root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
    probe = "from triton.backends.nvidia.compiler import CUDABackend"
    if subprocess.run([sys.executable, "-c", probe], env=child_env, capture_output=True).returncode:
        return None
    r = subprocess.run(
        [sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=600
    )
    if r.returncode:
        raise RuntimeError(f"{what} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gapless.testing.triton_compile", description=__doc__)
    p.add_argument(
        "--arch", type=int, default=90, help="the GPU's compute capability x 10 (default 90: H100)"
    )
    p.add_argument(
        "--resources", action="store_true", help="each specialization's registers, spills and shared memory"
    )
    p.add_argument("--ops", action="store_true", help="each specialization's instructions, MMAs, conversions")
    args = p.parse_args(argv)
    if env.TRITON_INTERPRET.get():
        print("triton_compile: unset TRITON_INTERPRET (it replaces the compiler)", file=sys.stderr)
        return 2
    compiler = compile_all(args.arch)
    kernels = Counter(name for name, _ in compiler.compiled)
    print(f"compiled for sm_{args.arch}: " + ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())))
    if args.resources or args.ops:
        seen = set()
        for name, kernel in compiler.compiled:
            if kernel.hash in seen:  # the same specialization, launched again
                continue
            seen.add(kernel.hash)
            constants = {  # the launch's constexpr arguments, by name (block sizes, flags)
                kernel.src.fn.arg_names[path[0]]: value
                for path, value in kernel.src.constants.items()
                if len(path) == 1 and isinstance(value, (int, bool))
            }
            print(name, resources(kernel) if args.resources else "", constants)
            if args.ops:
                print(" ", instruction_mix(kernel))
    for name, error in compiler.failed:
        print(f"FAILED {name}: {error}")
    return 1 if compiler.failed else 0


if __name__ == "__main__":
    sys.exit(main())
