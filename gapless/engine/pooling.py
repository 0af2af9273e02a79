"""Pooling: a request of an embedding or scoring model returns one vector made of its prompt's final hidden
states (after the final norm) instead of generated text.

Such a request is a prefill-only request through the same scheduler: its prompt is prefilled (chunked
like any other), no chunk samples a token, and it finishes when its last chunk is processed (status
`POOLING` while that chunk is in flight), so it never decodes, never joins the running requests nor
their decode reservation, and its KV goes back (or into the radix cache) at once. Each extend batch carries
a `PoolAsk`: the flat indices of the positions it pools and, per index, which of the batch's pooled
requests it belongs to. On the device `pool_hidden` sums those hidden states per request (float32), or,
for a scoring model, takes the LM head's logits of the score tokens at them; the sums reach the host with
the batch's tokens, through the same deferred copy as prompt logprobs, and `fold_pooled` adds them to each
request's `PoolState`. So a prompt prefilled in chunks pools across its chunks, and its state moves when
a batch is built, as the rest of a request's state does.

Which positions pool: `last` the last prompt token's, `cls` the first's, `mean` every one's (divided by
the prompt's length at the end). The hidden states of a position come from its forward, not from the KV
cache: `reuse_limit` keeps the prefix cache from supplying a position still to be pooled (for `last`
that is no limit beyond the usual one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # (types only: the device side imports this module for `PoolAsk` and `pool_hidden`)
    from transformers import PreTrainedTokenizerBase

    from gapless.config import EngineConfig
    from gapless.engine.request import Extend, Req


TASKS = ("embed", "score")  # what a pooling model answers (`PoolingSpec.task`)


@dataclass(frozen=True)
class PoolingSpec:
    """How a pooling model makes its one vector per prompt (resolved once, by `pooling_spec`)."""

    task: str  # "embed": the pooled hidden state; "score": the score tokens' logits at the last token
    pooling: str  # one of POOLING_TYPES
    normalize: bool  # embed: divide the vector by its L2 norm (sentence-transformers' Normalize)
    score_ids: tuple[int, ...] = ()  # score: the "true" token's id, then the "false" token's if any

    def describe(self) -> str:
        """One phrase for the start-up line."""
        if self.task == "score":
            return f"score task, {len(self.score_ids)} score token(s) at the last token"
        return f"embed task, {self.pooling} pooling{', normalized' if self.normalize else ''}"


@dataclass
class PoolState:
    """A pooling request's vector as its batches are pooled (host side): positions [lo, hi) of the
    prompt pool, in order; `next` is the first no launched batch pools yet."""

    spec: PoolingSpec
    lo: int
    hi: int
    next: int
    total: torch.Tensor | None = None  # float32 sum of what the processed batches pooled

    @classmethod
    def of(cls, spec: PoolingSpec, prompt_len: int) -> PoolState:
        lo, hi = {"last": (prompt_len - 1, prompt_len), "cls": (0, 1), "mean": (0, prompt_len)}[spec.pooling]
        return cls(spec, lo, hi, lo)

    def add(self, values: torch.Tensor) -> None:
        self.total = values if self.total is None else self.total + values

    def result(self) -> list[float]:
        """The finished request's answer: its embedding, or (score task) its one score in [0, 1]: the
        sigmoid of the true token's logit, or with a false token too, softmax([false, true])[true] =
        sigmoid(true - false), Qwen3-Reranker's probability of "yes"."""
        assert self.total is not None and self.next == self.hi, "a pooling request finished unpooled"
        if self.spec.task == "score":
            logits = self.total.tolist()
            margin = logits[0] - (logits[1] if len(logits) > 1 else 0.0)
            return [1.0 / (1.0 + math.exp(-margin)) if margin > -700 else 0.0]
        vec = self.total / (self.hi - self.lo)
        if self.spec.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.tolist()


def new_state(spec: PoolingSpec | None, prompt_len: int) -> PoolState | None:
    return None if spec is None else PoolState.of(spec, prompt_len)


def reuse_limit(req: Req, limit: int) -> int:
    """`limit` (what the prefix cache may otherwise supply of `req`), cut so that no position `req` still
    has to pool comes from the cache: its hidden state is needed."""
    state = req.pool
    if state is not None and state.next < state.hi:
        return min(limit, state.next)
    return limit


@dataclass
class PoolAsk:
    """What an extend batch pools: flat token indices, the pooled request (0..count-1) each belongs to,
    and for a scoring model the score tokens whose logits are taken instead of the hidden state."""

    index: torch.Tensor  # [P] int64
    segment: torch.Tensor  # [P] int64
    count: int
    head_ids: torch.Tensor | None = None  # [K] int64


class PooledReq(NamedTuple):
    """A request that pools positions in an extend batch, and its row in the batch's pooled result."""

    req: Req
    segment: int


class PoolPlan(NamedTuple):
    ask: PoolAsk | None  # None: the batch pools nothing
    pooled: list[PooledReq]


def plan_pool(entries: list[Extend]) -> PoolPlan:
    """What an extend batch of `entries` (request, tokens it computes; `kv_len` already advanced) pools,
    advancing each pooling request's `next` (state moves at schedule time)."""
    index: list[torch.Tensor] = []
    segment: list[torch.Tensor] = []
    pooled: list[PooledReq] = []
    head: tuple[int, ...] = ()
    flat = 0
    for req, n in entries:
        state = req.pool
        if state is not None:
            first = req.kv_len - n  # position of the chunk's first token
            lo, hi = state.next, min(req.kv_len, state.hi)
            if hi > lo:
                assert lo >= first, "a pooled position's hidden state came from the cache"
                index.append(torch.arange(flat + lo - first, flat + hi - first))
                segment.append(torch.full((hi - lo,), len(pooled), dtype=torch.int64))
                pooled.append(PooledReq(req, len(pooled)))
                state.next = hi
                head = state.spec.score_ids if state.spec.task == "score" else ()
        flat += n
    if not pooled:
        return PoolPlan(None, [])
    ids = torch.tensor(head, dtype=torch.int64) if head else None
    return PoolPlan(PoolAsk(torch.cat(index), torch.cat(segment), len(pooled), ids), pooled)


def pool_hidden(
    hidden: torch.Tensor, ask: PoolAsk, logits_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """On the device: per pooled request the float32 sum of `hidden`'s rows it pools ([count, H]), or of
    the score tokens' logits at them ([count, K]; `logits_fn` is the LM head)."""
    rows = hidden[ask.index]
    if ask.head_ids is not None:
        rows = logits_fn(rows)[:, ask.head_ids]
    out = torch.zeros(ask.count, rows.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, ask.segment, rows.float())


def fold_pooled(pooled: list[PooledReq], values: list[list[float]] | None) -> None:
    """Add a processed batch's pooled sums to its requests; a request that finished meanwhile (aborted)
    takes none."""
    if not pooled:
        return
    assert values is not None, "a batch that pools returned nothing pooled"
    for req, seg in pooled:
        if req.pool is not None and not req.finished:
            req.pool.add(torch.tensor(values[seg], dtype=torch.float32))


# ------------------------------------------------------------------------------- the model's pooling
# sentence-transformers' pooling modes gapless runs, by the key of its 1_Pooling/config.json
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_MODULE = "sentence_transformers.models."


class SentenceTransformersConfig(NamedTuple):
    """What a sentence-transformers checkpoint (`modules.json`) says of its embeddings."""

    pooling: str
    normalize: bool


def read_sentence_transformers(path: str | Path) -> SentenceTransformersConfig | None:
    """The pooling of the sentence-transformers checkpoint at `path` (its `modules.json`: a Transformer at
    the root, then Pooling, optionally Normalize), or None when it is not one. ValueError naming what a
    checkpoint has that gapless does not run (a Dense layer, max or weighted-mean pooling, ...)."""
    root = Path(path)
    if not (root / "modules.json").is_file():
        return None
    modules = json.loads((root / "modules.json").read_text())
    kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE).rsplit(".", 1)[-1] for m in modules]
    pooling = next((m for m, k in zip(modules, kinds) if k == "Pooling"), None)
    other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if pooling is None or other:
        raise ValueError(
            f"{root}/modules.json: gapless runs a Transformer, Pooling and Normalize; this one has "
            f"{', '.join(kinds)}"
        )
    conf = json.loads((root / pooling.get("path", "1_Pooling") / "config.json").read_text())
    modes = [mode for key, mode in _ST_MODES.items() if conf.get(key)]
    others = [k for k, v in conf.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if len(modes) != 1 or others:
        raise ValueError(
            f"{root}/{pooling.get('path')}/config.json: gapless pools by one of last token, mean or cls "
            f"(got {', '.join(k for k, v in conf.items() if k.startswith('pooling_mode') and v) or 'none'})"
        )
    return SentenceTransformersConfig(modes[0], "Normalize" in kinds)


def pooling_spec(cfg: EngineConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> PoolingSpec | None:
    """How the model of `cfg` (local) pools, or None when it generates. The options win over the
    checkpoint's sentence-transformers config. With a `tokenizer`, the score tokens' ids (each must be
    one token); without, only what the checkpoint's files say is checked (`gapless.engine.preflight`).
    ValueError naming the option or file that is wrong."""
    st = read_sentence_transformers(cfg.model) if Path(cfg.model).is_dir() else None
    task = cfg.task
    if task == "auto":
        task = "score" if cfg.score_token is not None else "embed" if st is not None else "generate"
    elif task == "pooling":
        task = "score" if cfg.score_token is not None else "embed"
    if task == "generate":
        return None
    pooling = cfg.pooling_type or (st.pooling if st is not None else "last")
    normalize = cfg.normalize if cfg.normalize is not None else (st.normalize if st is not None else True)
    if task == "score":
        pooling = "last"
    ids: tuple[int, ...] = ()
    if task == "score" and tokenizer is not None:
        tokens = [t for t in (cfg.score_token, cfg.score_false_token) if t is not None]
        ids = tuple(_one_token(tokenizer, t, f) for t, f in zip(tokens, ("score_token", "score_false_token")))
    return PoolingSpec(task, pooling, normalize, ids)


def _one_token(tokenizer: PreTrainedTokenizerBase, text: str, option: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{option}={text!r} is {len(ids)} tokens for this tokenizer ({ids}); it must be one")
    return int(ids[0])


def score_template(cfg: EngineConfig) -> str:
    """The template that makes a query and document pair's prompt: the option (a file, or the template
    itself), else the checkpoint's `score_template.txt`, else the query then the document."""
    given = cfg.score_template
    if given is None:
        local = Path(cfg.model) / "score_template.txt"
        return local.read_text() if local.is_file() else "{query}{document}"
    text = Path(given).read_text() if "{" not in given and Path(given).is_file() else given
    if "{query}" not in text or "{document}" not in text:
        raise ValueError(f"score_template={given!r}: must hold {{query}} and {{document}}")
    return text


def format_pair(template: str, query: str, document: str) -> str:
    """The prompt of one (query, document) pair: `template` with both put in (no other brace is read)."""
    return template.replace("{query}", query).replace("{document}", document)


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """The (first, second) texts of each pair to score, as vLLM pairs them: one first text against each
    second, or as many of each, pairwise. ValueError when empty or the counts differ."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one, or as many")
    return firsts, seconds


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (float32, as torch computes it; 0 for a zero vector)."""
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))
