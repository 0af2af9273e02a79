"""The API server's end of the worker pipeline: the sockets to the workers and the requests in flight.

Each HTTP request is submitted as a `Group` of engine requests (one per prompt and choice), sent to the
tokenizer in one message. A single task (`receive_loop`) reads every message the workers send back and
puts each delta on its group's queue, which the HTTP handler awaits, until the group's deadline if it has
one. A group released before its requests finish (its client went away, its deadline passed, or its
handler failed) has them aborted at once, so their KV is freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, NoReturn

import zmq
import zmq.asyncio

from gapless.engine.heap import gc_pauses
from gapless.server import protocol as P
from gapless.server.errors import BadRequest
from gapless.server.health import Health
from gapless.server.metrics import Metrics, RequestClock
from gapless.server.openai_protocol import Prompt, Submission
from gapless.server.replicas import combine_stats
from gapless.server.workers.sockets import Endpoints

log = logging.getLogger(__name__)

STATS_WAIT_S = 0.5  # past this, /metrics and /debug/state answer with the scheduler's last counters


class Group:
    """The engine requests of one HTTP request; their deltas arrive on one queue as (index, message)."""

    def __init__(self, rids: list[str], timeout_s: float | None = None) -> None:
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.open = set(rids)
        self.queue: asyncio.Queue[tuple[int, P.ReqDelta | P.ReqError]] = asyncio.Queue()
        self.clock = RequestClock()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.released = False
        self._error: P.ReqError | None = None  # a refusal taken from the queue behind deltas, raised next

    def _raise(self, msg: P.ReqError) -> NoReturn:
        raise BadRequest(msg.message, msg.param, msg.status)

    @property
    def done(self) -> bool:
        """Every request has finished and every delta (and refusal) has been taken."""
        return not self.open and self.queue.empty() and self._error is None

    async def next_delta(self) -> tuple[int, P.ReqDelta]:
        """The next delta, as (request index, delta). A worker's refusal raises BadRequest with its status,
        and so does the deadline passing (504): the caller's release then aborts what still runs."""
        if self._error is not None:
            self._raise(self._error)
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            index, msg = await asyncio.wait_for(self.queue.get(), remaining)
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the request ran past its time limit of {self.timeout_s:g} s (--request-timeout) "
                "and was stopped",
                status=504,
            ) from None
        if isinstance(msg, P.ReqError):
            self._raise(msg)
        return index, msg

    async def next_deltas(self) -> list[tuple[int, P.ReqDelta]]:
        """The next delta and every one already queued behind it, merged per request (`merge_deltas`):
        when the stream's client (or the event loop) is behind, it gets one chunk per choice for all
        that piled up, not one per step. A refusal behind them is raised by the next call."""
        index, delta = await self.next_delta()
        merged = {index: delta}
        while not self.queue.empty():
            index, msg = self.queue.get_nowait()
            if isinstance(msg, P.ReqError):
                self._error = msg
                break
            merged[index] = P.merge_deltas(merged[index], msg) if index in merged else msg
        return list(merged.items())


def _prompt_in(prompt: Prompt) -> P.PromptIn:
    if isinstance(prompt, str):
        return P.PromptIn(text=prompt)
    if isinstance(prompt, P.ImageChat):
        return P.PromptIn(messages=prompt.messages, images=prompt.images)
    if prompt and isinstance(prompt[0], P.ChatMessage):
        return P.PromptIn(messages=prompt)
    return P.PromptIn(token_ids=prompt)  # type: ignore[arg-type]  # list[int]: text and chat returned above


class EngineClient:
    """Submits requests to the tokenizer, routes what comes back to their groups, and asks for stats."""

    def __init__(self, ends: Endpoints, metrics: Metrics, health: Health, api_server: int = 0) -> None:
        """`api_server`: this process's index among the API server processes (`--api-server-count`): its
        requests' ids and stats tickets name it, so that the workers answer here."""
        self.metrics, self.health, self.api_server = metrics, health, api_server
        self.ctx = zmq.asyncio.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ends.apis[api_server])
        self._send_ctx = zmq.Context()
        self.to_tokenizer = self._send_ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(ends.tokenizer)
        self.groups: dict[str, Group] = {}  # engine rid -> its HTTP request's group
        self.replicas = len(ends.schedulers)  # data-parallel replicas: each answers a stats request
        self.stats_waiters: dict[int, _StatsWait] = {}
        # each replica's last answer, and when it came
        self.last_stats: list[P.Stats] = [{} for _ in range(self.replicas)]
        self.last_stats_at: list[float | None] = [None] * self.replicas
        self._tickets = itertools.count()
        self.hops = {"hop_api_deltas_in": 0, "hop_api_delta_records": 0}  # what the detokenizer sent here
        gc_pauses()  # counting from here
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
            self.hops["hop_api_deltas_in"] += 1
            self.hops["hop_api_delta_records"] += len(msg.deltas)
            now = time.perf_counter()
            for d in msg.deltas:
                self._deliver(d.rid, d, now)
        elif isinstance(msg, P.ReqError):
            self._deliver(msg.rid, msg, time.perf_counter())
        elif isinstance(msg, P.Refused):  # the whole request: every one of its groups' rids at once
            now = time.perf_counter()
            for rid in msg.rids:
                self._deliver(rid, P.ReqError(rid, msg.message, msg.status, msg.param), now)
        elif isinstance(msg, P.StatsOut):
            # this process's figures beside the replica's: what the detokenizer sent, what collections cost
            stats = {**msg.stats, **self.hops, **gc_pauses().figures("api_")}
            replica = int(msg.stats.get("replica", 0))
            self.last_stats[replica], self.last_stats_at[replica] = stats, time.monotonic()
            wait = self.stats_waiters.get(msg.ticket)
            if wait is not None:
                wait.answer(replica, stats)
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
    def submit(self, sub: Submission, max_prompt_tokens: int, timeout_s: float | None = None) -> Group:
        """Send one HTTP request's engine requests to the tokenizer in one message; their deltas arrive on
        the group. The message is encoded before anything is registered, so a failure leaves no trace."""
        if self.health.fatal:
            raise BadRequest(f"server is shutting down: {self.health.fatal}", status=503)
        base = P.request_id(self.api_server, uuid.uuid4().hex)
        rids = [f"{base}-{i}" for i in range(len(sub.prompts) * len(sub.choices))]
        prompts = [_prompt_in(p) for p in sub.prompts]
        frame = P.encode(
            P.TokenizeReq(rids, prompts, sub.choices, max_prompt_tokens, sub.chat_template_kwargs, sub.lora)
        )
        group = Group(rids, timeout_s)
        for rid in rids:
            self.groups[rid] = group
        self.to_tokenizer.send(frame)
        self.metrics.started()
        return group

    def release(self, group: Group) -> None:
        """The HTTP request is done (or its client gone): abort whatever of it still runs. Only the first
        call counts."""
        if group.released:
            return
        group.released = True
        for rid in list(group.open):
            self.groups.pop(rid, None)
            self.send(P.Abort(rid))
            self.metrics.aborted()
        group.open.clear()
        self.metrics.ended()

    async def engine_stats(self) -> dict[str, Any]:
        """The scheduler's counters (`replica_stats`); with several data-parallel replicas, their sums and
        each replica's own (`combine_stats`)."""
        return combine_stats(await self.replica_stats())

    async def replica_stats(self) -> list[P.Stats]:
        """Each replica's counters, with its KV integrity check when idle. A scheduler answers between
        steps; one that has not within STATS_WAIT_S (a long prefill step holds it) is shown by the last
        counters it sent, with their age in `stats_age_s` (None before its first answer) and the integrity
        check marked not run, so that /metrics and /debug/state answer at once whatever the schedulers do."""
        ticket = next(self._tickets)
        wait = self.stats_waiters[ticket] = _StatsWait(self.replicas)
        self.send(P.StatsReq(ticket, self.api_server))
        try:
            await asyncio.wait_for(wait.all.wait(), STATS_WAIT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            self.stats_waiters.pop(ticket, None)
        return [wait.answers[r] if r in wait.answers else self._stale_stats(r) for r in range(self.replicas)]

    def close(self) -> None:
        """Close the sockets, dropping what was not sent (the process is ending)."""
        self.recv.close(linger=0)
        self.to_tokenizer.close(linger=0)
        self.ctx.term()
        self._send_ctx.term()

    def _stale_stats(self, replica: int) -> P.Stats:
        stale: dict[str, Any] = dict(self.last_stats[replica])  # (its age None: JSON's null)
        at = self.last_stats_at[replica]
        stale["stats_age_s"] = None if at is None else round(time.monotonic() - at, 3)
        stale["integrity"] = "not checked: the scheduler is busy; its last counters"
        stale["replica"] = replica
        return stale


class _StatsWait:
    """The answers to one stats request, one per replica; `all` is set once every replica answered."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.answers: dict[int, P.Stats] = {}
        self.all = asyncio.Event()

    def answer(self, replica: int, stats: P.Stats) -> None:
        self.answers[replica] = stats
        if len(self.answers) == self.replicas:
            self.all.set()
