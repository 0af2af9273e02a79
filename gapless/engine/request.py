"""A request's host-side state: the engine creates it, the scheduler moves it, callers read its outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from gapless.engine.images import PromptImage
from gapless.memory.cache_base import TreeNode
from gapless.model.vision.mrope import PromptRope
from gapless.sampling.logprobs import PromptLogprobState
from gapless.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gapless.engine.grammar import GrammarState
    from gapless.engine.pooling import PoolState
    from gapless.lora.request import LoRARequest


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or retracted)
    PREFILL = "prefill"  # admitted, prompt being prefilled in chunks
    RUNNING = "running"  # decoding
    POOLING = "pooling"  # a pooling request's last prompt chunk is in flight: it ends when that is processed
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # resolved (`Engine.add_request`): no knob is left unset
    seed: int  # effective sampling seed (the user's, or one drawn by the engine)
    arrival: int  # admission order, for fcfs and tie-breaks
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
    output_ids: list[int] = field(default_factory=list)
    # with params.logprobs set: per output token, its logprob and the top (token, logprob) pairs
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with params.prompt_logprobs set: the prompt positions scored so far (gapless.engine.prompt_logprobs)
    prompt_lp: PromptLogprobState | None = None
    # a pooling model's request (embed, score): its pooled vector so far (gapless.engine.pooling)
    pool: PoolState | None = None
    status: ReqStatus = ReqStatus.WAITING
    # KV ownership: positions [0, kv_len) have slots in the request-table row; [0, cached_len) of them
    # belong to the radix tree and are pinned through `last_node`.
    row: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: TreeNode | None = None
    # output tokens sampled, counting those still in flight (host knows len(output_ids)); under speculative
    # decoding an upper bound: every token a launched verify may yield (gapless.engine.scheduler.verify)
    sampled: int = 0
    # drafts of launched, unprocessed verify batches: while any, kv_len is only a bound on the device's
    unresolved_drafts: int = 0
    inflight: int = 0  # launched batches holding this request that are not processed yet
    cached_tokens: int | None = None  # prefix-cache hit at first admission (reported to the user)
    finish_reason: str | None = None
    stop_str_hit: str | None = None  # the stop string that ended it, if any
    aborted: bool = False
    grammar: GrammarState | None = None  # structured output's matcher (gapless.engine.grammar)
    lora: LoRARequest | None = None  # the adapter it runs with (gapless.lora); None: the base model
    # while waiting: (length, key), the tokens the prefix cache may supply, as the cache's key, kept while
    # that length holds, since the waiting queue is ordered by cached prefix every step (`KVManager`)
    match_key: tuple[int, tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (gapless.engine.images)
    rope: PromptRope | None = None  # an M-RoPE model's prompt with images: its positions (Qwen2.5-VL)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        """All tokens whose KV the request needs: the prompt and what it generated so far."""
        return self.prompt_ids + self.output_ids

    def cache_ids(self, n: int) -> list[int]:
        """The first `n` of `fill_ids` as the radix cache keys them: each image's run by its key."""
        ids = self.fill_ids[:n]
        for im in self.images:
            if im.start < n:
                ids[im.start : min(n, im.start + im.length)] = [im.key] * (
                    min(n, im.start + im.length) - im.start
                )
        return ids

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def remaining_tokens(self, max_context: int) -> int:
        return max(0, min(self.params.max_tokens - len(self.output_ids), max_context - self.seq_len))


class Extend(NamedTuple):
    """A request's part of an extend batch: the tokens it computes there (its last `tokens` positions
    once its `kv_len` has advanced past them)."""

    req: Req
    tokens: int
