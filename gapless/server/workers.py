"""The server's worker processes: tokenizer, scheduler (engine + model runner), detokenizer.

With `--data-parallel-size N` there are N schedulers, one per replica (`gapless.server.replicas`), and the
tokenizer stage routes each request to one (`gapless.server.router`).

Each is a child process (forked from the server's fork server, see `launch`) with a PULL socket it binds
and PUSH sockets to the next stage (see `protocol`); the tokenizer and detokenizer stages run in a
process each or share one (`text_worker_main`, the process layout of `gapless.server.layout`). A worker
that fails reports `Failed` to the API server; one that dies without a word is noticed by the API
server's watchdog. Workers die with their parent (`PR_SET_PDEATHSIG`), ignore SIGINT (a terminal's
Ctrl-C reaches the whole group; the API server decides) and exit cleanly on SIGTERM, so a shutdown never
leaves a process behind.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.server import protocol as P
from gapless.server.logs import LOG_LEVEL_ENV, StatsLog, configure_logging
from gapless.server.openai_protocol import prompt_too_long
from gapless.server.prompt_logprobs import decode_prompt_logprobs, prompt_logprob_fields
from gapless.server.replicas import replica_config, scheduler_name, uses_cuda
from gapless.server.router import Router
from gapless.server.tools import template_message

if TYPE_CHECKING:  # imported where they run, so importing this module loads neither torch nor transformers
    from transformers import PreTrainedTokenizerBase

    from gapless.engine.detokenize import IncrementalDetokenizer
    from gapless.engine.engine import Engine
    from gapless.engine.request import Req

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
IDLE_POLL_MS = 500  # an idle worker wakes this often (to notice its parent is gone)


@dataclass(frozen=True)
class Endpoints:
    """ZeroMQ addresses of the PULL socket each process binds."""

    apis: tuple[str, ...]  # one per API server process (`--api-server-count`); 0 started the others
    tokenizer: str
    schedulers: tuple[str, ...]  # one per data-parallel replica
    detokenizer: str

    @classmethod
    def in_dir(cls, path: str, replicas: int = 1, api_servers: int = 1) -> Endpoints:
        at = lambda name: f"ipc://{os.path.join(path, name)}"  # noqa: E731
        apis = tuple(at(f"api{k}") for k in range(api_servers))
        return cls(apis, at("tok"), tuple(at(f"sched{i}") for i in range(replicas)), at("detok"))


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def setup_child(parent_pid: int) -> None:
    """Die with the parent, leave Ctrl-C to it, exit cleanly (finally blocks run) on SIGTERM, and log
    at the server's level.

    The parent is the process that forked this one: the server, or its fork server (which exits when
    the server does, so the death signal still arrives)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
    if not _alive(parent_pid):  # the server died before prctl took effect
        raise SystemExit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"))


class _Sockets:
    """A worker's PULL socket and its PUSH sockets to the next stages, by name, and to the API servers.

    The PULL socket binds every address in `binds`: one stage's, or both the tokenizer's and the
    detokenizer's when one process runs the two (the merged layout). ZeroMQ queues each peer's messages
    in order and takes from the peers in turn, so an abort still follows its request. What is sent to
    "api" goes to the API server process it belongs to (`protocol.to_api_servers`)."""

    def __init__(self, binds: tuple[str, ...], push: dict[str, str], apis: tuple[str, ...]) -> None:
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        for addr in binds:
            self.recv.bind(addr)
        self.push: dict[str, zmq.Socket] = {}
        for name, addr in push.items():
            self.push[name] = self._connect(addr)
        self.apis = [self._connect(addr) for addr in apis]

    def _connect(self, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(addr)
        return sock

    def send(self, to: str, msg: P.Message) -> int:
        """Send `msg` on; returns the messages that took (more than one: a step's deltas for several API
        servers)."""
        if to != "api":
            self.push[to].send(P.encode(msg))
            return 1
        parts = P.to_api_servers(msg, len(self.apis))
        for k, part in parts:
            self.apis[k].send(P.encode(part))
        return len(parts)

    def poll(self, timeout_ms: int) -> P.Message | None:
        if self.recv.poll(timeout_ms):
            return P.decode(self.recv.recv())
        return None

    def close(self) -> None:
        for sock in (self.recv, *self.push.values(), *self.apis):
            sock.close(linger=0)
        self.ctx.term()


def _run_worker(
    name: str, parent_pid: int, sockets: Callable[[], _Sockets], body: Callable[[_Sockets], None]
) -> None:
    """Run a worker's `body` on its sockets; report a failure to the API server, then die with it."""
    setup_child(parent_pid)
    socks = sockets()
    try:
        body(socks)
    except SystemExit:
        pass
    except BaseException:  # noqa: BLE001 - report, then die with an error (the API server exits)
        try:
            socks.send("api", P.Failed(name, traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        raise
    finally:
        socks.close()


# ----------------------------------------------------------------------------------------- tokenizer
INLINE_CHARS = 16_384  # a request with more text than this is tokenized on the background thread
NFC_MERGE = 4  # NFC composes at most this many code points into one (the longest canonical decomposition)
BUSY_POLL_MS = 5  # while the background thread works, the loop looks for its results this often


class _Refusal(Exception):
    """A prompt the tokenizer cannot pass on: the whole request is refused with this message (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Tokenizer:
    """Turns one HTTP request's `TokenizeReq` into a `SchedReq` per engine request, or refuses the whole
    request (`Refused`) if any of its prompts cannot be served, so none of it reaches the scheduler.

    Text that cannot fit is refused before it is tokenized (a 10 MB prompt would hold the tokenizer for
    seconds and its memory for good). No token covers more characters than the longest vocabulary entry
    has (`max_token_chars`: special tokens included, and a byte-level entry's length counts its bytes,
    never fewer than the characters it decodes to), and the NFC normalisation some tokenizers apply merges
    at most NFC_MERGE characters into one: so a text longer than max_prompt_tokens * max_token_chars *
    NFC_MERGE characters needs more tokens than the context holds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        # apply_chat_template's own arguments: chat_template_kwargs must not set them (tokenize=True, ...)
        # (but `tools`: the request's tools travel there, gapless.server.tools)
        self.reserved = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"tools"}
        self.reserved |= {"messages"}

    def max_chars(self, max_prompt_tokens: int) -> int:
        return max_prompt_tokens * self.max_token_chars * NFC_MERGE

    def handle(self, req: P.TokenizeReq) -> list[P.Message]:
        """The request's `SchedReq`s (engine request i * n + j: prompt i, choice j), or one `Refused`."""
        try:
            ids = [self.prompt_ids(prompt, req) for prompt in req.prompts]
        except _Refusal as e:
            return [P.Refused(req.rids, str(e), param=e.param)]
        except Exception as e:  # noqa: BLE001 - a template or tokenizer error is the request's
            return [P.Refused(req.rids, f"could not tokenize the prompt: {e}", param="prompt")]
        n = len(req.params)
        return [P.SchedReq(rid, ids[k // n], req.params[k % n]) for k, rid in enumerate(req.rids)]

    def prompt_ids(self, prompt: P.PromptIn, req: P.TokenizeReq) -> list[int]:
        """A prompt's token ids: given (the API server checked them), a chat rendered with the template,
        or text encoded; refused if empty or longer than the scheduler takes."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        if prompt.messages is not None:  # the template places its own special tokens
            text, specials, param = self._render(prompt.messages, req.chat_template_kwargs), False, "messages"
        else:
            text, specials, param = prompt.text or "", True, "prompt"
        limit = self.max_chars(req.max_prompt_tokens)
        if len(text) > limit:
            raise _Refusal(
                f"{param} is {len(text)} characters, more than the {limit} that can fit in "
                f"{req.max_prompt_tokens} tokens with this tokenizer; it was not tokenized",
                param,
            )
        ids = self.tokenizer.encode(text, add_special_tokens=specials) if text else []
        if not ids:
            raise _Refusal(f"{param} is empty", param)
        if len(ids) > req.max_prompt_tokens:
            raise _Refusal(prompt_too_long(len(ids), req.max_prompt_tokens), param)
        return ids

    def _render(self, messages: list[P.ChatMessage], kwargs: dict[str, Any] | None) -> str:
        from gapless.engine.chat_template import NoChatTemplate, chat_text

        clash = sorted(set(kwargs or ()) & self.reserved)
        if clash:
            raise _Refusal(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        chat = [template_message(msgspec.structs.asdict(m)) for m in messages]
        try:
            return chat_text(self.tokenizer, chat, chat_template_kwargs=kwargs)
        except NoChatTemplate:
            raise _Refusal(
                "this model has no chat template, so it cannot take chat requests; "
                "send the prompt as text to /v1/completions instead",
                "messages",
            ) from None


def _text_chars(req: P.TokenizeReq) -> int:
    """How much text a request brings: what decides whether it is tokenized in the background."""
    return sum(len(p.text or "") + sum(len(m.content) for m in p.messages or ()) for p in req.prompts)


class _Background:
    """A thread that tokenizes the requests with much text, so that one long tokenization never holds up
    the others (the Rust tokenizer releases the GIL while it works). A daemon: a SIGTERM never waits for it.
    """

    def __init__(self, work: Callable[[P.TokenizeReq], list[P.Message]]) -> None:
        self.todo: queue.SimpleQueue[P.TokenizeReq] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[tuple[P.TokenizeReq, list[P.Message]]] = queue.SimpleQueue()
        self.rids: set[str] = set()  # of the requests given to it and not yet taken back
        threading.Thread(target=self._run, args=(work,), name="gapless-tokenize", daemon=True).start()

    def _run(self, work: Callable[[P.TokenizeReq], list[P.Message]]) -> None:
        while True:
            req = self.todo.get()
            self.results.put((req, work(req)))

    def give(self, req: P.TokenizeReq) -> None:
        self.rids.update(req.rids)
        self.todo.put(req)

    def take(self) -> Iterator[tuple[P.TokenizeReq, list[P.Message]]]:
        """The requests it has finished, with their messages."""
        while not self.results.empty():
            req, out = self.results.get()
            self.rids.difference_update(req.rids)
            yield req, out


def _replica_socket(replica: int) -> str:
    return f"scheduler{replica}"


class _TokenizerStage:
    """The tokenizer's part of a worker: each `TokenizeReq` becomes its `SchedReq`s (or one `Refused`),
    long ones on the background thread; aborts and stats requests follow the requests to the scheduler.
    With data-parallel replicas, `router` picks each request's replica, an abort follows its request
    there, and a stats request goes to every replica."""

    def __init__(self, tokenizer: _Tokenizer, socks: _Sockets, router: Router) -> None:
        self.tokenizer, self.socks, self.router = tokenizer, socks, router
        self.background = _Background(tokenizer.handle)
        self.aborted: set[str] = set()  # rids aborted while their request was in the background

    def poll_ms(self) -> int:
        """How long the worker may wait for a message: not long while the background thread works."""
        return BUSY_POLL_MS if self.background.rids else IDLE_POLL_MS

    def take(self, msg: P.Message) -> None:
        if isinstance(msg, P.TokenizeReq) and _text_chars(msg) > INLINE_CHARS:
            self.background.give(msg)
        elif isinstance(msg, P.TokenizeReq):
            self._send(self.tokenizer.handle(msg))
        elif isinstance(msg, P.ReplicaReport):
            self._report(msg)
        elif isinstance(msg, P.Abort):  # in order behind its request, to its replica
            if msg.rid in self.background.rids:
                self.aborted.add(msg.rid)
            replica = self.router.replica_of(msg.rid)
            self.router.done(msg.rid)
            if replica is not None:
                self.socks.send(_replica_socket(replica), msg)
        else:  # StatsReq: every replica answers
            for replica in range(self.router.replicas):
                self.socks.send(_replica_socket(replica), msg)

    def _send(self, out: list[P.Message]) -> None:
        for msg in out:
            if isinstance(msg, P.SchedReq):
                self.socks.send(_replica_socket(self.router.route(msg.rid, msg.prompt_ids)), msg)
            else:
                self.socks.send("api", msg)

    def _report(self, msg: P.ReplicaReport) -> None:
        if msg.kv_tokens is not None:
            self.router.set_capacity(msg.replica, msg.kv_tokens)
        for rid in msg.done:
            self.router.done(rid)

    def drain(self) -> None:
        """Send on what the background thread finished (never what was aborted meanwhile)."""
        for req, out in self.background.take():
            if self.aborted.isdisjoint(req.rids):
                self._send(out)
            self.aborted.difference_update(req.rids)


# ----------------------------------------------------------------------------------------- scheduler
class _Reporter:
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
            stop=list(req.params.stop) if first else None,
            skip_special_tokens=req.params.skip_special_tokens if first else True,
            **(prompt_logprob_fields(req) if first else {}),
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

    def body(socks: _Sockets) -> None:
        from gapless.engine.engine import Engine

        engine = Engine(replica_config(cfg, replica, uses_cuda(cfg)))
        try:
            info = engine.info
            ready = P.SchedulerInfo(
                info.max_context, info.kv_tokens, info.device, info.vocab_size, info.chunked_prefill_size
            )
            report = None
            if replicas > 1:
                report = lambda done: socks.send("tokenizer", P.ReplicaReport(replica, done))  # noqa: E731
            with frozen_heap(collect=True):  # what start-up built lives as long as the process
                socks.send("api", P.Ready(name, ready))
                if replicas > 1:
                    socks.send("tokenizer", P.ReplicaReport(replica, [], kv_tokens=info.kv_tokens))
                _SchedulerLoop(engine, socks, opts, replica, report).run()
        finally:
            engine.shutdown()

    _run_worker(name, parent_pid, lambda: _Sockets((ends.schedulers[replica],), push, ends.apis), body)


class _SchedulerLoop:
    """The scheduler worker's loop: take every queued message, run a step while there is work, send the
    step's updates on (`SchedulerOptions.stream_interval`), and log what `SchedulerOptions` asks for."""

    def __init__(
        self,
        engine: Engine,
        socks: _Sockets,
        opts: SchedulerOptions,
        replica: int = 0,
        report: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.engine, self.socks, self.log_requests = engine, socks, opts.log_requests
        # data parallelism: this replica's index, and where the requests that left it are reported
        self.replica, self.report = replica, report
        self.reporter = _Reporter(opts.stream_interval)
        self.stats_log = StatsLog(opts.log_stats_interval_s)
        self.clocks: dict[str, list[float]] = {}  # with log_requests: rid -> [queued at, first token at]
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
            engine.scheduler.meter.host_span("receive", t0, time.perf_counter())
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
            self.engine.add_request(ids, msg.params, rid=msg.rid)
        except ValueError as e:
            if self.log_requests:
                log.info("request %s: refused: %s", msg.rid, e)
            self.socks.send("api", P.ReqError(msg.rid, str(e), param=getattr(e, "param", "prompt")))
            if self.report is not None:
                self.report([msg.rid])
            return
        log.debug("request %s: queued, %d prompt tokens", msg.rid, len(ids))
        if self.log_requests:
            self.clocks[msg.rid] = [time.perf_counter()]

    def step(self) -> None:
        updated = self.engine.step()
        t0 = time.perf_counter()
        self.hops["hop_scheduler_steps"] += 1
        if updates := self.reporter.updates(updated):
            self.socks.send("detokenizer", P.Updates(updates))
            self.hops["hop_scheduler_updates_out"] += 1
            self.hops["hop_scheduler_request_updates"] += len(updates)
        self.engine.scheduler.meter.host_span("report", t0, time.perf_counter())
        if self.report is not None and (done := [r.rid for r in updated if r.finished]):
            self.report(done)
        if self.log_requests:
            now = time.perf_counter()
            for req in updated:
                self._log_request(req, now)

    def _log_request(self, req: Req, now: float) -> None:
        """Note a request's first token; log the request's line when it finished."""
        clock = self.clocks.get(req.rid)
        if clock is None:
            return
        if len(clock) == 1 and req.output_ids:
            clock.append(now)
        if req.finished:
            del self.clocks[req.rid]
            first = f"{clock[1] - clock[0]:.3f} s" if len(clock) > 1 else "-"
            log.info(
                "request %s: %d prompt tokens (%d cached), %d output tokens, finish %s, first token %s, "
                "%.3f s in all",
                req.rid,
                len(req.prompt_ids),
                req.cached_tokens or 0,
                len(req.output_ids),
                req.finish_reason,
                first,
                now - clock[0],
            )


# ----------------------------------------------------------------------------------------- detokenizer
class DetokenizerStage:
    """The detokenizer's part of a worker: each step's `Updates` (every request's new tokens) become one
    `Deltas` to the API server, the step's text decoded for all its requests at once
    (`gapless.engine.detokenize.update_many`); anything else from the scheduler (`StatsOut`) passes on,
    with this hop's message counts added."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, socks: _Sockets) -> None:
        self.tokenizer, self.socks = tokenizer, socks
        self.states: dict[str, _DetokState] = {}
        self.pieces = _TokenPieces(tokenizer)
        self.hops = {"hop_detokenizer_updates_in": 0, "hop_detokenizer_deltas_out": 0}

    def take(self, msg: P.Message) -> None:
        if isinstance(msg, P.StatsOut):
            msg = P.StatsOut(msg.ticket, {**msg.stats, **self.hops}, msg.api_server)
        if not isinstance(msg, P.Updates):
            self.socks.send("api", msg)
            return
        sent = self.socks.send("api", P.Deltas(self.deltas(msg.updates)))
        self.hops["hop_detokenizer_updates_in"] += 1
        self.hops["hop_detokenizer_deltas_out"] += sent  # one per API server with deltas in it

    def deltas(self, updates: list[P.ReqUpdate]) -> list[P.ReqDelta]:
        """One step's deltas: every request's new text (decoded together), usage and logprobs."""
        from gapless.engine.detokenize import IncrementalDetokenizer, update_many

        states = []
        for u in updates:
            state = self.states.get(u.rid)
            if state is None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=u.skip_special_tokens, stop=u.stop or []
                )
                state = self.states[u.rid] = _DetokState(detok)
            states.append(state)
        texts = update_many([s.detok for s in states], [u.token_ids for u in updates])
        deltas = []
        for u, state, text in zip(updates, states, texts, strict=True):
            if u.finish_reason is not None:
                text += state.detok.finish()
                del self.states[u.rid]
            deltas.append(state.delta(self.tokenizer, self.pieces, u, text))
        return deltas


class _TokenPieces:
    """Each token's own text (`tokenizer.decode([id])`), as logprobs show it, decoded once per id: a
    request with top logprobs names 1 + k tokens a step."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}  # at most the vocabulary's size

    def __call__(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token])
        return text


_FROM_SCHEDULER = (P.Updates, P.StatsOut)  # what the scheduler sends on: the detokenizer's messages


def text_worker_main(
    ends: Endpoints,
    cfg: EngineConfig,
    parent_pid: int,
    stages: tuple[str, ...],
    load_balance_method: str = "cache_aware",
) -> None:
    """A worker running the tokenizer stage, the detokenizer stage, or both (`stages`, in that order;
    see `gapless.server.layout`). Each stage binds its own address, so the API server and the scheduler
    send the same messages to the same places whatever the layout, and both stages run the same code
    alone or together; together, a message goes to the stage its type belongs to. The tokenizer stage
    routes each request to a data-parallel replica by `load_balance_method` (`gapless.server.router`)."""
    name = "+".join(stages)
    tokenize, detokenize = "tokenizer" in stages, "detokenizer" in stages
    binds = (ends.tokenizer,) * tokenize + (ends.detokenizer,) * detokenize
    push = {_replica_socket(i): addr for i, addr in enumerate(ends.schedulers)} if tokenize else {}

    def body(socks: _Sockets) -> None:
        from gapless.model.source import load_tokenizer

        hf_tokenizer = load_tokenizer(cfg)
        router = Router(len(ends.schedulers), load_balance_method)
        tok = _TokenizerStage(_Tokenizer(hf_tokenizer), socks, router) if tokenize else None
        detok = DetokenizerStage(hf_tokenizer, socks) if detokenize else None
        with frozen_heap(collect=True):  # what start-up built lives as long as the process
            socks.send("api", P.Ready(name))
            while True:
                msg = socks.poll(tok.poll_ms() if tok is not None else IDLE_POLL_MS)
                if msg is not None:
                    if detok is not None and (tok is None or isinstance(msg, _FROM_SCHEDULER)):
                        detok.take(msg)
                    else:
                        assert tok is not None
                        tok.take(msg)
                if tok is not None:
                    tok.drain()

    _run_worker(name, parent_pid, lambda: _Sockets(binds, push, ends.apis), body)


class _DetokState:
    """One request's incremental detokenizer and its count of completion tokens."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.completion_tokens = 0

    def delta(
        self, tokenizer: PreTrainedTokenizerBase, piece: Callable[[int], str], u: P.ReqUpdate, text: str
    ) -> P.ReqDelta:
        """The delta of update `u`, whose new `text` the detokenizer has made."""
        self.completion_tokens += len(u.token_ids)
        logprobs = None
        if u.logprobs is not None and u.top_logprobs is not None:
            logprobs = [
                P.TokenLogprob(piece(t), lp, [(piece(i), i, v) for i, v in top])
                for t, lp, top in zip(u.token_ids, u.logprobs, u.top_logprobs)
            ]
        return P.ReqDelta(
            rid=u.rid,
            text=text,
            token_ids=u.token_ids,
            prompt_tokens=u.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=u.cached_tokens,
            logprobs=logprobs,
            finish_reason=u.finish_reason,
            prompt=decode_prompt_logprobs(tokenizer, piece, u),
        )
