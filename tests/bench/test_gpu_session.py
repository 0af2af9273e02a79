"""`bench/gpu_session.sh` is run only when a session is lent a GPU, for a few minutes: a misspelt flag
there costs a part. Each part runs here with a stand-in for Python that records each command line instead
of running it; then every benchmark's command line goes through that benchmark's own argument parser, in
this process (with CUDA reported available, as on the GPU machine, which a parser may ask), and every
pytest command collects its tests, which must select some. The `all` part's plan is checked too: its
steps in order of importance, one tarball and one summary in $OUT, and its time budget kept."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gapless import env as gapless_env

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("all", "suite", "serve", "prefill", "sweep", "quant")
# the `all` part's steps, most important first (issue 34 item 6; issue 36's, the one open, first)
ALL_STEPS = ["quant", "cuda_tests", "bench/run", "kernels", "latency", "served", "lora", "vision"]
RECORDER = textwrap.dedent(
    """\
    import json, os, sys, time
    with open(os.environ["GPU_SESSION_COMMANDS"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    with open(os.environ["GPU_SESSION_COMMANDS"] + ".env", "a") as f:  # (gapless's variables it ran with)
        f.write(json.dumps({k: v for k, v in os.environ.items() if k.startswith("GAPLESS_")}) + "\\n")
    if sys.argv[1:2] == ["-m"]:
        time.sleep(float(os.environ.get("STAND_IN_SLEEP", "0")))
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


def _run_part(script: Path, part: str, tmp_path: Path, cwd: Path, **env_extra: str) -> list[list[str]]:
    """Run `script`'s part with the recorder as Python; the command lines it ran Python with (and, in
    `tmp_path / "commands.jsonl.env"`, line for line, the GAPLESS_ variables each ran with)."""
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
        "WORK": str(tmp_path / "work"),
        **env_extra,
    }
    r = subprocess.run(
        ["bash", str(script), part], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in commands.read_text().splitlines()]


def _envs(tmp_path: Path) -> list[dict[str, str]]:
    """The GAPLESS_ variables of each command `_run_part` recorded in `tmp_path`, in its order."""
    return [json.loads(line) for line in (tmp_path / "commands.jsonl.env").read_text().splitlines()]


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


@pytest.mark.slow
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
    if part == "all":  # the benchmarks in order of importance
        assert [c[1] for c in benches] == [
            *["gapless.bench.quant"] * 6,  # gpu_quant.sh: make, five runs of the targets,
            *["gapless.bench.gpu"] * 3,  # the bf16 and the FP8 KV cache's runs, the FP8's at 5 stages,
            *["gapless.bench.quant"] * 2,  # the 8B's FP8 in Qwen's own block layout, the 0.6B's with PDL;
            # tables: decode attention over each cache in 64- and 128-key blocks; int4 TPOT on swapped
            # tiles and the Triton GEMM, NF4's, NVFP4's, int4 with its head, FP8's, the 0.6B's FP8 with
            # activations, norms launched,
            "gapless.bench.kernels",
            *["gapless.bench.quant"] * 7,
            "gapless.bench.kernels",  # decode attention over each cache,
            "gapless.bench.int4_gemm",  # the int4 GEMV's stages and splits,
            "gapless.bench.gpu",  # the bf16 KV cache's run at 5 stages,
            "gapless.bench.quant",  # the 8B's FP8 with PDL,
            "gapless.bench.quant",  # (the FP8 GEMV's stages: a script) the mixture's bf16,
            "gapless.bench.int4_gemm",  # (FP8's swapped tiles alone: a script) int4's,
            *["gapless.bench.quant"] * 2,  # the mixture's FP8 and int4, (the FP8 sweep: a script)
            "gapless.bench.kernels",  # decode attention at batch 1,
            "gapless.bench.int4_gemm",  # the int4 GEMMs,
            *["gapless.bench.quant"] * 2,  # act-order int4, the mixture's, (the FP8 GEMM's table: a script)
            "gapless.bench.quant",  # the 8B's FP8 with x rounded by launches,
            "gapless.bench.quant",  # gemlite's run,
            *["gapless.bench.quant"] * 2,  # the 8B as a Q4_K_M GGUF file: written, timed,
            "gapless.bench.quant",  # the report
            "gapless.bench.gpu",  # gpu_bench.sh's one benchmark
            "gapless.bench.kernels",
            "gapless.bench.latency",
            "gapless.bench.served_vs_offline",
            "gapless.bench.lora",
            "gapless.bench.vision",
        ]
    if tests:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests/bench'}")  # freeze_guard
        r = subprocess.run(
            [sys.executable, "-c", COLLECTOR, json.dumps(tests)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = (tmp_path / "work" / "steps.log").read_text()
    assert set(re.findall(r": exit (\d+) in", steps)) == {"0"}, steps
    # what the device tool brings back: one tarball of everything and the summary, no more
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"gpu_session_{part}.tar.gz", f"gpu_session_{part}.txt"]
    with tarfile.open(out / f"gpu_session_{part}.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert {"env.log", "steps.log"} <= names
    ran = re.findall(r"^(\S+): exit 0 in", steps, flags=re.M)
    assert {f"{n}.log" for n in ran} <= names
    summary = (out / f"gpu_session_{part}.txt").read_text()
    assert all(f"{n}: exit 0" in summary for n in ran)
    if part == "all":
        assert ran == ALL_STEPS


# the `all` part's steps' own limits (bench/gpu_session.sh)
ALL_LIMITS = {
    "quant": 320,
    "cuda_tests": 180,
    "bench/run": 140,
    "kernels": 75,
    "latency": 100,
    "served": 100,
    "lora": 70,
    "vision": 90,
}


@pytest.mark.slow
def test_the_all_part_keeps_its_budget(tmp_path):
    """Each step is cut to what the budget leaves when it starts (less the SIGINT grace, 15 s, and the
    packing, 10 s), a step with under 20 s left is skipped, and the part ends within its budget: with
    steps of 12 s in a 60 s budget, whatever this machine's start-up takes, a step is skipped."""
    budget = 60
    t0 = time.monotonic()
    _run_part(
        ROOT / "bench/gpu_session.sh",
        "all",
        tmp_path,
        ROOT,
        SESSION_BUDGET_S=str(budget),
        STAND_IN_SLEEP="12",
    )
    assert time.monotonic() - t0 < budget
    steps = (tmp_path / "work" / "steps.log").read_text()
    started = re.findall(r"^== \S+ \+(\d+) s (\S+) \(limit (\d+) s\)", steps, flags=re.M)
    for at, name, limit in started:
        assert int(limit) == min(ALL_LIMITS[name], budget - int(at) - 25) >= 20, steps
    skipped = re.findall(r"^(\S+): skipped, (\d+) s of 60 gone", steps, flags=re.M)
    assert skipped and all(budget - int(at) - 25 < 20 for _, at in skipped), steps
    assert [name for _, name, _ in started] + [name for name, _ in skipped] == ALL_STEPS
    assert (tmp_path / "out" / "gpu_session_all.tar.gz").exists()


def test_a_bad_flag_is_refused(tmp_path, monkeypatch, capsys):
    """The check is not vacuous: a flag the benchmark does not take is refused by its parser."""
    (tmp_path / "bench").mkdir()
    script = tmp_path / "bench/gpu_session.sh"
    text = (ROOT / "bench/gpu_session.sh").read_text()
    script.write_text(text.replace("--concurrency 1 4 16", "--concurrencyy 1 4 16", 1))
    shutil.copy(ROOT / "bench/gpu_bench.sh", tmp_path / "bench/gpu_bench.sh")
    commands = _run_part(script, "all", tmp_path, tmp_path)
    (bad,) = [c for c in commands if c[:2] == ["-m", "gapless.bench.latency"] and "--concurrencyy" in c]
    with pytest.raises(SystemExit) as e:
        _parse_bench(bad, monkeypatch)
    assert e.value.code == 2 and "--concurrencyy" in capsys.readouterr().err


def test_the_freeze_guard_names_the_test_that_leaves_the_heap_frozen(tmp_path):
    """The `suite` part's plugin: a test that freezes and does not unfreeze is named (once: it unfreezes),
    on stdout and in the log file; the tests around it are not."""
    (tmp_path / "test_leak.py").write_text(
        "import gc\n\ndef test_before():\n    pass\n\ndef test_leaks():\n    gc.freeze()\n\n"
        "def test_after():\n    assert gc.get_freeze_count() == 0\n"
    )
    log = tmp_path / "frozen.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests/bench"), GAPLESS_FREEZE_LOG=str(log))
    plugins = ["-p", "no:cacheprovider", "-p", "freeze_guard"]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "test_leak.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = log.read_text().splitlines()
    assert line.startswith("FROZEN after test_leak.py::test_leaks: ") and line in r.stdout


def test_the_cuda_steps_selection_takes_the_fp8_gemvs_fused_paths():
    """The `all` part's CUDA tests are a `-k` selection: the FP8 GEMV's tests that take a fused norm or
    activation (which equal bits and compiled kernels only a GPU checks for real) are in it by name."""
    text = (ROOT / "bench/gpu_session.sh").read_text()
    (expression,) = re.findall(r'step \d+ cuda_tests .*?-k "([^"]+)"', text, flags=re.S)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", expression,
         "tests/model/test_fp8_rounding.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    selected = {line.split("::")[1].split("[")[0] for line in r.stdout.splitlines() if "::" in line}
    gemv = {
        "test_the_gemv_takes_a_fused_gated_activation_as_it_loads_x",
        "test_at_one_row_the_fp8_gemv_runs_the_mlps_activation_fused",
        "test_the_gemv_takes_a_fused_rmsnorm_as_it_loads_x",
        "test_at_one_row_the_fp8_gemvs_run_the_layers_norms_fused",
    }
    assert r.returncode == 0 and gemv <= selected, r.stdout[-3000:] + r.stderr[-3000:]


def test_skip_leaves_the_named_steps_out(tmp_path):
    """SKIP="latency served": the all part runs every other step, and says which it skipped."""
    commands = _run_part(ROOT / "bench/gpu_session.sh", "all", tmp_path, ROOT, SKIP="latency served")
    steps = (tmp_path / "work" / "steps.log").read_text()
    assert "latency: skipped (SKIP)" in steps and "served: skipped (SKIP)" in steps
    ran = re.findall(r"^== \S+ \+\d+ s (\S+) ", steps, flags=re.M)
    assert ran == [name for name in ALL_STEPS if name not in ("latency", "served")], steps
    assert not any("gapless.bench.latency" in c for cmd in commands for c in cmd)


def test_the_quant_scripts_tables_phase_runs_alone(tmp_path, monkeypatch):
    """`QUANT_PHASES=tables bash bench/gpu_quant.sh` (a second call after `all`): first decode attention at
    batch 256 over a bf16 and an fp8 cache in 64- and 128-key blocks (the FP8 KV target, the furthest from
    its figure), then Qwen3-8B's int4 TPOT on the swapped tiles and on the Triton GEMM, its bitsandbytes
    NF4, NVFP4 and GPTQ-with-its-head TPOT, its FP8 TPOT on the swapped tiles and Qwen3-0.6B's FP8 with
    its activations and norms launched first, decode attention over each cache at 2 and 5 stages with its
    registers capped or not (the FP8 KV target's lever), the int4 GEMV's stages and splits (factored or
    not, against tinygemm), the bf16 KV cache's nano-vllm run at 5 stages, the 8B's FP8 with PDL, the FP8
    GEMV's stages (short, each deciding a default); then the mixture's TPOT in bf16, the swapped tiles
    alone, what no GPU has run (the mixture quantized), the FP8 GEMM's sweep and decode attention at batch
    1, then the int4 GEMMs' table (without gemlite, whose first call tunes past the step's limit), last
    the 8B written as a Q4_K_M GGUF file and timed; no TPOT run of the targets and no other nano-vllm run;
    the targets phase alone the reverse, its FP8 KV runs at the default stages and at 5."""
    (tmp_path / "t").mkdir(), (tmp_path / "g").mkdir()
    tables = _run_part(ROOT / "bench/gpu_quant.sh", "", tmp_path / "t", ROOT, QUANT_PHASES="tables")
    # (less gpu_bench.sh's versions: a script on stdin)
    tables, envs = zip(*((c, e) for c, e in zip(tables, _envs(tmp_path / "t")) if c[:1] != ["-"]))
    assert tables[0][:3] == ["-m", "gapless.bench.quant", "make"]  # (both phases make the shapes first)
    blocks, int4_swapped, int4_triton, nf4, nvfp4, int4_head, fp8_swapped, launched = tables[1:9]
    attention, int4_stages, staged, pdl, fp8_stages, mixture = tables[9:15]
    assert staged[:2] == ["-m", "gapless.bench.gpu"] and "auto" in staged  # (the bf16 KV run, 5 stages)
    tpots = (int4_swapped, int4_triton, nf4, nvfp4, int4_head, fp8_swapped, launched, pdl, mixture)
    assert all(c[:3] == ["-m", "gapless.bench.quant", "run"] for c in tpots)
    models = [c[3].rsplit("/", 1)[1] for c in tpots]
    assert models == [
        "qwen3-8b-awq", "qwen3-8b-awq", "qwen3-8b-nf4", "qwen3-8b-nvfp4", "qwen3-8b-gptq-head", "qwen3-8b",
        "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b",
    ]  # fmt: skip
    assert attention[:2] == ["-m", "gapless.bench.kernels"] and "fp8" in attention  # (over each KV cache)
    assert attention[attention.index("--decode-stages") + 1 :][:2] == ["2", "5"]
    assert attention[attention.index("--decode-max-registers") + 1 :][:3] == ["0", "96", "128"]
    assert blocks[:2] == ["-m", "gapless.bench.kernels"]  # (first: each cache, 64 and 128 keys a block)
    assert blocks[blocks.index("--kv-cache-dtype") + 1 :][:2] == ["auto", "fp8"]
    assert blocks[blocks.index("--decode-block-n") + 1 :][:2] == ["0", "128"]
    assert fp8_stages[0].endswith("fp8_gemm.py") and "--gemv-stages" in fp8_stages
    assert int4_stages[:2] == ["-m", "gapless.bench.int4_gemm"] and "tinygemm" in int4_stages
    assert int4_stages[int4_stages.index("--stages") + 1 :][:2] == ["1", "4"]
    assert int4_stages[int4_stages.index("--split-k") + 1 :][:4] == ["0", "2", "4", "16"]  # (now, before)
    assert int4_stages[int4_stages.index("--factored") + 1 :][:2] == ["0", "1"]  # (PTX values, factored)
    fp8_alone, int4_alone = tables[15:17]
    assert fp8_alone[0].endswith("fp8_gemm.py") and "--swapped" in fp8_alone
    assert int4_alone[:2] == ["-m", "gapless.bench.int4_gemm"] and "--swapped" in int4_alone
    assert [c[3].rsplit("/", 1)[1] for c in tables[17:19]] == ["qwen3-30b-a3b", "qwen3-30b-a3b-awq"]
    sweep, batch1, int4_gemm = tables[19:22]
    assert batch1[:2] == ["-m", "gapless.bench.kernels"] and "--decode-min-split-len" in batch1
    assert "--decode-prefetch" in batch1
    assert sweep[0].endswith("fp8_gemm.py") and "--sweep" in sweep
    assert int4_gemm[:2] == ["-m", "gapless.bench.int4_gemm"] and "--ptx-values" in int4_gemm
    assert "gemlite" not in int4_gemm
    write, gguf = tables[-3:-1]  # (last before the report: the 8B as a GGUF file, written then timed)
    assert write[:3] == ["-m", "gapless.bench.quant", "gguf"] and write[3].endswith("/qwen3-8b")
    assert gguf[3].endswith("/qwen3-8b-gguf") and "load_format=auto" in gguf
    runs = [c for c in tables if c[:3] == ["-m", "gapless.bench.quant", "run"]]
    assert runs and not any("--profile" in c for c in runs)  # (the targets' runs are profiled)
    assert [c for c in tables if "gapless.bench.gpu" in c] == [staged]  # (no other nano-vllm run)
    assert envs[tables.index(staged)]["GAPLESS_DECODE_STAGES"] == "5"
    assert envs[tables.index(pdl)]["GAPLESS_PDL"] == "1"
    assert envs[tables.index(fp8_swapped)]["GAPLESS_FP8_SWAPPED"] == "1"
    assert {"GAPLESS_FP8_UNFUSED_ACTIVATION", "GAPLESS_FP8_UNFUSED_NORM"} <= set(envs[tables.index(launched)])
    targets = _run_part(ROOT / "bench/gpu_quant.sh", "", tmp_path / "g", ROOT, QUANT_PHASES="targets")
    # every variable a run is given is one gapless reads (a misspelt one would time the default)
    given = {name for phase in ("t", "g") for e in _envs(tmp_path / phase) for name in e}
    assert given and given <= set(gapless_env.VARIABLES), given - set(gapless_env.VARIABLES)
    runs = [c for c in targets if c[:3] == ["-m", "gapless.bench.quant", "run"]]
    assert len(runs) == 7 and all("--profile" in c for c in runs)
    assert runs[-2][3].endswith("/qwen3-8b-fp8")  # (Qwen's own FP8 layout, after the KV runs)
    kv_runs = [c for c in targets if c[:2] == ["-m", "gapless.bench.gpu"]]
    assert len(kv_runs) == 3 and all("--profile-steps" in c for c in kv_runs)
    caches = [c[c.index("--kv-cache-dtype") + 1] for c in kv_runs]
    stages = [_envs(tmp_path / "g")[targets.index(c)].get("GAPLESS_DECODE_STAGES") for c in kv_runs]
    assert list(zip(caches, stages)) == [("auto", None), ("fp8", None), ("fp8", "5")]
    assert not any(c[0].endswith("fp8_gemm.py") for c in targets)
    for args in runs:
        _parse_bench(args, monkeypatch)
