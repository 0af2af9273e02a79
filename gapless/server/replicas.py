"""Data-parallel replicas (`--data-parallel-size N`): N scheduler + model processes behind one API server,
one tokenizer (which routes: `gapless.server.router`) and one detokenizer.

Each replica is an engine of its own: its device (CUDA: `cuda:0`, `cuda:1`, ... from the device named;
CPU: its own share of this machine's cores, pinned, with as many torch threads), its KV cache and prefix
cache, and its seed (`seed + replica`, so unseeded sampling differs between replicas). One replica keeps
every name and message of the single-engine server (the worker is `scheduler`, no reports, no labels
but `replica="0"`). This module imports nothing heavy."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gapless.config import EngineConfig


def uses_cuda(cfg: EngineConfig) -> bool:
    """Whether the engines run on CUDA (`auto`: when there is a GPU); imports torch."""
    import torch

    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def scheduler_name(replica: int, replicas: int) -> str:
    """The worker's name in logs, errors and `/debug/state`'s `worker_pids`."""
    return "scheduler" if replicas == 1 else f"scheduler-{replica}"


def replica_cores(replica: int, replicas: int, cores: list[int]) -> list[int]:
    """The cores replica `replica` of `replicas` runs on: an equal share of `cores`, the last taking what
    does not divide; all of them when there are fewer cores than replicas."""
    if len(cores) < replicas:
        return cores
    share = len(cores) // replicas
    end = len(cores) if replica == replicas - 1 else (replica + 1) * share
    return cores[replica * share : end]


def replica_config(cfg: EngineConfig, replica: int, on_cuda: bool) -> EngineConfig:
    """The engine config of replica `replica`: one replica's, on its own device or cores. On a CPU this
    process is pinned to the replica's cores (its engine's device process, if any, pins within them)."""
    replicas = cfg.data_parallel_size
    changes: dict[str, Any] = {"data_parallel_size": 1, "seed": cfg.seed + replica}
    if replicas == 1:
        return dataclasses.replace(cfg, **changes)
    if on_cuda:
        first = int(cfg.device.partition(":")[2] or 0)
        changes["device"] = f"cuda:{first + replica}"
    elif hasattr(os, "sched_setaffinity"):
        cores = replica_cores(replica, replicas, sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, cores)
        changes["device_threads"] = cfg.device_threads or len(cores)
    return dataclasses.replace(cfg, **changes)


def check_devices(cfg: EngineConfig, on_cuda: bool, device_count: int) -> None:
    """ValueError when the replicas need more GPUs than there are."""
    if not on_cuda or cfg.data_parallel_size == 1:
        return
    first = int(cfg.device.partition(":")[2] or 0)
    last = first + cfg.data_parallel_size - 1
    if last >= device_count:
        raise ValueError(
            f"data_parallel_size={cfg.data_parallel_size} from cuda:{first} needs GPUs up to cuda:{last}; "
            f"this machine has {device_count}"
        )


# the figures of a replica's stats that add up over the replicas (the rest are rates and times per replica)
_SUMMED = (
    "running_requests",
    "waiting_requests",
    "kv_total_tokens",
    "kv_free_tokens",
    "kv_cached_tokens",
    "kv_used_tokens",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
    "retractions",
)


def combine_stats(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """What `/debug/state` shows for several replicas: the counts summed over them, the prefix hit rate
    of the sums, the integrity check passed only when every replica's did (else the first failing one's
    words, named), and each replica's own stats under `replicas`."""
    if len(replicas) == 1:
        return replicas[0]
    out: dict[str, Any] = {key: sum(s.get(key, 0) for s in replicas) for key in _SUMMED}
    looked_up = out["prompt_tokens"] + out["cached_prompt_tokens"]
    out["prefix_hit_rate"] = out["cached_prompt_tokens"] / looked_up if looked_up else 0.0
    out["integrity"] = "ok"
    for i, s in enumerate(replicas):
        if s.get("integrity") != "ok":
            out["integrity"] = f"replica {i}: {s.get('integrity', 'no answer')}"
            break
    out["data_parallel_size"] = len(replicas)
    out["replicas"] = replicas
    return out
