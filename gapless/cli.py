"""The command line's engine options: a flag for every `EngineConfig` option (`add_engine_args`), its help
the option's own (`metadata["help"]`, so it is there wherever the package is installed from), and vLLM's
and SGLang's names for the same settings as aliases (`FLAG_ALIASES`), their switches for what gapless
does anyway (`ALREADY_SO`) and gapless's names for theirs (`FOREIGN_FLAGS`), so a command line written for
either runs here. `gapless serve` and `gapless chat` build their parsers from it; it imports nothing
heavy."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, NamedTuple, Protocol

from gapless.config import (
    ATTENTION_BACKENDS,
    CPU_WORKERS,
    FUSED_KERNELS,
    LOAD_FORMATS,
    POOLING_TYPES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TASK_NAMES,
    EngineConfig,
)


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
    "--disable-log-requests": Alias("log_requests", "vLLM", False),  # (vLLM's older flag: the default)
    "--tokenizer-path": Alias("tokenizer", "SGLang"),
    "-q": Alias("quantization", "vLLM"),
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
    "--runner": Alias("task", "vLLM"),  # auto, generate, pooling
    "--convert": Alias("task", "vLLM"),  # embed, classify
}

# vLLM's and SGLang's flags with no flag of the same meaning here, and what to use instead
FOREIGN_FLAGS = {
    "--num-gpu-blocks-override": "vLLM's; the KV pool is sized in tokens here: --kv-cache-tokens",
    "--pooler-config": "vLLM's; here --pooling-type and --normalize",
    "--override-pooler-config": "vLLM's; here --pooling-type and --normalize",
    "--is-embedding": "SGLang's; here --task embed",
    "--lora-paths": "SGLang's; here --enable-lora --lora-modules NAME=PATH ...",
    "--max-loras-per-batch": "SGLang's; here --max-loras",
    "--base-gpu-id": "SGLang's; here --device cuda:N",
    "--max-prefill-tokens": "SGLang's; a prefill batch's tokens here: --chunked-prefill-size",
    "--nccl-port": "SGLang's; the ranks meet at --dist-init-addr HOST:PORT here",
    "--tokenizer-mode": "vLLM's; the checkpoint's Hugging Face tokenizer is the one run here",
    "--enable-torch-compile": "SGLang's; on a CPU, --cpu-compile; on a GPU the kernels are Triton's already",
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
    "load_format": LOAD_FORMATS,
    "task": tuple(TASK_NAMES),
    "pooling_type": POOLING_TYPES + tuple(t.upper() for t in POOLING_TYPES),
}


def human_int(text: str) -> int:
    """An integer as vLLM's flags take one: 32768, or with a suffix, 32k (x 1000) or 32K (x 1024)."""
    text = text.strip()
    if text[-1:] in _DECIMAL and text[:-1].replace(".", "", 1).isdigit():
        return int(float(text[:-1]) * _DECIMAL[text[-1]])
    if text[-1:] in _BINARY and text[:-1].isdigit():
        return int(text[:-1]) * _BINARY[text[-1]]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (an integer: 4096, 4k, 4K)") from None


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def _format_name(text: str) -> str | None:
    """`--quantization`'s value: vLLM's "None" (or "none") is no format."""
    return None if text.lower() == "none" else text


def _algorithm(text: str) -> str:
    """`--speculative-algorithm`'s value, as SGLang writes it too: NGRAM, STANDALONE (a draft model)."""
    return {"standalone": "draft"}.get(text.lower(), text.lower())


# options whose flag reads its value otherwise than as its type: vLLM's and SGLang's spellings
_VALUE_TYPES: dict[str, Any] = {
    "max_model_len": human_int,
    "quantization": _format_name,
    "speculative_algorithm": _algorithm,
}

# vLLM's and SGLang's flags that ask for what gapless does anyway: taken, and nothing changes
ALREADY_SO: dict[str, str] = {
    "--enable-chunked-prefill": "vLLM's: a prompt longer than --chunked-prefill-size is always chunked",
    "--enable-auto-tool-choice": "vLLM's: tool_choice auto runs wherever --tool-call-parser names a parser",
    "--enable-metrics": "SGLang's: /metrics is always served",
}
# theirs that take a value gapless has no use for: taken, and said so in the help
UNUSED_VALUES: dict[str, str] = {
    "--swap-space": "vLLM's CPU swap space: a preempted request is retracted and recomputed, not swapped",
    "--compilation-config": "vLLM's torch.compile and CUDA graph settings (JSON; also -O: -O3, -O 3, "
    "-O.level=3, -O JSON): not read; the decode CUDA graphs here are --cuda-graph-max-bs's (vLLM's capture "
    "sizes count tokens, prefill too), torch.compile on a CPU --cpu-compile",
    "--optimization-level": "vLLM's optimization level (newer releases' -O): not read either",
    "--uvicorn-log-level": "vLLM's log level for its HTTP server alone: here it logs at --log-level",
}
# their short flags for the same: vLLM's -O (older releases: --compilation-config, newer: its level)
_SHORT_FLAGS = {"--compilation-config": ("-O",)}
# the flags whose dotted form vLLM reads as one key of their JSON (-O.level=3, --compilation-config.level 3)
DOTTED_FLAGS = ("-O", "--compilation-config")


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """`ALREADY_SO`'s switches and `UNUSED_VALUES`' flags, so a command line written for vLLM or SGLang
    runs here unchanged; and vLLM's `--speculative-config` (`speculative_options`)."""
    group = parser.add_argument_group("vLLM's and SGLang's flags for what gapless does anyway (no effect)")
    for flag, why in ALREADY_SO.items():
        group.add_argument(flag, action="append_const", const=flag, dest="already_so", help=why)
    for flag, why in UNUSED_VALUES.items():
        dest = f"unused_{flag[2:].replace('-', '_')}"
        group.add_argument(flag, *_SHORT_FLAGS.get(flag, ()), dest=dest, metavar="X", help=why)
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": N, '
        '"prompt_lookup_max": M}, or {"model": PATH, "num_speculative_tokens": K} (a draft model), '
        "as --speculative-algorithm and its options",
    )


# vLLM's --speculative-config keys gapless reads, and the options they set
_SPECULATIVE_KEYS = {
    "num_speculative_tokens": "speculative_num_draft_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "model": "speculative_draft_model",
}


def speculative_options(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON as gapless's options: method "ngram" (prompt lookup), or a draft
    "model" (method "draft_model", or none); ValueError naming a method or a key not run here."""
    try:
        spec = json.loads(text)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config {text!r}: not a JSON object")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    algorithm = {"ngram": "ngram", "draft_model": "draft"}.get(str(method))
    if algorithm is None or (algorithm == "draft") != bool(spec.get("model")):
        raise ValueError(
            f"--speculative-config: method {method!r} is not built here; ngram (prompt lookup) and a "
            'draft model ({"model": PATH}) are'
        )
    unread = sorted(set(spec) - {"method", *_SPECULATIVE_KEYS})
    if unread:
        raise ValueError(
            f"--speculative-config: {', '.join(unread)} not read here; {', '.join(_SPECULATIVE_KEYS)} are"
        )
    return {
        "speculative_algorithm": algorithm,
        **{_SPECULATIVE_KEYS[k]: v for k, v in spec.items() if k != "method"},
    }


def config_file_args(path: str, kinds: Mapping[str, str]) -> list[str]:
    """The command-line words of a YAML config file, as vLLM's and SGLang's `--config` reads one: each key
    a flag (`port`, `tensor-parallel-size` or `max_model_len`), true the switch, false its `--no-` form
    where it has one (else nothing: the switch left out), null or blank nothing (not set, as vLLM reads
    it), a list the flag's words (a flag given once a value, `kinds`' "append", once per item), a mapping
    its JSON, anything else its text. `kinds`: each known flag's "switch", "append" or "value". ValueError
    saying why for a file that cannot be read, is no YAML, holds no mapping (an empty one gives no
    words), or gives false to a flag that takes a value."""
    import yaml  # type: ignore[import-untyped]  # (no stubs installed)

    try:
        with open(path, "rb") as f:
            data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # (libyaml's, if built)
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ValueError(f"not valid YAML: {problem}{where}") from None
    data = {} if data is None else data  # (an empty file: no flags)
    if not isinstance(data, dict):
        raise ValueError(f"not a YAML mapping of flags to values but a {type(data).__name__}")
    words: list[str] = []
    for key, value in data.items():
        flag = str(key) if str(key).startswith("-") else f"--{key}"
        if flag.replace("_", "-") == "--config":
            raise ValueError(f"names another config file ({key}: {value}); one is read")
        words += _config_words(flag, value, kinds)
    return words


def _config_words(flag: str, value: Any, kinds: Mapping[str, str]) -> list[str]:
    """One config file entry's command-line words (`config_file_args`)."""
    kind = kinds.get(flag.replace("_", "-"))  # (None: unknown, refused as typed)
    if value is None:
        return []
    if isinstance(value, bool):
        if kind not in (None, "switch"):
            raise ValueError(f"{flag.lstrip('-')}: {str(value).lower()} given to a flag that takes a value")
        negated = "--no-" + flag.lstrip("-").replace("_", "-")
        if value or kind is None:
            return [flag]
        return [negated] if negated in kinds else []
    if isinstance(value, list) and kind == "append":
        return [word for item in value for word in (flag, _config_word(item))]
    if isinstance(value, list):
        return [flag, *map(_config_word, value)] if value else []
    return [f"{flag}={_config_word(value)}"]


def _config_word(value: Any) -> str:
    """A config file value as the command line writes it: a list or a mapping as JSON."""
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def add_option(group: _ArgumentAdder, option: str, *flags: str, **kwargs: Any) -> None:
    """Add `option`'s flags: its own (`flags`; default `--option-name`), the other servers' names for it
    that take its value, and their switches that set it to a value (`FLAG_ALIASES`)."""
    own = flags or ("--" + option.replace("_", "-"),)
    aliases = [(flag, a) for flag, a in FLAG_ALIASES.items() if a.option == option]
    group.add_argument(*own, *(flag for flag, a in aliases if a.const is None), dest=option, **kwargs)
    for flag, a in aliases:
        if a.const is not None:
            help_text = f"{a.source}'s flag: sets {option} to {a.const}"
            action = _SwitchOn if a.const else _SwitchOff  # (one that turns it off wins: below)
            group.add_argument(flag, dest=option, action=action, const=a.const, default=None, help=help_text)


class _Switch(argparse.Action):
    """A switch of another server's that sets its option to `const` (no value on the command line)."""

    def __init__(self, option_strings: list[str], dest: str, const: Any = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, flag: Any = None) -> None:
        setattr(namespace, self.dest, self.const)
        off = {k: v for k, v in (getattr(namespace, "switched_off", None) or {}).items() if k != self.dest}
        namespace.switched_off = off | self._off()

    def _off(self) -> dict[str, Any]:
        return {}


class _SwitchOn(_Switch):
    """One that sets its option to a value (`--enable-prefix-caching`), as `store_const`, taking back a
    `_SwitchOff` of the same option given before it (`--no-enable-prefix-caching --enable-prefix-caching`:
    on, the last of the pair, as vLLM reads its pairs)."""


class _SwitchOff(_Switch):
    """One that turns its option off (`--disable-cuda-graph`, `--enforce-eager`): it wins over a value
    given for the option anywhere on the command line, as in SGLang and vLLM (`--disable-cuda-graph
    --cuda-graph-max-bs 8`: no graphs). `apply_switches` sets it last."""

    def _off(self) -> dict[str, Any]:
        return {self.dest: self.const}


def apply_switches(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every option a switch turned off (`_SwitchOff`) off, whatever came after it."""
    for option, value in (getattr(args, "switched_off", None) or {}).items():
        setattr(args, option, value)
    return args


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
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        kind = str(f.type).replace(" | None", "")
        text = f.metadata["help"]
        # a default made by a factory (read from the environment) is not shown: building the parser
        # reads no variable, so a bad one is refused when the options are, not by `--help`
        default = None if f.default is MISSING else f.default
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
            type=_VALUE_TYPES.get(f.name, _FLAG_TYPES[kind]),
            default=None,
            choices=choices,
            metavar=None if choices else _METAVARS.get(f.name, _METAVARS[kind]),
            help=_help(text, default),
        )
    add_compat_args(parser)
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
    if getattr(args, "speculative_config", None):  # (vLLM's one flag for them: gapless's own flags win)
        options = {**speculative_options(args.speculative_config), **options}
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
