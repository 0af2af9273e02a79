"""Data-parallel reporting (`--data-parallel-size N`, `gapless.server.replicas`): each scheduler replica
tells the router in the tokenizer (`gapless.server.router`) its KV size once it is ready and which
requests left it, so the router balances on what each replica holds now."""

from __future__ import annotations

from gapless.server import protocol as P
from gapless.server.router import Router
from gapless.server.workers.sockets import Sockets


class ReplicaReports:
    """Replica `replica`'s reports, sent to the tokenizer on `socks`."""

    def __init__(self, socks: Sockets, replica: int) -> None:
        self.socks, self.replica = socks, replica

    def ready(self, kv_tokens: int) -> None:
        """The replica's KV cache holds `kv_tokens`: the router's measure of its capacity."""
        self.socks.send("tokenizer", P.ReplicaReport(self.replica, [], kv_tokens=kv_tokens))

    def left(self, rids: list[str]) -> None:
        """Requests `rids` left the replica (finished or refused)."""
        self.socks.send("tokenizer", P.ReplicaReport(self.replica, rids))


def apply_report(router: Router, msg: P.ReplicaReport) -> None:
    """The tokenizer's end: the router learns a replica's capacity and forgets the requests that left."""
    if msg.kv_tokens is not None:
        router.set_capacity(msg.replica, msg.kv_tokens)
    for rid in msg.done:
        router.done(rid)
