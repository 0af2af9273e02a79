"""`gapless serve`'s command line: the server's own flags (address, API key, limits, logging, the process
layout and data parallelism) beside the engine's (`gapless.cli`). Imports nothing heavy, so
`gapless --help` and every argument error answer at once."""

from __future__ import annotations

import argparse

from gapless import env
from gapless.cli import add_engine_args, add_model_args, add_option
from gapless.sampling_params import MAX_LOGPROBS
from gapless.server.layout import LAYOUTS, MIN_CORES_FOR_SPLIT
from gapless.server.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_MEDIA_BYTES, MAX_REDIRECTS
from gapless.server.reasoning import PARSER_ALIASES as REASONING_ALIASES
from gapless.server.reasoning import PARSERS as REASONING_PARSERS
from gapless.server.router import LOAD_BALANCE_METHODS
from gapless.server.tools import PARSER_ALIASES as TOOL_ALIASES
from gapless.server.tools import PARSERS as TOOL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of `gapless serve`: the model, the server's own, then the engine's."""
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0: every interface")
    parser.add_argument("--port", type=_port, default=8000, help="0 picks a free port (default: 8000)")
    parser.add_argument(
        "--api-key",
        default=env.API_KEY.get(),
        help="require `Authorization: Bearer KEY` (all but /health); prefer GAPLESS_API_KEY: ps shows flags",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model id in the API (default: the model as named; a path's last part); several (vLLM's): each "
        "is accepted as a request's model and listed by /v1/models, the first is a request's that names none",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters to serve (with --enable-lora), each name=path or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; a request\'s model names one',
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=32 << 20, help="larger bodies get 413 (default: 32 MiB)"
    )
    parser.add_argument(
        "--max-tokens-default",
        type=_positive_int,
        default=None,
        metavar="N",
        help="max_tokens of a request that sets none (default: the rest of the context)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=_max_logprobs,
        default=MAX_LOGPROBS,
        metavar="K",
        help=f"the most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
        f"at most {MAX_LOGPROBS}, the default)",
    )
    parser.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop a request still running after this long and answer 504 (default: no limit)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        metavar="N",
        help="a running request's new tokens go out (streamed, or collected for a whole answer) once it "
        "has N of them; its first token and its end go out at once. Larger: less work per token in the "
        "detokenizer, the API server and the client, choppier streams (SGLang's and vLLM's flag; default: 1)",
    )
    parser.add_argument(
        "--process-layout",
        choices=LAYOUTS,
        default="auto",
        help="split: tokenizer and detokenizer in a process each; merged: one process for both; auto: "
        f"merged below {MIN_CORES_FOR_SPLIT} usable cores, else split (default: auto)",
    )
    add_option(
        parser,
        "api_server_count",
        type=_positive_int,
        default=1,
        metavar="N",
        help="API server processes, all accepting connections on the port, each streaming the requests it "
        "took: for when one API server's core is the bottleneck (`python -m gapless.bench.served_vs_offline` "
        "shows each process's share of a core). vLLM's flag; default: 1",
    )
    parser.add_argument(
        "--tool-call-parser",
        type=lambda name: TOOL_ALIASES.get(name, name),
        choices=TOOL_PARSERS,
        default=None,
        help="how the model writes tool calls, for tool_choice auto: hermes, llama3 (vLLM's llama3_json), "
        "mistral, qwen (SGLang's qwen25) (default: none)",
    )
    parser.add_argument(
        "--reasoning-parser",
        type=lambda name: REASONING_ALIASES.get(name, name),
        choices=REASONING_PARSERS,
        default=None,
        help="split <think>...</think> into reasoning_content (default: none, all is content)",
    )
    _add_media_args(parser.add_argument_group("remote images (http(s) image_url parts; off by default)"))
    logs = parser.add_argument_group("logging")
    logs.add_argument(
        "--log-level",
        default=None,
        choices=env.LOG_LEVELS,
        help=f"in every process; debug shows each scheduler step (default: ${env.LOG_LEVEL.name} or info)",
    )
    add_option(
        logs,
        "log_requests",
        action="store_true",
        help="a line per request: HTTP access, and the scheduler's tokens, finish reason and latency",
    )
    add_option(
        logs,
        "log_stats_interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between stats lines (throughput, queues, KV, prefix hits) while busy; 0: none "
        "(default: 10)",
    )
    add_engine_args(parser)
    parser.add_argument(
        "--load-balance-method",
        choices=LOAD_BALANCE_METHODS,
        default="cache_aware",
        help="which data-parallel replica serves a request (--data-parallel-size > 1): cache_aware (the "
        "longest cached prompt prefix, unless the loads drift apart), round_robin, shortest_queue "
        "(default: cache_aware)",
    )


def _add_media_args(media: argparse._ArgumentGroup) -> None:
    """The flags of `gapless.server.media`: which remote image URLs the server fetches, and its limits."""
    media.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) image URLs from any public host (never a private, loopback or link-local "
        "address, redirects included)",
    )
    media.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) image URLs from these hosts only (exact names; vLLM's flag)",
    )
    media.add_argument(
        "--max-media-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_MEDIA_BYTES,
        metavar="N",
        help=f"the largest image a fetch reads (default: {DEFAULT_MAX_MEDIA_BYTES >> 20} MiB)",
    )
    media.add_argument(
        "--media-fetch-timeout",
        type=_positive_float,
        default=DEFAULT_FETCH_TIMEOUT_S,
        metavar="SECONDS",
        help=f"one image's fetch in all, up to {MAX_REDIRECTS} redirects included "
        f"(default: {DEFAULT_FETCH_TIMEOUT_S:g})",
    )


def _port(text: str) -> int:
    """A TCP port number (the socket layer would silently take 70000 as 4464)."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _max_logprobs(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in [0, {MAX_LOGPROBS}]")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value
