"""Tensor parallelism's process group and collectives, as the model's layers see them.

One process per rank (`gapless.engine.tp` starts them); each calls `connect` once, then `use` with the
group, before it builds its model, so the parallel layers (`gapless.model.layers`) take their rank and
world size as they are made. A process that never calls `use` holds the whole model (`SINGLE`), and every
collective below is then a no-op.

The group is built from a `TCPStore` and a process group object directly, not through
`torch.distributed.init_process_group`: no process-wide default group, so an offline `LLM` in a process
that uses torch.distributed for something else is left alone. Collectives run on gloo on the CPU and on
NCCL on CUDA; the batch broadcast (bytes) always runs on gloo, on the host. A collective waits at most
the group's timeout, then raises: a rank that hung or died ends the others with an error.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gapless.model.config import ModelConfig


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died, hung, or failed first (the engine looks for
    that rank before it reports this)."""


def _wait(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(str(e)) from e


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group and the collectives the layers need."""

    rank: int = 0
    size: int = 1
    pg: Any = None  # the device collectives' process group (gloo or NCCL); None for one rank
    host_pg: Any = None  # gloo, for the per-step batch broadcast (bytes on the host)
    store: Any = None  # the store the groups were made over (`connect`'s), kept alive as long as the group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            _wait(self.pg.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (all of one shape), in rank order."""
        if self.size == 1:
            return [t]
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        _wait(self.pg.allgather([out], [t]))
        return out

    def part_index(self, parts: int) -> int:
        """Which of `parts` equal pieces of a tensor this rank holds (ranks share a piece when there are
        fewer pieces than ranks: the KV heads of a model with fewer of them than ranks)."""
        return self.rank * parts // self.size

    def part(self, t: torch.Tensor, parts: int, dim: int = 0) -> torch.Tensor:
        """This rank's piece of `t` split into `parts` along `dim`."""
        n = t.shape[dim] // parts
        return t.narrow(dim, self.part_index(parts) * n, n)

    def gather_parts(self, t: torch.Tensor, parts: int) -> torch.Tensor:
        """The whole tensor whose pieces (`parts` of them, along the last dimension) the ranks hold."""
        if self.size == 1:
            return t
        pieces = self.all_gather(t)
        return torch.cat(pieces[:: self.size // parts], dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of any rank (every rank must size its KV pool alike)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # torch's stub: MIN is a RedOpType
        _wait(self.host_pg.allreduce([t], opts))
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): a length, then the bytes. The others
        wait for the length as long as it takes (an idle engine sends no job for hours); rank 0's send,
        and the bytes, wait at most the group's timeout."""
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        if data is None:
            _wait(self.host_pg.broadcast(n, 0, IDLE_WAIT))
        else:
            _wait(self.host_pg.broadcast(n, 0))
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(n), dtype=torch.uint8)
        _wait(self.host_pg.broadcast(buf, 0))
        return data if data is not None else buf.numpy().tobytes()


IDLE_WAIT = datetime.timedelta(days=365)  # how long a rank other than 0 waits for the next job
SINGLE = TPGroup()
_current = SINGLE


def current() -> TPGroup:
    """The group this process's layers are made for (`SINGLE` unless `use` set another)."""
    return _current


def use(group: TPGroup) -> None:
    """Make `group` the one layers made from now on in this process belong to (one group a process)."""
    global _current
    _current = group


def local_address(host: str, port: int) -> str:
    """The address of this machine that reaches `host:port` (what gloo must listen on for the other
    node to reach it): the source address of a UDP socket pointed there (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def serve_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """The group's meeting point at `addr` (host:port; port 0: a free one, then `.port`), served by the
    process that starts rank 0 and outlives every rank: it can still be read when a rank has died."""
    host, port = addr.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, int(port), None, True, timeout=timeout, wait_for_workers=False)


def connect(addr: str, rank: int, size: int, timeout_s: float, device: torch.device) -> TPGroup:
    """Join the group whose store (`serve_store`) listens at `addr`: a gloo group for the host and, on
    CUDA, an NCCL group for the device collectives. Waits at most `timeout_s` for the others, and each
    later collective as long."""
    host, port = addr.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, int(port)))]
    host_pg = dist.ProcessGroupGloo(dist.PrefixStore("host", store), rank, size, opts)
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = host_pg
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, nccl_opts)
    return TPGroup(rank, size, pg, host_pg, store)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming what of the model does not split evenly over `size` ranks: attention heads,
    KV heads (a count that divides the ranks is replicated instead), MLP and expert widths."""
    if size == 1:
        return
    widths = {
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size if cfg.moe else 0,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size or 0,
    }
    for name, n in widths.items():
        if n % size:
            raise ValueError(f"tensor_parallel_size={size}: the model's {name} ({n}) is not divisible by it")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's {kv} KV heads neither divide by it nor divide it"
        )


def kv_parts(cfg: ModelConfig, size: int) -> int:
    """Into how many pieces the KV heads split: one per rank, or one per head where there are fewer
    heads than ranks (each then held by `size // heads` ranks)."""
    return min(cfg.num_kv_heads, size)


def rank_view(cfg: ModelConfig, group: TPGroup) -> ModelConfig:
    """`cfg` as one rank sees it: its own attention and KV heads (what its KV pool and attention
    backend are sized by)."""
    if group.size == 1:
        return cfg
    heads = cfg.num_heads // group.size
    kv = cfg.num_kv_heads // kv_parts(cfg, group.size)
    return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv)
