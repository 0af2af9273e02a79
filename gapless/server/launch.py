"""`gapless serve`: start the workers, wait until each is ready, serve HTTP, and take it all down.

The API server runs in this process (uvicorn on an asyncio loop); the tokenizer, scheduler and
detokenizer are child processes forked from a fork server that imported torch and transformers once
(`preload`), or spawned where the platform has no fork server. Shutdown (SIGINT, SIGTERM, or a worker
dying) stops uvicorn, then terminates the workers and waits for them, killing any that hang; the
scheduler's own device process (if any) ends with it. The exit status is non-zero when a worker failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import uvicorn

from gapless.config import EngineConfig, add_engine_args, engine_options
from gapless.server import protocol as P
from gapless.server.api import create_app
from gapless.server.engine_client import EngineClient
from gapless.server.health import Health
from gapless.server.metrics import Metrics
from gapless.server.state import ServerState, Settings
from gapless.server.workers import Endpoints, detokenizer_main, scheduler_main, tokenizer_main

log = logging.getLogger("gapless.server")

STARTUP_TIMEOUT_S = 600.0
WATCHDOG_S = 0.5
TERMINATE_GRACE_S = 5.0
GRACEFUL_SHUTDOWN_S = 2  # open responses (streams) get this long to finish on shutdown, then are cut


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: built-in)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--api-key", default=os.environ.get("GAPLESS_API_KEY"), help="require Bearer auth")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: dir name)")
    parser.add_argument("--max-request-bytes", type=int, default=32 << 20, help="larger bodies get 413")
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        metavar="N",
        help="max_tokens of a request that sets none (default: the rest of the context)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop a request still running after this long and answer 504 (default: no limit)",
    )
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)


def _process_context() -> mp.context.BaseContext:
    """Workers fork from a fork server that imported torch and transformers once (seconds saved per
    worker) and never ran anything: safe to fork, unlike this process. Spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gapless.server.preload"])
    return ctx


class _Workers:
    def __init__(self, ends: Endpoints, cfg: EngineConfig) -> None:
        ctx = _process_context()
        pid = os.getpid()
        self.procs = {
            "scheduler": ctx.Process(target=scheduler_main, args=(ends, cfg, pid), name="gapless-scheduler"),
            "tokenizer": ctx.Process(
                target=tokenizer_main, args=(ends, cfg.model, pid), name="gapless-tokenizer"
            ),
            "detokenizer": ctx.Process(
                target=detokenizer_main, args=(ends, cfg.model, pid), name="gapless-detokenizer"
            ),
        }
        for p in self.procs.values():
            p.start()

    def dead(self) -> str | None:
        for name, p in self.procs.items():
            if not p.is_alive():
                return f"the {name} worker exited with code {p.exitcode}"
        return None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                log.warning("%s did not stop in %.0fs; killing it", p.name, TERMINATE_GRACE_S)
                p.kill()
                p.join(TERMINATE_GRACE_S)


async def _wait_ready(client: EngineClient, workers: _Workers) -> P.SchedulerInfo:
    """What the scheduler reported once every worker said it is ready; RuntimeError if one failed."""
    ready: dict[str, P.SchedulerInfo | None] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(ready) < len(workers.procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {STARTUP_TIMEOUT_S:.0f}s: {sorted(ready)}")
        msg = await client.next_message(timeout_s=WATCHDOG_S)
        if isinstance(msg, P.Ready):
            ready[msg.worker] = msg.info
        elif isinstance(msg, P.Failed):
            raise RuntimeError(f"the {msg.worker} worker failed to start:\n{msg.error}")
        elif (why := workers.dead()) is not None:
            raise RuntimeError(f"{why} during startup")
    info = ready["scheduler"]
    assert info is not None, "the scheduler's Ready carries its info"
    return info


async def _serve(args: argparse.Namespace, cfg: EngineConfig, ends: Endpoints, workers: _Workers) -> int:
    model_name = args.served_model_name or Path(cfg.model).name
    health, metrics = Health(), Metrics(model_name)
    client = EngineClient(ends, metrics, health)
    info = await _wait_ready(client, workers)
    health.worker_pids = {name: p.pid for name, p in workers.procs.items() if p.pid is not None}
    settings = Settings(
        model_name,
        cfg.model,
        info,
        args.api_key,
        args.max_request_bytes,
        args.max_tokens_default,
        args.request_timeout,
    )
    app = create_app(ServerState(settings, client, health, metrics))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    health.on_fatal(lambda why: setattr(server, "should_exit", True))

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            if (why := workers.dead()) is not None:
                health.fail(why)
                return

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(
            f"gapless: serving {model_name} at http://{args.host}:{port} "
            f"(device {info.device}, {info.kv_tokens} KV tokens, context {info.max_context})",
            flush=True,
        )

    tasks = [asyncio.create_task(t) for t in (client.receive_loop(), watchdog(), announce())]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
    if health.fatal:
        print(f"gapless: exiting: {health.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def serve(args: argparse.Namespace) -> int:
    from gapless.default_model import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model = args.model or str(default_model_path())
    if not Path(model, "config.json").is_file():
        print(
            f"gapless: {model!r} is not a Hugging Face checkpoint directory (no config.json)", file=sys.stderr
        )
        return 2
    try:
        cfg = EngineConfig.from_kwargs(model, **engine_options(args))
    except ValueError as e:
        print(f"gapless: {e}", file=sys.stderr)
        return 2
    # uvicorn handles SIGINT/SIGTERM while serving and re-raises them afterwards: this handler turns a
    # re-raised (or early) SIGTERM into an exception, so the workers are always stopped below
    signal.signal(signal.SIGTERM, _on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gapless-") as tmp:
        ends = Endpoints.in_dir(tmp)
        workers = _Workers(ends, cfg)
        try:
            return asyncio.run(_serve(args, cfg, ends, workers))
        except (KeyboardInterrupt, _Terminated):
            return 0
        except RuntimeError as e:
            print(f"gapless: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            workers.stop()
