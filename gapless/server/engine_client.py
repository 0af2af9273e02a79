"""The API server's end of the worker pipeline: the sockets to the workers and the requests in flight.

Each HTTP request is submitted as a `Group` of engine requests (one per prompt and choice) and sent to
the tokenizer. A single task (`receive_loop`) reads every message the workers send back and puts each
delta on its group's queue, which the HTTP handler awaits. A group released before its requests finish
(its client went away) has them aborted at once, so their KV is freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import zmq
import zmq.asyncio

from gapless.server import protocol as P
from gapless.server.health import Health
from gapless.server.metrics import Metrics, RequestClock
from gapless.server.openai_protocol import BadRequest, EngineRequest
from gapless.server.workers import Endpoints

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0


class Group:
    """The engine requests of one HTTP request; their deltas arrive on one queue as (index, message)."""

    def __init__(self, rids: list[str]) -> None:
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.open = set(rids)
        self.queue: asyncio.Queue[tuple[int, P.ReqDelta | P.ReqError]] = asyncio.Queue()
        self.clock = RequestClock()


class EngineClient:
    """Submits requests to the tokenizer, routes what comes back to their groups, and asks for stats."""

    def __init__(self, ends: Endpoints, metrics: Metrics, health: Health) -> None:
        self.metrics, self.health = metrics, health
        self.ctx = zmq.asyncio.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ends.api)
        self._send_ctx = zmq.Context()
        self.to_tokenizer = self._send_ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(ends.tokenizer)
        self.groups: dict[str, Group] = {}  # engine rid -> its HTTP request's group
        self.stats_waiters: dict[int, asyncio.Future[P.Stats]] = {}
        self._tickets = itertools.count()
        health.on_fatal(self._fail_open_requests)

    def send(self, msg: P.Message) -> None:
        """Queue a message to the tokenizer without awaiting (safe inside a cancelled task's cleanup)."""
        self.to_tokenizer.send(P.encode(msg))

    async def next_message(self, timeout_s: float | None = None) -> P.Message | None:
        """The next message from the workers; None if none came within `timeout_s`."""
        if timeout_s is not None and not await self.recv.poll(int(timeout_s * 1000)):
            return None
        return P.decode(await self.recv.recv())

    # ------------------------------------------------------------------ the receive loop
    async def receive_loop(self) -> None:
        try:
            while True:
                self._dispatch(await self.next_message())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - without this loop no request can finish: stop serving
            log.exception("the API server's receive loop failed")
            self.health.fail(f"the API server's receive loop failed: {e!r}")

    def _dispatch(self, msg: P.Message | None) -> None:
        if isinstance(msg, P.Deltas):
            now = time.perf_counter()
            for d in msg.deltas:
                self._deliver(d.rid, d, now)
        elif isinstance(msg, P.ReqError):
            self._deliver(msg.rid, msg, time.perf_counter())
        elif isinstance(msg, P.StatsOut):
            fut = self.stats_waiters.pop(msg.ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, P.Failed):
            self.health.fail(f"the {msg.worker} worker failed:\n{msg.error}")

    def _deliver(self, rid: str, msg: P.ReqDelta | P.ReqError, now: float) -> None:
        group = self.groups.get(rid)
        if group is None:  # its client is gone (already aborted)
            return
        if isinstance(msg, P.ReqDelta):
            self.metrics.observe(group.clock, msg, now)
        if isinstance(msg, P.ReqError) or msg.finish_reason is not None:
            group.open.discard(rid)
            del self.groups[rid]
        group.queue.put_nowait((group.index[rid], msg))

    def _fail_open_requests(self, why: str) -> None:
        for rid, group in list(self.groups.items()):
            group.queue.put_nowait((group.index[rid], P.ReqError(rid, why, status=503)))
        self.groups.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, requests: list[EngineRequest]) -> Group:
        """Send one HTTP request's engine requests to the tokenizer; their deltas arrive on the group."""
        if self.health.fatal:
            raise BadRequest(f"server is shutting down: {self.health.fatal}", status=503)
        base = uuid.uuid4().hex
        group = Group([f"{base}-{i}" for i in range(len(requests))])
        for rid, (prompt, params) in zip(group.rids, requests):
            self.groups[rid] = group
            if isinstance(prompt, str):
                req = P.TokenizeReq(rid, params, text=prompt)
            elif prompt and isinstance(prompt[0], P.ChatMessage):
                req = P.TokenizeReq(rid, params, messages=prompt)  # type: ignore[arg-type]
            else:
                req = P.TokenizeReq(rid, params, token_ids=prompt)  # type: ignore[arg-type]
            self.send(req)
        self.metrics.started()
        return group

    def release(self, group: Group) -> None:
        """The HTTP request is done (or its client gone): abort whatever of it still runs."""
        for rid in list(group.open):
            self.groups.pop(rid, None)
            self.send(P.Abort(rid))
            self.metrics.aborted()
        group.open.clear()
        self.metrics.ended()

    async def engine_stats(self) -> P.Stats:
        """The scheduler's counters (with its KV integrity check when idle); TimeoutError after 5 s."""
        ticket = next(self._tickets)
        fut: asyncio.Future[P.Stats] = asyncio.get_running_loop().create_future()
        self.stats_waiters[ticket] = fut
        self.send(P.StatsReq(ticket))
        try:
            return await asyncio.wait_for(fut, STATS_TIMEOUT_S)
        finally:
            self.stats_waiters.pop(ticket, None)
