"""Result processing: a processed batch's sampled tokens into request state, stop checks, and the end of
a request (finished or aborted), whose KV goes back once no launched batch still holds it."""

from __future__ import annotations

from gapless.engine.batch import HostSamples
from gapless.engine.detokenize import StopStrings, TokenDecoder
from gapless.engine.pooling import fold_pooled
from gapless.engine.prompt_logprobs import fold_scores
from gapless.engine.request import Req, ReqStatus
from gapless.engine.scheduler.build import ScheduledBatch
from gapless.engine.scheduler.kv import KVManager
from gapless.engine.scheduler.queues import Queues
from gapless.engine.stats import EngineStats


class ResultProcessor:
    """Folds processed batches into request state and ends requests."""

    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        stats: EngineStats,
        tokenizer: TokenDecoder,
        max_context: int,
    ) -> None:
        self.queues, self.kv, self.stats = queues, kv, stats
        self.stop_strings = StopStrings(tokenizer)
        self.max_context = max_context

    def process(self, batch: ScheduledBatch, samples: HostSamples) -> list[Req]:
        """Fold a processed batch's sampled tokens into request state; returns the requests that got a
        token or finished. A request that finished while the batch was in flight gets no token from it."""
        reqs, chunks = batch.reqs, []
        fold_scores(batch.scored, samples.prompt)  # before a finish below: its scores are all in
        fold_pooled(batch.pooled, samples.pooled)
        if not batch.is_decode:  # a decode's requests all sampled; an extend's non-final chunks did not
            reqs = [r for r, s in zip(batch.reqs, batch.samples_token) if s]
            chunks = [(r, kv) for r, s, kv in zip(batch.reqs, batch.samples_token, batch.kv_after) if not s]
        touched: list[Req] = []
        touch, finished = touched.append, ReqStatus.FINISHED  # (locals: this loop runs per token)
        logprobs, top, max_context = samples.logprobs, samples.top, self.max_context
        for i, (req, tok) in enumerate(zip(reqs, samples.tokens, strict=True)):
            req.inflight -= 1
            if req.status is finished:
                self.stats.dropped_tokens += 1
                self._maybe_release(req)
                continue
            out, p = req.output_ids, req.params
            out.append(tok)
            touch(req)
            if logprobs is not None and top is not None and p.logprobs is not None:
                req.output_logprobs.append(logprobs[i])
                req.output_top_logprobs.append(top[i][: p.logprobs])
            # the common case costs four comparisons: no stop string, no stop token, below both limits
            n = len(out)
            if p.stop or tok in req.stop_ids or n >= p.max_tokens or n + len(req.prompt_ids) >= max_context:
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._finish(req, reason)
            if req.grammar is not None and not req.finished and req.grammar.advance(tok):
                self._finish(req, "stop")  # the grammar is complete (gapless.engine.grammar)
        self.stats.generated_tokens += len(touched)
        for req, kv_after in chunks:
            req.inflight -= 1
            if req.finished:
                self._maybe_release(req)
            elif req.status is ReqStatus.POOLING and kv_after == len(req.prompt_ids):
                # a pooling request's last chunk: its vector is whole; it ends without a token
                self._finish(req, "abort" if req.aborted else "stop")
                touch(req)
            else:  # a non-final chunk: its KV enters the cache now that the forward wrote it
                self.kv.cache_chunk(req, kv_after)
        return touched

    def abort_pending(self) -> list[Req]:
        """Finish every request marked `aborted`, wherever it is; returns them. One still held by an
        in-flight batch gives its KV back when that batch is processed."""
        q = self.queues
        aborted = [r for r in q.waiting + q.running if r.aborted]
        if q.chunked is not None and q.chunked.aborted:
            aborted.append(q.chunked)
        for req in aborted:
            self._finish(req, "abort")
        return aborted

    def _finish(self, req: Req, reason: str) -> None:
        self.queues.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self._maybe_release(req)

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        p = req.params
        at_length = len(req.output_ids) >= p.max_tokens or req.seq_len >= self.max_context
        if p.stop:  # the stop rule (gapless.engine.stop), as the output text and the stream apply it
            req.stop_str_hit = self.stop_strings.check(req, tok, last=tok in req.stop_ids or at_length)
            if req.stop_str_hit is not None:
                return "stop"
        if tok in req.stop_ids:
            return "stop"
        return "length" if at_length else None

    def _maybe_release(self, req: Req) -> None:
        """Release a finished request's KV once no launched batch still uses it (exactly once)."""
        if req.row is not None and req.inflight == 0:
            self.kv.release(req)
