"""An API server process: uvicorn serving the FastAPI app (`gapless.server.api`) over the worker pipeline,
on the listening socket `gapless serve` bound.

`gapless serve` runs API server 0 in its own process (`gapless.server.launch`). With `--api-server-count
N` it also starts API servers 1 to N-1 as child processes (`api_server_main`), beside the workers, for
when one process's core cannot keep up with the streams. All of them accept connections on the one
listening socket (the kernel gives each new connection to one of them) and submit to the one tokenizer;
each receives on a socket of its own, where the workers send what belongs to the requests it submitted
(`protocol.to_api_servers`). API server 0 alone watches the workers and announces the server; another API
server starts serving when API server 0 tells it to (`Serve`, once every worker is ready), and when it is
terminated it ends its open requests first, as API server 0 does. They keep their metrics in one
directory, so that any of them answers `/metrics` for all (`Metrics(shared_dir=)`).

Importing this module loads neither torch nor the web stack (`launch` imports it; the functions here
import what they run).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.server.health import Health

if TYPE_CHECKING:
    import uvicorn

    from gapless.server import protocol as P
    from gapless.server.engine_client import EngineClient
    from gapless.server.metrics import Metrics
    from gapless.server.workers.sockets import Endpoints

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 2  # open responses get this long to end after they were told the server stops


def event_loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The API server's event loop: uvloop's when it is installed (libuv's loop spends less time per
    socket event than asyncio's, and the API server's loop carries every stream's writes), else asyncio's
    (None: its default). Python 3.10 has no `asyncio.Runner(loop_factory=)`: asyncio's loop there.
    Returns the factory and the loop's name for the start-up line."""
    if sys.version_info >= (3, 11):
        try:
            import uvloop
        except ImportError:
            return None, "asyncio (uvloop not installed)"
        return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"
    return None, "asyncio (uvloop needs Python 3.11 here)"


def run_event_loop(main: Coroutine[object, object, int], announce: bool = True) -> int:
    """Run an API server's `main` to its end on `event_loop_factory()`'s loop, saying which it is
    (`announce`: API server 0 does, for the whole server)."""
    factory, name = event_loop_factory()
    if announce:
        print(f"gapless: event loop {name}", flush=True)
    if factory is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:  # type: ignore[attr-defined]  # 3.11+; mypy checks as 3.10
        return runner.run(main)


def model_names(args: argparse.Namespace, cfg: EngineConfig) -> list[str]:
    """The model's ids in the API (`--served-model-name`'s, else a path's last part): the first is that of a
    request naming none."""
    return list(args.served_model_name or [Path(cfg.model).name])


def pipeline_client(
    args: argparse.Namespace,
    cfg: EngineConfig,
    ends: Endpoints,
    api_server: int = 0,
    metrics_dir: str | None = None,
) -> tuple[Health, Metrics, EngineClient]:
    """API server `api_server`'s health, metrics (kept in `metrics_dir` when the API servers share them)
    and client of the worker pipeline, its receiving socket bound."""
    from gapless.server.engine_client import EngineClient
    from gapless.server.metrics import Metrics

    health, metrics = Health(), Metrics(model_names(args, cfg)[0], api_server, metrics_dir)
    return health, metrics, EngineClient(ends, metrics, health, api_server)


def http_server(
    args: argparse.Namespace,
    cfg: EngineConfig,
    info: P.SchedulerInfo,
    client: EngineClient,
    health: Health,
    metrics: Metrics,
) -> uvicorn.Server:
    """The uvicorn server of one API server process, ready to `serve(sockets=[listener])`. When it begins
    to shut down, before it waits for the open responses, `health.stop` tells them to end (an error event
    for a stream) instead of being cut; when the server stops serving for any reason, it shuts down."""
    import uvicorn

    from gapless.server.api import create_app
    from gapless.server.media import MediaPolicy
    from gapless.server.state import ServerState, Settings

    loras = None
    if cfg.enable_lora:  # (checked at start-up: `launch._check_loras`)
        from gapless.lora.modules import served_adapters
        from gapless.model.config import load_model_config

        # several API servers serve the same adapters, through a file in the directory they share
        shared = os.path.join(metrics.shared_dir, "loras.json") if metrics.shared_dir is not None else None
        mcfg = load_model_config(cfg.model)
        loras = served_adapters(args.lora_modules, mcfg, cfg.max_lora_rank, shared, cfg.lora_experts)
    name, *aliases = model_names(args, cfg)
    settings = Settings(
        name,
        cfg.model,
        info,
        args.api_key,
        args.max_request_bytes,
        args.max_tokens_default,
        args.request_timeout,
        max_logprobs=args.max_logprobs,
        engine_config=cfg,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        loras=loras,
        media=MediaPolicy.of_args(args),
        model_aliases=tuple(aliases),
    )
    metrics.set_weights(info.weight_formats)
    metrics.set_kv_cache(info.kv_cache)
    app = create_app(ServerState(settings, client, health, metrics))
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_requests,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            health.stop()
            await super().shutdown(sockets)

    server = Server(config)
    health.on_fatal(lambda why: setattr(server, "should_exit", True))
    return server


def api_server_name(api_server: int) -> str:
    """API server `api_server`'s name among the workers (logs, errors, `/debug/state`'s `worker_pids`)."""
    return f"api-{api_server}"


def api_server_main(
    args: argparse.Namespace,
    cfg: EngineConfig,
    ends: Endpoints,
    api_server: int,
    listener: socket.socket,
    metrics_dir: str,
    parent_pid: int,
) -> None:
    """API server process `api_server` (> 0) of `--api-server-count`: ready once its socket is bound, it
    serves from API server 0's `Serve` until it is terminated (exit status 0) or fails (status 1; an
    exception is also reported to API server 0 as `Failed`, with its traceback)."""
    from gapless.server.workers.child import setup_child

    setup_child(parent_pid)
    status = run_event_loop(_serve(args, cfg, ends, api_server, listener, metrics_dir), announce=False)
    if status:
        raise SystemExit(status)


async def _serve(
    args: argparse.Namespace,
    cfg: EngineConfig,
    ends: Endpoints,
    api_server: int,
    listener: socket.socket,
    metrics_dir: str,
) -> int:
    import zmq

    from gapless.server import protocol as P

    name = api_server_name(api_server)
    ctx = zmq.Context()
    to_first = ctx.socket(zmq.PUSH)  # API server 0's socket: Ready, Failed
    to_first.connect(ends.apis[0])
    client = None
    try:
        health, metrics, client = pipeline_client(args, cfg, ends, api_server, metrics_dir)
        to_first.send(P.encode(P.Ready(name)))
        while not isinstance(msg := await client.next_message(), P.Serve):
            log.warning("%s: %s before it was told to serve; dropped", name, type(msg).__name__)
        health.worker_pids = msg.worker_pids
        server = http_server(args, cfg, msg.info, client, health, metrics)
        receive = asyncio.create_task(client.receive_loop())
        try:
            with frozen_heap(collect=True):  # what start-up built lives as long as the process
                await server.serve(sockets=[listener])
        finally:
            receive.cancel()
        return 1 if health.failed else 0
    except Exception:
        to_first.send(P.encode(P.Failed(name, traceback.format_exc())))
        raise
    finally:
        if client is not None:
            client.close()
        to_first.close(linger=1000)  # a Failed reaches API server 0
        ctx.term()
