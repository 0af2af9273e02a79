"""The engine's options in one dataclass: every option, its default and its check, and a command-line
flag for each (`add_engine_args`: its help is the option's comment, vLLM's and SGLang's names for it are
aliases, `FLAG_ALIASES`). The server's own options (host, port, API key) are its launcher's."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple, Protocol

SCHEDULE_POLICIES = ("fcfs", "lpm")
CPU_WORKERS = ("auto", "inline", "thread", "process")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # see gapless.attention.make_backend
FUSED_KERNELS = ("auto", "torch", "triton")  # see gapless.model.fused.use_fused_kernels
SPECULATIVE_ALGORITHMS = ("ngram", "draft")  # gapless.engine.spec


def _on_cuda(device: str) -> bool:
    """Whether `device` names CUDA (or "auto" picks it here). Imports torch: call only when it matters."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # auto: checkpoint dtype on GPU, float32 on CPU
    page_size: int = 1
    radix_cache: bool = True
    # token budget of one prefill batch; longer prompts are chunked. None: chosen for the device at start-up
    # (gapless.engine.defaults: 2048 on CPU; on CUDA by GPU memory, 16384 from 60 GiB up)
    chunked_prefill_size: int | None = None
    max_running_requests: int = 256
    kv_cache_tokens: int | None = None  # None: sized as below; a number overrides that, on any device
    # CUDA: share of the GPU's total memory for weights + KV cache (as SGLang's); the KV pool gets what the
    # weights leave of it, less what the measured activation peak and the CUDA graphs need
    mem_fraction_static: float = 0.85
    # CPU only: the KV cache's size in GiB; None: 4 (as vLLM's CPU backend), or half the available RAM where
    # that is less. Never more than max_running_requests full rows can use
    kv_cache_memory_gib: float | None = None
    # auto: triton on CUDA (when it imports), torch on CPU; torch: the reference; triton: the Triton
    # kernels (on CPU only under TRITON_INTERPRET=1, for tests)
    attention_backend: str = "auto"
    # the decoder's norms, RoPE + KV store and activations: auto: fused Triton kernels on CUDA when they
    # agree with torch at start-up (else torch, with a logged reason), torch on CPU; torch; triton (on CPU
    # only under TRITON_INTERPRET=1, for tests). Checked when the model is loaded
    fused_kernels: str = "auto"
    # decode batches of up to this many requests replay CUDA graphs (padded to a captured size); 0: off;
    # None: 256 on CUDA with a kernel backend, off otherwise. On CPU a positive value runs the same padded
    # static-buffer path eagerly (tests)
    cuda_graph_max_bs: int | None = None
    # extend (prefill) batches of up to this many tokens run through piecewise CUDA graphs (the decoder
    # captured between its attentions, `gapless.engine.piecewise_graph`; SGLang's flag); 0: off, the default
    # until a GPU run has measured them. On CPU a positive value runs the same padded pieces eagerly (tests)
    piecewise_cuda_graph_max_tokens: int = 0
    schedule_policy: str = "lpm"
    # context length; None: the model's max_position_embeddings. More than that is refused unless
    # GAPLESS_ALLOW_LONG_MAX_MODEL_LEN=1 (then with a warning)
    max_model_len: int | None = None
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
    # `model` is a checkpoint directory, a GGUF file (or a directory holding one), a built-in name, or a
    # Hugging Face id (gapless.model.source); an id's branch, tag or commit:
    revision: str | None = None
    download_dir: str | None = None  # where Hugging Face downloads go; None: the Hugging Face cache
    tokenizer: str | None = None  # a separate tokenizer (path or Hugging Face id); None: the model's own
    chat_template: str | None = None  # a template file or the template itself; None: the tokenizer's
    trust_remote_code: bool = False  # refused: gapless runs no code from a checkpoint
    # sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) of requests that leave them
    # unset: auto: the checkpoint's generation_config.json (or a GGUF's sampling metadata); vllm: none (the
    # library's defaults, as vLLM's --generation-config vllm); or a folder holding a generation_config.json
    generation_config: str = "auto"
    # scheduler tuning (SGLang's defaults): the expected share of max_tokens a request will really use
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.14
    new_token_ratio_decay_steps: int = 600
    # speculative decoding (gapless.engine.spec): ngram drafts each request's next tokens from its own prompt
    # and output (prompt lookup); draft runs a small model with the same tokenizer (speculative_draft_model);
    # both verify the drafts in one forward of the target; None: off
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4  # tokens drafted per request and step (the verify runs one more)
    speculative_draft_model: str | None = None  # the draft model of speculative_algorithm=draft
    ngram_min: int = 1  # shortest suffix of a request's tokens that ngram matches earlier in them
    ngram_max: int = 4  # longest such suffix (the longest that matches wins, then the latest match)
    # decode batches larger than this run without drafts (verifying K+1 tokens per request stops paying)
    speculative_disable_batch_size: int = 16
    # tensor parallelism (gapless.engine.tp): the model split over this many ranks, one process each (gloo
    # on the CPU, NCCL on CUDA: one GPU per rank), the scheduler running once, on rank 0's node
    tensor_parallel_size: int = 1
    nnodes: int = 1  # machines the ranks span (each runs tensor_parallel_size / nnodes of them)
    node_rank: int = 0  # this machine's place: 0 serves (HTTP, scheduler), the others run ranks only
    # host:port where rank 0 listens for the others (needed with nnodes > 1; default there: torchrun's
    # MASTER_ADDR:MASTER_PORT); None on one machine: a free local port
    dist_init_addr: str | None = None
    # seconds a rank waits for the others (start-up, each collective) before the engine ends with an error
    dist_timeout: float = 60.0
    # data parallelism: engine replicas (a scheduler + model process each, on its own device or CPU cores)
    # behind one API server, requests routed by --load-balance-method (gapless.server.router); server only
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise bad("chunked_prefill_size", "must be >= 1")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size} tokens)")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise bad("kv_cache_memory_gib", "must be > 0")
        if not 0 < self.mem_fraction_static < 1:
            raise bad("mem_fraction_static", "must be in (0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        self._check_graphs(bad)
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
        self._check_speculative(bad)
        self._check_parallel(bad)

    def _check_graphs(self, bad: Any) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise bad("cuda_graph_max_bs", "must be >= 0 (0 turns CUDA graphs off)")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise bad("piecewise_cuda_graph_max_tokens", "must be >= 0 (0 turns them off)")
        if self.piecewise_cuda_graph_max_tokens and self.tensor_parallel_size > 1:
            raise bad("piecewise_cuda_graph_max_tokens", "runs with tensor_parallel_size 1 only for now")

    def _check_parallel(self, bad: Any) -> None:
        """The parallelism options: at least one data-parallel replica; for tensor parallelism, sizes in
        range, ranks spread evenly over the nodes, an address where several nodes must meet (torchrun's
        MASTER_ADDR/MASTER_PORT when none is given)."""
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "must be >= 1")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1 and _on_cuda(self.device):
            raise bad(
                "data_parallel_size",
                "> 1 with tensor_parallel_size > 1 runs on the CPU only for now: on CUDA every replica's "
                "ranks would take the same GPUs",
            )
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        if self.nnodes < 1:
            raise bad("nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in [0, nnodes) = [0, {self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            raise bad("nnodes", f"must divide tensor_parallel_size ({self.tensor_parallel_size})")
        if not self.dist_timeout > 0:
            raise bad("dist_timeout", "must be > 0")
        if self.dist_init_addr is None and self.nnodes > 1 and "MASTER_ADDR" in os.environ:
            self.dist_init_addr = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
        if self.dist_init_addr is None:
            if self.nnodes > 1:
                raise bad("dist_init_addr", "is needed with nnodes > 1: rank 0's host:port")
            return
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad("dist_init_addr", "must be host:port")

    def _check_speculative(self, bad: Any) -> None:
        """The speculative-decoding options: a known algorithm, sizes in range, and no half-built mode."""
        algo = self.speculative_algorithm
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS}")
        if (algo == "draft") != (self.speculative_draft_model is not None):
            raise bad(
                "speculative_draft_model",
                "is the draft model of speculative_algorithm='draft', which needs one and no other uses",
            )
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise bad("speculative_num_draft_tokens", "must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise bad("ngram_min", f"must be >= 1 and <= ngram_max ({self.ngram_max})")
        if self.ngram_max > 16:
            raise bad("ngram_max", "must be <= 16")
        if self.speculative_disable_batch_size < 0:
            raise bad("speculative_disable_batch_size", "must be >= 0 (0: never draft)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


# ------------------------------------------------------------------------------------ command line
# A flag for every option of `EngineConfig`, with the option's comment above as its help (one place
# explains an option), and other servers' names for the same settings (`FLAG_ALIASES`).


class _ArgumentAdder(Protocol):
    """A parser or an argument group."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


class Alias(NamedTuple):
    """Another server's flag for one of gapless's settings."""

    option: str  # the option it sets (an `EngineConfig` field, or a server option such as log_requests)
    source: str  # whose flag it is
    const: object = None  # a switch sets this value; None: the flag takes the option's value


# vLLM's and SGLang's flags for gapless's settings, so a command line written for either runs here. The
# flags they share with gapless (--max-model-len, --max-running-requests, --chunked-prefill-size,
# --mem-fraction-static, --disable-radix-cache, --dtype, --seed, --served-model-name, ...) need no entry.
FLAG_ALIASES: dict[str, Alias] = {
    "--model-path": Alias("model", "SGLang"),
    "--max-num-seqs": Alias("max_running_requests", "vLLM"),
    "--max-num-batched-tokens": Alias("chunked_prefill_size", "vLLM"),
    "--gpu-memory-utilization": Alias("mem_fraction_static", "vLLM"),
    "--context-length": Alias("max_model_len", "SGLang"),
    "--max-total-tokens": Alias("kv_cache_tokens", "SGLang"),
    "--block-size": Alias("page_size", "vLLM"),
    "--random-seed": Alias("seed", "SGLang"),
    "--enable-prefix-caching": Alias("radix_cache", "vLLM", True),
    "--no-enable-prefix-caching": Alias("radix_cache", "vLLM", False),
    "--disable-overlap-schedule": Alias("overlap", "SGLang", False),
    "--enforce-eager": Alias("cuda_graph_max_bs", "vLLM", 0),
    "--disable-cuda-graph": Alias("cuda_graph_max_bs", "SGLang", 0),
    "--disable-piecewise-cuda-graph": Alias("piecewise_cuda_graph_max_tokens", "SGLang", 0),
    "--enable-log-requests": Alias("log_requests", "vLLM", True),
    "--disable-log-stats": Alias("log_stats_interval", "vLLM", 0.0),
    "--speculative-draft-model-path": Alias("speculative_draft_model", "SGLang"),
    "--speculative-ngram-min-match-window-size": Alias("ngram_min", "SGLang"),
    "--speculative-ngram-max-match-window-size": Alias("ngram_max", "SGLang"),
    "--tp": Alias("tensor_parallel_size", "SGLang"),
    "--tp-size": Alias("tensor_parallel_size", "SGLang"),
    "-tp": Alias("tensor_parallel_size", "vLLM"),
    # data parallelism (gapless.server.router): SGLang's names, and vLLM's short one
    "--dp-size": Alias("data_parallel_size", "SGLang"),
    "--dp": Alias("data_parallel_size", "SGLang"),
    "-dp": Alias("data_parallel_size", "vLLM"),
    "-asc": Alias("api_server_count", "vLLM"),  # a server option (gapless.server.launch)
}

# vLLM's and SGLang's parallelism flags gapless does not run (tensor and data parallelism are options
# above), so any size but 1 is refused by name
_PARALLEL_FLAGS = {
    "pipeline": ("--pipeline-parallel-size", "--pp-size", "-pp"),
}

# the dtype names the flag takes: torch's, and vLLM's (half, float) for the same types
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}

# bool options whose command-line flag reads better negated (default on)
_NEGATED_FLAGS = {"overlap": "--disable-overlap", "radix_cache": "--disable-radix-cache"}
_FLAG_TYPES = {"int": int, "float": float, "str": str}
_METAVARS = {
    "int": "N",
    "float": "X",
    "str": "S",
    "device": "{auto,cpu,cuda,cuda:N}",
    "trace_path": "PATH",
    "generation_config": "{auto,vllm,DIR}",
    "speculative_draft_model": "PATH",
}
_CHOICES = {
    "schedule_policy": SCHEDULE_POLICIES,
    "cpu_worker": CPU_WORKERS,
    "attention_backend": ATTENTION_BACKENDS,
    "fused_kernels": FUSED_KERNELS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
}
# the help of options that have no comment in `EngineConfig` (an option's comment is its help)
_FLAG_HELP = {
    "page_size": "tokens per KV cache page; the prefix cache shares whole pages",
    "radix_cache": "reuse the KV cache of shared prompt prefixes (a radix tree)",
    "max_running_requests": "most requests running (decoding) at once",
    "schedule_policy": "which waiting request starts first: lpm (longest cached prefix) or fcfs",
    "min_new_token_ratio": "the lowest that expected share decays to",
    "new_token_ratio_decay_steps": "steps over which the expected share decays to its lowest",
}


def option_comments() -> dict[str, str]:
    """Each `EngineConfig` option's comment: the comment lines right above it and the one on its line.

    Read from this file's source, so the comment a reader sees beside an option is the help its flag
    prints; {} where the source is not shipped."""
    import ast
    import inspect
    import io
    import tokenize

    try:
        source = inspect.getsource(EngineConfig)
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether it is a line of its own)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.lstrip().startswith("#"))
    found: dict[str, str] = {}
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        end = node.end_lineno or node.lineno
        after = [comments[n][0] for n in range(node.lineno, end + 1) if n in comments and not comments[n][1]]
        if above or after:
            found[node.target.id] = " ".join(above + after)
    return found


def add_option(group: _ArgumentAdder, option: str, *flags: str, **kwargs: Any) -> None:
    """Add `option`'s flags: its own (`flags`; default `--option-name`), the other servers' names for it
    that take its value, and their switches that set it to a value (`FLAG_ALIASES`)."""
    own = flags or ("--" + option.replace("_", "-"),)
    aliases = [(flag, a) for flag, a in FLAG_ALIASES.items() if a.option == option]
    group.add_argument(*own, *(flag for flag, a in aliases if a.const is None), dest=option, **kwargs)
    for flag, a in aliases:
        if a.const is not None:
            help_text = f"{a.source}'s flag: sets {option} to {a.const}"
            group.add_argument(
                flag, dest=option, action="store_const", const=a.const, default=None, help=help_text
            )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The checkpoint to run: as the first argument (as `vllm serve MODEL`), or `--model` / `--model-path`."""
    help_text = (
        "a checkpoint directory, a GGUF file, org/name on Hugging Face, or tiny-random (the built-in tiny "
        "random-weight model) (default: SmolLM2-135M-Instruct, fetched on first use)"
    )
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", default=None, help=help_text)
    add_option(parser, "model", default=None, metavar="MODEL", help="the same, as a flag")


def chosen_model(args: argparse.Namespace) -> str | None:
    """The model `add_model_args` read; None when none was named. ValueError when two differ."""
    first, flag = getattr(args, "model_arg", None), getattr(args, "model", None)
    if first is not None and flag is not None and first != flag:
        raise ValueError(f"two models given: {first!r} and --model {flag!r}")
    return first if first is not None else flag


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` option (but `model`): `--page-size`, `--disable-overlap`, ..., with
    their aliases; and the parallelism flags, refused unless 1. Flags left out keep the config's default
    (so GAPLESS_DISABLE_OVERLAP still applies)."""
    group = parser.add_argument_group("engine options")
    comments = option_comments()
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        kind = str(f.type).replace(" | None", "")
        text = comments.get(f.name) or _FLAG_HELP.get(f.name, "")
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        default = None if default is MISSING else default
        if kind == "bool":
            if f.name in _NEGATED_FLAGS:
                flag, text = _NEGATED_FLAGS[f.name], f"turn off {f.name}: {text}"
                add_option(group, f.name, flag, action="store_false", default=None, help=_help(text))
            else:
                add_option(group, f.name, action=argparse.BooleanOptionalAction, help=_help(text, default))
            continue
        choices: tuple[str, ...] | None = tuple(DTYPE_NAMES) if f.name == "dtype" else _CHOICES.get(f.name)
        add_option(
            group,
            f.name,
            type=_FLAG_TYPES[kind],
            default=None,
            choices=choices,
            metavar=None if choices else _METAVARS.get(f.name, _METAVARS[kind]),
            help=_help(text, default),
        )
    parallel = parser.add_argument_group("parallelism (vLLM's and SGLang's flags gapless does not run)")
    for axis, flags in _PARALLEL_FLAGS.items():
        parallel.add_argument(
            *flags, dest=f"{axis}_parallel_size", type=int, default=None, metavar="N", help="only 1"
        )


def _help(text: str, default: object = None) -> str:
    """argparse help: `text` (its % escaped) and the default, if any."""
    text = text.replace("%", "%%")
    return f"{text} (default: {default})" if default is not None else text


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (those left out keep their defaults), dtype names
    made torch's; ValueError for a parallelism size other than 1."""
    for axis, flags in _PARALLEL_FLAGS.items():
        size = getattr(args, f"{axis}_parallel_size", None)
        if size not in (None, 1):
            raise ValueError(
                f"{axis} parallelism is not supported yet ({flags[0]} {size}); gapless runs tensor "
                "and data parallelism (--tensor-parallel-size, --data-parallel-size)"
            )
    names = {f.name for f in fields(EngineConfig)} - {"model"}
    options = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if "dtype" in options:
        options["dtype"] = DTYPE_NAMES[options["dtype"]]
    return options


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config a command line asks for: its model (the default model when it names none) and
    the options it gives; ValueError for a bad one. The model is named as given: `check_engine_config`
    makes it local."""
    options, model = engine_options(args), chosen_model(args)
    if model is None:
        from gapless.default_model.smollm2 import NAME as DEFAULT_MODEL

        model = DEFAULT_MODEL
    return EngineConfig.from_kwargs(model, **options)
