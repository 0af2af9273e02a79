"""The detokenizer process's stage: each step's token ids become text, usage and logprobs for the API
servers, every request of the step decoded at once. It runs in the process of
`gapless.server.workers.text_worker`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from gapless.server import protocol as P
from gapless.server.prompt_logprobs import decode_prompt_logprobs
from gapless.server.workers.sockets import Sockets

if TYPE_CHECKING:  # imported where they run, so importing this module loads no transformers
    from transformers import PreTrainedTokenizerBase

    from gapless.engine.detokenize import IncrementalDetokenizer


class DetokenizerStage:
    """The detokenizer's part of a worker: each step's `Updates` (every request's new tokens) become one
    `Deltas` to the API server, the step's text decoded for all its requests at once
    (`gapless.engine.detokenize.update_many`); anything else from the scheduler (`StatsOut`) passes on,
    with this hop's message counts added."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, socks: Sockets) -> None:
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
            text = self.texts[token] = cast(str, self.tokenizer.decode([token]))  # typed str | list[str]
        return text


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
            pooled=u.pooled,
        )
