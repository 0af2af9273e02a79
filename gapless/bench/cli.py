"""What the benchmarks share: their common flags, the model they run, the machine, and writing results.

Each benchmark (`offline`, `gpu`, `overlap`, `serving`) is a script around what only it measures; what
they have in common is here, once: the workload flags of the offline benchmarks and how their defaults
fill in, `--engine-option`, the model (`--model`, or a random-weight qwen3 of `--size` built on first
use) with its shape and byte counts, the machine description the offline benchmarks' JSON carries, the
command line that reproduces a run, progress lines, the JSON file and markdown tables. It imports torch
only where a function needs it, so the serving benchmark (an HTTP client) starts without it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gapless.bench.workload import Workload, random_workload

# The offline benchmarks' workload sizes (`--num-seqs`, `--min-input`, ...) in `random_workload`'s order.
WORKLOAD_SIZES = ("num_seqs", "min_input", "max_input", "min_output", "max_output")
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """A progress line on stderr, with seconds since start and the wall clock (to line up with other logs,
    e.g. nvidia-smi's)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{time.perf_counter() - _T0:7.1f}s {stamp}] {msg}", file=sys.stderr, flush=True)


def positive_int(s: str) -> int:
    """argparse type: an int >= 1."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run, for the report and the JSON."""
    return shlex.join(["python", "-m", module, *argv])


# ---------------------------------------------------------------------------------------------- flags


def add_workload_args(
    p: argparse.ArgumentParser, name: str, defaults: dict[str, int], quick_help: str
) -> argparse._ArgumentGroup:
    """The workload flags of the offline benchmarks (sizes left None: `finish_args` fills them in)."""
    w = p.add_argument_group(f"workload (defaults: {name}, or --quick's)")
    w.add_argument("--num-seqs", type=int, help=f"requests (default {defaults['num_seqs']})")
    w.add_argument("--min-input", type=int, help=f"shortest prompt (default {defaults['min_input']})")
    w.add_argument("--max-input", type=int, help=f"longest prompt (default {defaults['max_input']})")
    w.add_argument("--min-output", type=int, help=f"shortest output (default {defaults['min_output']})")
    w.add_argument("--max-output", type=int, help=f"longest output (default {defaults['max_output']})")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default 0, as nano-vllm)")
    w.add_argument("--quick", action="store_true", help=quick_help)
    return w


def add_model_args(
    p: argparse.ArgumentParser, default_size: str, sizes: Sequence[str], title: str = "model"
) -> argparse._ArgumentGroup:
    """`--model PATH`, or `--size` of the random-weight qwen3 built when no path is given (`model_path`)."""
    m = p.add_argument_group(title)
    m.add_argument("--model", help="HF checkpoint dir (default: the random-weight qwen3 of --size, built)")
    m.add_argument(
        "--size",
        default=default_size,
        choices=sizes,
        help=f"shape of the built-in random qwen3 when --model is not given (default {default_size})",
    )
    return m


def add_engine_option_arg(group: argparse._ArgumentGroup, examples: str) -> None:
    """`--engine-option KEY=VALUE`, repeatable: further `LLM` options (parsed by `finish_args`)."""
    group.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE", help=examples)


def parse_engine_options(items: list[str]) -> dict[str, Any]:
    """`--engine-option KEY=VALUE` items as LLM options: VALUE as a Python literal (False, 16, 0.5, None),
    else as a bare string."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value  # a bare string
    return options


def finish_args(
    p: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, int], quick: dict[str, int]
) -> None:
    """Fill the workload sizes left unset (from `quick` under --quick, else `defaults`) and parse the
    `--engine-option` items (`take_engine_options`)."""
    for name, value in (quick if args.quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    take_engine_options(p, args)


def take_engine_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with its `--engine-option` items parsed into `args.engine_options`; a bad one is a usage
    error of `p`."""
    try:
        args.engine_options = parse_engine_options(args.engine_option)
    except ValueError as e:
        p.error(str(e))
    return args


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The random workload the workload flags describe."""
    sizes = {name: getattr(args, name) for name in WORKLOAD_SIZES}  # random_workload's own parameter names
    return random_workload(**sizes, vocab_size=vocab_size, seed=args.seed)


def workload_summary(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """The workload's parameters (from `args`) and its token counts, for the JSON."""
    sizes = {name: getattr(args, name) for name in WORKLOAD_SIZES}
    return dict(
        sizes,
        num_seqs=len(work),
        seed=args.seed,
        input_tokens=work.input_tokens,
        output_tokens=work.output_tokens,
    )


def workload_line(w: dict[str, Any]) -> str:
    """The report's line for a `workload_summary`."""
    return (
        f"workload: {w['num_seqs']} requests, prompts uniform in [{w['min_input']}, {w['max_input']}] "
        f"({w['input_tokens']:,} tokens), outputs uniform in [{w['min_output']}, {w['max_output']}] "
        f"({w['output_tokens']:,} tokens), random token ids, seed {w['seed']}"
    )


# ---------------------------------------------------------------------------------------------- model


def model_path(args: argparse.Namespace, dtype: str = "float32") -> tuple[Path, float]:
    """The checkpoint `--model` names, or the random-weight qwen3 of `--size` in `dtype` (built on first
    use, then cached); and the seconds it took to build (0 when given or cached)."""
    if args.model:
        return Path(args.model), 0.0
    import torch

    from gapless.testing import cached_checkpoint

    # float32 is the default of `make_checkpoint`: leave it out so the tests' cached checkpoints are shared
    kw = {} if dtype == "float32" else {"dtype": getattr(torch, dtype)}
    t0 = time.perf_counter()
    path = cached_checkpoint("qwen3", size=args.size, **kw)
    return path, time.perf_counter() - t0


def model_info(path: Path, dtype: str = "float32") -> dict[str, Any]:
    """Shape, parameter count (from the safetensors headers, no weights read) and the bytes decode reads
    per token and per step in `dtype`."""
    import torch
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    params = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                params += torch.Size(st.get_slice(name).get_shape()).numel()
    return dict(
        model_type=cfg.get("model_type"),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=cfg.get("tie_word_embeddings"),
        params=params,
        dtype=dtype,
        weight_bytes=params * elem,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * elem,
    )


# ---------------------------------------------------------------------------------------------- machine


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _nvidia_smi() -> dict[str, str] | None:
    fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def machine(device: str = "cpu", threads: int | None = None) -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, torch's intra-op `threads` (default: its current
    setting), library versions, and on CUDA the GPU (whether the machine was shared is measured per run,
    see `gapless.bench.runs.OtherLoad`)."""
    import torch

    m: dict[str, Any] = dict(
        device=device,
        cpu=cpu_name(),
        cores=os.cpu_count(),
        usable_cores=len(os.sched_getaffinity(0)),
        threads=torch.get_num_threads() if threads is None else threads,
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_version("triton"),
        transformers=_version("transformers"),
    )
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            nvidia_smi=_nvidia_smi(),
        )
    return m


def machine_line(m: dict[str, Any]) -> str:
    """The report's line for a `machine` description."""
    if "gpu" in m:
        smi = m.get("nvidia_smi") or {}
        sm = m["compute_capability"].replace(".", "")
        driver = f", driver {smi['driver_version']}" if smi.get("driver_version") else ""
        where = f"{m['gpu']} ({m['gpu_memory_gib']} GiB, {m['sms']} SMs, sm_{sm}{driver}), CUDA {m['cuda']}"
    else:
        where = f"{m['cpu']}, {m['usable_cores']} usable cores of {m['cores']}, no GPU"
    return (
        f"machine: {where}; torch {m['torch']} ({m['threads']} threads), triton {m['triton']}, "
        f"transformers {m['transformers']}, python {m['python']}"
    )


# ---------------------------------------------------------------------------------------------- output


def write_json(path: str | Path, res: dict[str, Any]) -> None:
    """Results as JSON (anything JSON cannot hold, e.g. a dtype, as its `str`)."""
    Path(path).write_text(json.dumps(res, indent=1, default=str) + "\n")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """A markdown table's lines; `align` has one letter a column: `l` (text) or `r` (numbers)."""
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines
