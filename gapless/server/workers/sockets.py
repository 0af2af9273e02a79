"""The workers' ZeroMQ plumbing: the address each process binds (`Endpoints`) and a worker's sockets
(`Sockets`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

from gapless.server import protocol as P

IDLE_POLL_MS = 500  # an idle worker wakes this often (to notice its parent is gone)
FAILED_LINGER_MS = 1000  # how long a failing worker's sockets hold its `Failed` for the API server


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


def replica_socket(replica: int) -> str:
    """The name of the tokenizer's PUSH socket to data-parallel replica `replica`'s scheduler."""
    return f"scheduler{replica}"


class Sockets:
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

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket: at once, dropping what is unsent, or after up to `linger_ms` delivering it
        (a failing worker's last message)."""
        for sock in (self.recv, *self.push.values(), *self.apis):
            sock.close(linger=linger_ms)
        self.ctx.term()
