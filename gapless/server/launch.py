"""`gapless serve`: check what can be checked, start the workers, wait until each is ready, serve HTTP, and
take it all down.

Before any worker starts or a weight loads, `serve` checks the engine options, the checkpoint (its
architecture, weights and tokenizer), the device, and the port (binding the HTTP socket there and then), so
each of those mistakes is one `gapless: ...` line and exit status 2 within seconds. Only the workers' fork
server starts first, so that its imports overlap this process's; a refused start ends it again.
Importing this module loads neither torch nor the web stack (`serve` does); its command line is
`gapless.server.serve_args`.

The API server runs in this process (uvicorn on an asyncio loop, uvloop's when installed:
`gapless.server.api_process`), and with `--api-server-count N` N-1 more API servers in child processes;
the scheduler (one per data-parallel replica, `gapless.server.replicas`) and the tokenizer and detokenizer
(in a process each, or both in one: `gapless.server.layout`) are child processes forked from a fork
server that imported torch and transformers once (`preload`), or spawned where the platform has no fork
server.

Shutdown (SIGINT, SIGTERM, or a worker dying) first ends every open request: a stream gets an error event
and `data: [DONE]`, a waiting request a 503 (the other API servers do the same when they are terminated).
Then uvicorn stops, the workers are terminated and waited for
(killed if they hang), and so are multiprocessing's fork server (killed: it has nothing left to do) and
resource tracker and any process orphaned below this one (it is their subreaper): when the server's exit
status is seen, none of its processes is left. The exit status is 1 when a worker failed, 2 for a
refused start, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gapless import env
from gapless.cli import chosen_model, config_from_args
from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.server.api_process import api_server_name, http_server, pipeline_client, run_event_loop
from gapless.server.layout import worker_stages
from gapless.server.logs import configure_logging
from gapless.server.replicas import scheduler_name

if TYPE_CHECKING:
    from gapless.model.config import ModelConfig
    from gapless.server import protocol as P
    from gapless.server.engine_client import EngineClient
    from gapless.server.workers.scheduler_loop import SchedulerOptions
    from gapless.server.workers.sockets import Endpoints

log = logging.getLogger("gapless.server")

STARTUP_TIMEOUT_S = 600.0
WATCHDOG_S = 0.5
TERMINATE_GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36


def _start_fork_server() -> list[object]:
    """Start the workers' fork server before this process imports torch and transformers itself: on a
    machine with cores to spare both import at once, which takes seconds off the start-up. Returns the
    helpers this started (the fork server, and multiprocessing's resource tracker unless it ran already),
    for `_stop_helper` to end if the start is refused."""
    if not isinstance(_process_context(), mp.context.ForkServerContext):
        return []
    from multiprocessing import forkserver, resource_tracker

    tracker = resource_tracker._resource_tracker
    tracker_ran = getattr(tracker, "_pid", None) is not None
    forkserver.ensure_running()
    return [forkserver._forkserver] + ([] if tracker_ran else [tracker])


def _process_context() -> mp.context.SpawnContext | mp.context.ForkServerContext:
    """Workers fork from a fork server that imported torch and transformers once (seconds saved per
    worker) and never ran anything: safe to fork, unlike this process. Spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gapless.server.preload"])
    return ctx


class _Workers:
    """The worker processes, by name: the other API servers (`api-1`, ... with `--api-server-count`,
    `gapless.server.api_process`), the scheduler (one per data-parallel replica: `scheduler-0`, ...,
    `gapless.server.replicas`), and the text workers of the process `layout` (`gapless.server.layout`):
    `tokenizer` and `detokenizer`, or one `tokenizer+detokenizer`. The API servers come first, so they
    are the first told to stop: their open streams end while the pipeline still runs."""

    def __init__(
        self,
        ends: Endpoints,
        cfg: EngineConfig,
        opts: SchedulerOptions,
        layout: str,
        args: argparse.Namespace,
        listener: socket.socket,
        metrics_dir: str | None,
    ) -> None:
        from gapless.server.api_process import api_server_main
        from gapless.server.workers.scheduler_loop import scheduler_main
        from gapless.server.workers.text_worker import text_worker_main

        pid = os.getpid()
        targets: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {}
        for k in range(1, len(ends.apis)):
            targets[api_server_name(k)] = (api_server_main, (args, cfg, ends, k, listener, metrics_dir, pid))
        for replica in range(len(ends.schedulers)):
            targets[scheduler_name(replica, len(ends.schedulers))] = (
                scheduler_main,
                (ends, cfg, pid, opts, replica),
            )
        for stages in worker_stages(layout):
            targets["+".join(stages)] = (text_worker_main, (ends, cfg, pid, stages, args.load_balance_method))
        ctx = _process_context()
        self.procs = {
            name: ctx.Process(target=target, args=targs, name=f"gapless-{name}")
            for name, (target, targs) in targets.items()
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
    from gapless.server import protocol as P

    ready: dict[str, P.SchedulerInfo | None] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(ready) < len(workers.procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {STARTUP_TIMEOUT_S:.0f}s: {sorted(ready)}")
        msg = await client.next_message(timeout_s=WATCHDOG_S)
        if isinstance(msg, P.Ready):
            ready[msg.worker] = msg.info
        elif isinstance(msg, P.Failed) and msg.refusal:
            log.debug("the %s worker refused to start:\n%s", msg.worker, msg.error)
            raise _Refused(msg.refusal)
        elif isinstance(msg, P.Failed):
            raise RuntimeError(f"the {msg.worker} worker failed to start:\n{msg.error}")
        elif (why := workers.dead()) is not None:
            raise RuntimeError(f"{why} during startup")
    info = ready[scheduler_name(0, client.replicas)]
    assert info is not None, "the scheduler's Ready carries its info"
    return info


def _tell_api_servers(ends: Endpoints, info: P.SchedulerInfo, worker_pids: dict[str, int]) -> None:
    """Tell the other API servers (each has bound its socket: it said it is ready) to serve."""
    import zmq

    from gapless.server import protocol as P

    frame = P.encode(P.Serve(info, worker_pids))
    ctx = zmq.Context()
    try:
        for addr in ends.apis[1:]:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(addr)
            sock.send(frame)
            # delivered before this returns (at once: it is bound); one that died since it said it was
            # ready holds this up for the grace period, then the watchdog names it
            sock.close(linger=int(TERMINATE_GRACE_S * 1000))
    finally:
        ctx.term()


async def _serve(
    args: argparse.Namespace,
    cfg: EngineConfig,
    ends: Endpoints,
    workers: _Workers,
    listener: socket.socket,
    metrics_dir: str | None,
    started: float,
) -> int:
    health, metrics, client = pipeline_client(args, cfg, ends, 0, metrics_dir)
    info = await _wait_ready(client, workers)
    health.worker_pids = {name: p.pid for name, p in workers.procs.items() if p.pid is not None}
    _tell_api_servers(ends, info, health.worker_pids)
    server = http_server(args, cfg, info, client, health, metrics)

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            if (why := workers.dead()) is not None:
                health.fail(why)
                return

    dp, apis = cfg.data_parallel_size, len(ends.apis)
    more = f"; {dp} data-parallel replicas, {args.load_balance_method} routing" if dp > 1 else ""
    more += f"; {apis} API server processes" if apis > 1 else ""
    each = " each" if dp > 1 else ""

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        host, port = args.host, listener.getsockname()[1]
        print(
            f"gapless: serving {metrics.model} at http://{f'[{host}]' if ':' in host else host}:{port} "
            f"(device {info.device}{more}, {info.kv_tokens} KV tokens{each} ({info.kv_cache}), "
            f"context {info.max_context}, "
            f"chunked_prefill_size {info.chunked_prefill_size}; {info.weights}; "
            f"{info.pooling + '; ' if info.pooling else ''}"
            f"started in {time.monotonic() - started:.1f} s)",
            flush=True,
        )

    tasks = [asyncio.create_task(t) for t in (client.receive_loop(), watchdog(), announce())]
    try:
        with frozen_heap(collect=True):  # what start-up built lives as long as the process
            await server.serve(sockets=[listener])
    finally:
        for t in tasks:
            t.cancel()
    if health.failed:
        print(f"gapless: exiting: {health.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening: taken before anything starts, so a port in use is found at
    once (not after the model loaded) and is ours from then on. ValueError naming the address if not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = "; another server runs there? pick another --port (0: any free one)"
        raise ValueError(
            f"cannot listen on {host}:{port}: {e.strerror}{hint if e.errno == errno.EADDRINUSE else ''}"
        ) from None
    return sock


def _check_replica_devices(cfg: EngineConfig) -> None:
    """ValueError when the data-parallel replicas need more GPUs than this machine has."""
    import torch

    from gapless.server.replicas import check_devices, uses_cuda

    on_cuda = uses_cuda(cfg)
    check_devices(cfg, on_cuda, torch.cuda.device_count() if on_cuda else 0)


class _Terminated(Exception):
    pass


class _Refused(RuntimeError):
    """A worker refused the configuration as it started (a ValueError there: `P.Failed.refusal`)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _check_loras(args: argparse.Namespace, cfg: EngineConfig, mcfg: ModelConfig) -> None:
    """`--lora-modules` and the LoRA options, each adapter checked against the model (ValueError)."""
    from gapless.lora.modules import served_adapters

    if args.lora_modules and not cfg.enable_lora:
        raise ValueError("--lora-modules serves LoRA adapters: add --enable-lora")
    if cfg.enable_lora:
        served_adapters(args.lora_modules, mcfg, cfg.max_lora_rank, experts=cfg.lora_experts)


def serve(args: argparse.Namespace) -> int:
    """Run `gapless serve` for parsed `args` until it is stopped; returns the exit status."""
    started = time.monotonic()
    try:
        args.log_level = args.log_level or env.LOG_LEVEL.get()
    except ValueError as e:  # a bad $GAPLESS_LOG_LEVEL
        print(f"gapless: {e}", file=sys.stderr, flush=True)
        return 2
    # the workers' log level: they inherit the fork server's environment, so it is set before that starts
    os.environ[env.LOG_LEVEL.name] = args.log_level
    # node 0 forks its workers from the fork server: start it now (`_start_fork_server`)
    helpers = _start_fork_server() if not args.node_rank else []
    try:
        return _serve_checked(args, started)
    finally:  # where the configuration was refused; after a run `_reap_children` stopped them already
        for helper in helpers:
            _stop_helper(helper)


def _serve_checked(args: argparse.Namespace, started: float) -> int:
    """`serve` once the fork server is starting: check the configuration (importing torch and
    transformers, which the fork server imports at the same time), then run node 0's server or another
    node's ranks."""
    from gapless.engine.preflight import check_engine_config
    from gapless.model.source import served_name

    try:
        names = args.served_model_name or []
        if len(names) > 1 and chosen_model(args) is None:  # (the model's path taken for a second name?)
            raise ValueError(
                f"--served-model-name {' '.join(names)}: several names and no model named; name it first "
                "(gapless serve MODEL --served-model-name ...) or with --model"
            )
        named = config_from_args(args)
        # the model made local (fetched, downloaded) and checked before any worker starts
        cfg, mcfg = check_engine_config(named)
        _check_replica_devices(cfg)
        _check_loras(args, cfg, mcfg)
        args.served_model_name = args.served_model_name or [served_name(named.model)]
        if cfg.node_rank > 0:  # another node of a tensor-parallel group: its ranks only, no HTTP
            return _run_node(args, cfg)
        listener = listen(args.host, args.port)
    except ValueError as e:
        print(f"gapless: {e}", file=sys.stderr, flush=True)
        return 2
    with listener:
        return _run(args, cfg, mcfg, listener, started)


def _run(
    args: argparse.Namespace, cfg: EngineConfig, mcfg: ModelConfig, listener: socket.socket, started: float
) -> int:
    from gapless.server.layout import choose_layout, describe
    from gapless.server.workers.scheduler_loop import SchedulerOptions
    from gapless.server.workers.sockets import Endpoints

    configure_logging(args.log_level)
    mp.current_process().name = "gapless-api"
    _adopt_orphans()
    layout = choose_layout(args.process_layout)
    print(f"gapless: starting {cfg.model} ({mcfg.architecture}; device {cfg.device})", flush=True)
    print(f"gapless: {describe(args.process_layout, layout)}", flush=True)
    # uvicorn handles SIGINT/SIGTERM while serving and re-raises them afterwards: this handler turns a
    # re-raised (or early) SIGTERM into an exception, so the workers are always stopped below
    signal.signal(signal.SIGTERM, _on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gapless-") as tmp:
        ends = Endpoints.in_dir(tmp, cfg.data_parallel_size, args.api_server_count)
        metrics_dir = None
        if args.api_server_count > 1:  # the API servers' metrics (and LoRA adapters), shared
            metrics_dir = os.path.join(tmp, "metrics")
            os.mkdir(metrics_dir)
        opts = SchedulerOptions(args.log_stats_interval, args.log_requests, args.stream_interval)
        workers = _Workers(ends, cfg, opts, layout, args, listener, metrics_dir)
        try:
            return run_event_loop(_serve(args, cfg, ends, workers, listener, metrics_dir, started))
        except (KeyboardInterrupt, _Terminated):
            return 0
        except _Refused as e:  # as a refusal before the start: one line (its traceback at debug level)
            print(f"gapless: {e}", file=sys.stderr, flush=True)
            return 2
        except RuntimeError as e:
            print(f"gapless: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
                signal.signal(sig, signal.SIG_IGN)
            workers.stop()
            _reap_children()


def _run_node(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """`--node-rank N` (N > 0): run this node's tensor-parallel ranks until node 0 stops them (status 0)
    or one fails (status 1); node 0 serves HTTP and runs the scheduler."""
    from gapless.engine.tp import run_node

    configure_logging(args.log_level)
    _adopt_orphans()
    ranks = f"{cfg.tensor_parallel_size // cfg.nnodes} of {cfg.tensor_parallel_size} ranks"
    where = f"rank 0 at {cfg.dist_init_addr}"
    print(f"gapless: node {cfg.node_rank} of {cfg.nnodes}: {ranks}, {where}", flush=True)
    try:
        return run_node(cfg)
    finally:
        _reap_children()


def _adopt_orphans() -> None:
    """Become the subreaper of every process below this one (Linux): a process whose parent dies (the
    scheduler's device process, say) is then this one's child, and shutdown waits for it too."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _children() -> set[int]:
    """This process's children, zombies included (from /proc; empty where there is none)."""
    me, found = os.getpid(), set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(entry.path, "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(entry.name))
    return found


def _reap_children(timeout_s: float = TERMINATE_GRACE_S) -> None:
    """Stop multiprocessing's fork server (it would outlive this process by a second), wait for every
    child left, terminating and after `timeout_s` killing those that do not end, then stop the resource
    tracker (it ends once every process that used it has)."""
    from multiprocessing import forkserver, resource_tracker

    _stop_helper(forkserver._forkserver)
    tracker = resource_tracker._resource_tracker
    deadline, signalled = time.monotonic() + timeout_s, set()
    while left := _children() - {getattr(tracker, "_pid", None)}:
        late = time.monotonic() > deadline
        for pid in left:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0 and (late or pid not in signalled):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                    signalled.add(pid)
        time.sleep(0.02)
    _stop_helper(tracker)


def _stop_helper(helper: object) -> None:
    """Stop one of multiprocessing's helper processes and wait for it (`_stop`: in CPython since 3.8).
    The fork server is killed first: it only ever forked the workers (ended before this), and letting it
    exit would spend a second in its interpreter's teardown of torch and transformers."""
    from multiprocessing import forkserver

    pid = getattr(helper, "_forkserver_pid", None)  # (private: not in typeshed's ForkServer)
    if isinstance(helper, forkserver.ForkServer) and pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop = getattr(helper, "_stop", None)
    if stop is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            stop()
