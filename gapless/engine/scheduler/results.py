"""Result processing: a processed batch's sampled tokens into request state, stop checks, and the end of
a request (finished or aborted), whose KV goes back once no launched batch still holds it."""

from __future__ import annotations

from gapless.engine.detokenize import StopStrings, TokenDecoder
from gapless.engine.request import Req, ReqStatus
from gapless.engine.scheduler.build import ScheduledBatch
from gapless.engine.scheduler.kv import KVManager
from gapless.engine.scheduler.queues import Queues
from gapless.engine.stats import EngineStats
from gapless.sampling.sampler import HostSamples


class Results:
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
        touched = []
        i = -1  # index of the request's sample in `samples`
        for req, sampled, kv_after in zip(batch.reqs, batch.samples, batch.kv_after):
            req.inflight -= 1
            i += sampled
            tok = samples.tokens[i] if sampled else None
            if req.finished:
                self.stats.dropped_tokens += tok is not None
                self._maybe_release(req)
                continue
            if tok is None:  # a non-final chunk: its KV enters the cache now that the forward wrote it
                self.kv.cache_chunk(req, kv_after)
                continue
            req.output_ids.append(tok)
            if req.params.logprobs is not None and samples.logprobs is not None:
                req.output_logprobs.append(samples.logprobs[i])
                req.output_top_logprobs.append(samples.top[i][: req.params.logprobs])
            self.stats.generated_tokens += 1
            touched.append(req)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
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
