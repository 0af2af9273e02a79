"""The scheduler process: the engine (and its model runner) in a loop that takes the tokenized requests
and aborts, runs a step while there is work and sends each step's new tokens to the detokenizer. With
data-parallel replicas (`gapless.server.replicas`) there is one per replica."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.engine.image_io import ImageLimits
from gapless.lora.request import LoRARequest
from gapless.server import protocol as P
from gapless.server.images import from_wire
from gapless.server.logs import StatsLog
from gapless.server.prompt_logprobs import prompt_logprob_fields
from gapless.server.replicas import replica_config, scheduler_name, uses_cuda
from gapless.server.workers.child import run_worker
from gapless.server.workers.replica_report import ReplicaReports
from gapless.server.workers.request_log import RequestLog
from gapless.server.workers.sockets import IDLE_POLL_MS, Endpoints, Sockets

if TYPE_CHECKING:  # imported where they run, so importing this module loads no torch
    from gapless.engine.engine import Engine
    from gapless.engine.request import Req

log = logging.getLogger(__name__)


class UpdateReporter:
    """Turns the requests a step updated into `ReqUpdate`s holding only what is new since the last one,
    for each request that is `due` one."""

    def __init__(self, stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval
        self.sent: dict[str, int] = {}  # rid -> output tokens already reported

    def updates(self, reqs: Iterable[Req]) -> list[P.ReqUpdate]:
        """The updates of `reqs` (a step's) that are `due` one. Nearly all of a step's are running
        requests without logprobs that reported before: theirs are their new tokens and counts alone, built
        here inline (0.10 ms a step of the scheduler's at 256 running requests, against 0.27 through
        `update`); the others' first, last and logprob updates are `update`'s."""
        sent, interval, out = self.sent, self.stream_interval, []
        for req in reqs:
            start = sent.get(req.rid)
            if start is None or req.finished or req.params.logprobs is not None:
                if self.due(req):
                    out.append(self.update(req))
                continue
            ids = req.output_ids
            if len(ids) - start >= interval:
                sent[req.rid] = len(ids)
                out.append(P.ReqUpdate(req.rid, ids[start:], len(req.prompt_ids), req.cached_tokens or 0))
        return out

    def due(self, req: Req) -> bool:
        """Report `req` now: its first update (first token, or an end before one), its end, or a running
        request with `stream_interval` new tokens."""
        sent = self.sent.get(req.rid)
        return sent is None or req.finished or len(req.output_ids) - sent >= self.stream_interval

    def update(self, req: Req) -> P.ReqUpdate:
        first = req.rid not in self.sent
        start = self.sent.get(req.rid, 0)
        end = len(req.output_ids)
        with_lp = req.params.logprobs is not None
        if req.finished:
            self.sent.pop(req.rid, None)
        else:
            self.sent[req.rid] = end
        return P.ReqUpdate(
            rid=req.rid,
            token_ids=req.output_ids[start:end],
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens or 0,
            logprobs=req.output_logprobs[start:end] if with_lp else None,
            top_logprobs=req.output_top_logprobs[start:end] if with_lp else None,
            finish_reason=req.finish_reason if req.finished else None,
            stop=list(cast(list[str], req.params.stop)) if first else None,  # a list once checked
            skip_special_tokens=req.params.skip_special_tokens if first else True,
            **(prompt_logprob_fields(req) if first else {}),
            pooled=req.pool.result() if req.pool is not None and req.finished and not req.aborted else None,
        )


def _engine_stats(engine: Engine) -> P.Stats:
    """The engine's counters, with its KV integrity check when nothing runs (it reads every request)."""
    stats: P.Stats = dict(engine.get_stats())
    if engine.has_unfinished():
        stats["integrity"] = "not checked: requests in flight"
    else:
        try:
            engine.check_integrity()
            stats["integrity"] = "ok"
        except AssertionError as e:
            stats["integrity"] = f"failed: {e}"
    return stats


@dataclass(frozen=True)
class SchedulerOptions:
    """The scheduler worker's server options. What it logs as it runs: a stats line every
    `log_stats_interval_s` seconds while it has work (0: never), and with `log_requests` a line per
    finished or refused request. What it streams: a running request's new tokens once it has
    `stream_interval` of them (SGLang's and vLLM's `--stream-interval`), its first token and its end at
    once; fewer, larger updates cost every later hop (detokenizer, API server, client) less per token."""

    log_stats_interval_s: float = 10.0
    log_requests: bool = False
    stream_interval: int = 1


def scheduler_main(
    ends: Endpoints, cfg: EngineConfig, parent_pid: int, opts: SchedulerOptions, replica: int = 0
) -> None:
    """Data-parallel replica `replica` of `cfg.data_parallel_size` (`gapless.server.replicas`): with more
    than one, it tells the router in the tokenizer its KV size and which requests left it."""
    replicas = cfg.data_parallel_size
    name = scheduler_name(replica, replicas)
    push = {"detokenizer": ends.detokenizer}
    if replicas > 1:
        push["tokenizer"] = ends.tokenizer

    def body(socks: Sockets) -> None:
        from gapless.engine.engine import Engine

        engine = Engine(replica_config(cfg, replica, uses_cuda(cfg)))
        try:
            info = engine.info
            pool = engine.pooling
            ready = P.SchedulerInfo(
                info.max_context,
                info.kv_tokens,
                info.device,
                info.vocab_size,
                info.chunked_prefill_size,
                weights=info.weights,
                quantization=info.quantization,
                weight_formats=dict(info.weight_formats),
                task=pool.task if pool is not None else "generate",
                normalize=pool.normalize if pool is not None else False,
                pooling=pool.describe() if pool is not None else "",
                image_limits=ImageLimits.of(engine.cfg) if engine.vision is not None else ImageLimits(0, 0),
                kv_cache=info.kv_cache,
            )
            reports = ReplicaReports(socks, replica) if replicas > 1 else None
            with frozen_heap(collect=True):  # what start-up built lives as long as the process
                socks.send("api", P.Ready(name, ready))
                if reports is not None:
                    reports.ready(info.kv_tokens)
                left = None if reports is None else reports.left
                SchedulerLoop(engine, socks, opts, replica, left).run()
        finally:
            engine.shutdown()

    run_worker(name, parent_pid, lambda: Sockets((ends.schedulers[replica],), push, ends.apis), body)


class SchedulerLoop:
    """The scheduler worker's loop: take every queued message, run a step while there is work, send the
    step's updates on (`SchedulerOptions.stream_interval`), and log what `SchedulerOptions` asks for."""

    def __init__(
        self,
        engine: Engine,
        socks: Sockets,
        opts: SchedulerOptions,
        replica: int = 0,
        report: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.engine, self.socks = engine, socks
        # data parallelism: this replica's index, and where the requests that left it are reported
        self.replica, self.report = replica, report
        self.reporter = UpdateReporter(opts.stream_interval)
        self.stats_log = StatsLog(opts.log_stats_interval_s)
        self.request_log = RequestLog() if opts.log_requests else None
        # what this hop sent: one Updates per step that produced output, whatever the number of requests
        self.hops = dict.fromkeys(
            ("hop_scheduler_steps", "hop_scheduler_updates_out", "hop_scheduler_request_updates"), 0
        )

    def run(self) -> None:
        """Serve until the process ends."""
        while True:
            self.turn()

    def turn(self) -> None:
        """Take every queued message (waiting for one only when there is nothing to run), then run a step
        if there is work. What this does around the engine's step while there is work (taking the messages
        in, sending the updates out) is host time the device may wait on, so it is metered beside the
        step's own spans, as "receive" and "report"."""
        engine = self.engine
        timeout = 0 if engine.has_unfinished() else IDLE_POLL_MS
        t0 = time.perf_counter()
        while (msg := self.socks.poll(timeout)) is not None:
            if timeout:  # waited for it, idle: the work starts now
                t0, timeout = time.perf_counter(), 0
            self.take(msg)
        if engine.has_unfinished():
            engine.meter.host_span("receive", t0, time.perf_counter())
            self.step()
        self.stats_log.tick(engine)

    def take(self, msg: P.Message) -> None:
        if isinstance(msg, P.SchedReq):
            self.add(msg)
        elif isinstance(msg, P.Abort):
            log.debug("request %s: abort", msg.rid)
            self.engine.abort(msg.rid)  # unknown (already finished) ids are ignored
        elif isinstance(msg, P.StatsReq):
            stats = {**_engine_stats(self.engine), **self.hops, "replica": self.replica}
            self.socks.send("detokenizer", P.StatsOut(msg.ticket, stats, msg.api_server))

    def add(self, msg: P.SchedReq) -> None:
        try:
            ids = self.engine.tokenize(msg.prompt_ids)  # validates ids and length
            lora = LoRARequest(msg.lora.name, msg.lora.id, msg.lora.path) if msg.lora is not None else None
            images = from_wire(msg.images) if msg.images else ()
            self.engine.add_request(ids, msg.params, rid=msg.rid, images=images, lora_request=lora)
        except ValueError as e:
            if self.request_log is not None:
                self.request_log.refused(msg.rid, e)
            self.socks.send("api", P.ReqError(msg.rid, str(e), param=getattr(e, "param", "prompt")))
            if self.report is not None:
                self.report([msg.rid])
            return
        log.debug("request %s: queued, %d prompt tokens", msg.rid, len(ids))
        if self.request_log is not None:
            self.request_log.queued(msg.rid)

    def step(self) -> None:
        updated = self.engine.step()
        t0 = time.perf_counter()
        self.hops["hop_scheduler_steps"] += 1
        if updates := self.reporter.updates(updated):
            self.socks.send("detokenizer", P.Updates(updates))
            self.hops["hop_scheduler_updates_out"] += 1
            self.hops["hop_scheduler_request_updates"] += len(updates)
        self.engine.meter.host_span("report", t0, time.perf_counter())
        if self.report is not None and (done := [r.rid for r in updated if r.finished]):
            self.report(done)
        if self.request_log is not None:
            self.request_log.stepped(updated)
