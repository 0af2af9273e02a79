"""The engine's options in one dataclass: every option, its default and its check, and a command-line
flag for each (`add_engine_args`). The server's own options (host, port, API key) are its launcher's."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

SCHEDULE_POLICIES = ("fcfs", "lpm")
CPU_WORKERS = ("auto", "inline", "thread", "process")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # see gapless.attention.make_backend


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # auto: checkpoint dtype on GPU, float32 on CPU
    page_size: int = 1
    radix_cache: bool = True
    chunked_prefill_size: int = 2048  # token budget of one prefill batch; longer prompts are chunked
    max_running_requests: int = 256
    kv_cache_tokens: int | None = None  # None: sized from free memory (below); a number overrides that
    # CUDA: share of the GPU's total memory for weights + KV cache (as SGLang's); the KV pool gets what the
    # weights leave of it, less what the measured activation peak and the CUDA graphs need
    mem_fraction_static: float = 0.85
    kv_memory_fraction: float | None = None  # CPU only: share of available RAM for KV; None: 0.3
    # auto: triton on CUDA (when it imports), torch on CPU; torch: the reference; triton: the Triton
    # kernels (on CPU only under TRITON_INTERPRET=1, for tests)
    attention_backend: str = "auto"
    # decode batches of up to this many requests replay CUDA graphs (padded to a captured size); 0: off;
    # None: 256 on CUDA with a kernel backend, off otherwise. On CPU a positive value runs the same padded
    # static-buffer path eagerly (tests)
    cuda_graph_max_bs: int | None = None
    schedule_policy: str = "lpm"
    max_model_len: int | None = None  # cap on context length; None: the model's max_position_embeddings
    seed: int = 0  # draws the seeds of requests that bring none, so a run is reproducible
    # overlap scheduling: the host schedules batch N+1 and processes batch N-1 while the device runs N.
    # Off with overlap=False, `--disable-overlap`, or GAPLESS_DISABLE_OVERLAP=1.
    overlap: bool = field(default_factory=lambda: os.environ.get("GAPLESS_DISABLE_OVERLAP", "0") in ("", "0"))
    # where the device side runs on a CPU: inline, thread (a worker thread) or process (a device process);
    # auto: the device process when overlapping on a machine with at least 4 cores, else inline
    cpu_worker: str = "auto"
    # torch threads of the device side; None: torch's default (a pinned device process: one per core it has)
    device_threads: int | None = None
    # CPU device process: pin the host to one core and the device to the others (undone when it closes)
    cpu_affinity: bool = True
    # testing only: seeded random delays on both sides of the device stream, and a runner that raises when
    # a decode reads an unwritten future-token slot (a host sync per decode); see engine/stream/chaos.py
    chaos_seed: int | None = None
    trace_path: str | None = None  # write a Chrome/Perfetto trace of host and device spans here on shutdown
    # what `model` names is resolved by gapless.model.source: a checkpoint directory, a GGUF file (or a
    # directory holding one), a built-in name, or a Hugging Face id at `revision`, downloaded into
    # `download_dir` (None: the Hugging Face cache)
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None  # a separate tokenizer (path or Hugging Face id); None: the model's own
    chat_template: str | None = None  # a template file or the template itself; None: the tokenizer's
    trust_remote_code: bool = False  # refused: gapless runs no code from a checkpoint
    # scheduler tuning (SGLang's defaults): the expected share of max_tokens a request will really use
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.14
    new_token_ratio_decay_steps: int = 600

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.chunked_prefill_size < 1:
            raise bad("chunked_prefill_size", "must be >= 1")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size} tokens)")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction < 1:
            raise bad("kv_memory_fraction", "must be in (0, 1)")
        if not 0 < self.mem_fraction_static < 1:
            raise bad("mem_fraction_static", "must be in (0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise bad("cuda_graph_max_bs", "must be >= 0 (0 turns CUDA graphs off)")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.cpu_worker not in CPU_WORKERS:
            raise bad("cpu_worker", f"must be one of {CPU_WORKERS}")
        if self.device_threads is not None and self.device_threads < 1:
            raise bad("device_threads", "must be >= 1")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", "must be auto, cpu, cuda or cuda:N")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


# bool options whose command-line flag reads better negated (default on)
_NEGATED_FLAGS = {"overlap": "--disable-overlap", "radix_cache": "--disable-radix-cache"}
_FLAG_TYPES = {"int": int, "float": float, "str": str}
_FLAG_HELP = {"chaos_seed": "testing only: seeded random delays around the device stream, future-slot checks"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` option (but `model`): `--page-size`, `--disable-overlap`, ... Flags left
    out keep the config's default (so GAPLESS_DISABLE_OVERLAP still applies)."""
    group = parser.add_argument_group("engine options")
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        kind = str(f.type).replace(" | None", "")
        default = f.default if f.default is not MISSING else None
        if kind == "bool":
            if f.name in _NEGATED_FLAGS:
                group.add_argument(_NEGATED_FLAGS[f.name], dest=f.name, action="store_false", default=None)
            else:
                group.add_argument(
                    "--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction
                )
            continue
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_FLAG_TYPES[kind],
            default=None,
            help=_FLAG_HELP.get(f.name, f"default: {default}" if default is not None else None),
        )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (those left out keep their defaults)."""
    names = {f.name for f in fields(EngineConfig)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}
