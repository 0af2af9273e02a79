"""Processing a verify batch: each request's accepted run of tokens into its state, one token at a time
through the same stop rules as a decode (EOS, stop tokens and strings, max_tokens, the context), then
its upper bound back to the truth and the slots taken for rejected drafts given back."""

from __future__ import annotations

from gapless.engine.batch import HostSamples
from gapless.engine.request import Req
from gapless.engine.scheduler.build import ScheduledBatch
from gapless.engine.scheduler.results import ResultProcessor


class VerifyResultProcessor(ResultProcessor):
    """`ResultProcessor`, also for verify batches (speculative decoding)."""

    def process(self, batch: ScheduledBatch, samples: HostSamples) -> list[Req]:
        drafts = batch.drafts
        if drafts is None:
            return super().process(batch, samples)
        tokens = samples.tokens
        accepted = tokens[len(tokens) - len(batch.reqs) :]
        stats, touched, start = self.stats, [], 0
        for req, k, a in zip(batch.reqs, drafts.tolist(), accepted, strict=True):
            req.inflight -= 1
            req.unresolved_drafts -= k
            stats.spec_verifies += 1
            stats.spec_drafted_tokens += k
            stats.spec_accepted_tokens += a
            run = range(start, start + a + 1)
            start += k + 1
            if req.finished:
                stats.dropped_tokens += a + 1
                self._maybe_release(req)
                continue
            touched.append(req)
            req.sampled += a - k  # the bound counted all k + 1 tokens
            if not self._append_run(req, tokens, samples, run):
                self.kv.trim(req, len(req.prompt_ids) + req.sampled - 1)
        return touched

    def _append_run(self, req: Req, tokens: list[int], samples: HostSamples, run: range) -> bool:
        """Append the accepted tokens `tokens[run]` until one finishes the request; True if one did."""
        out, p = req.output_ids, req.params
        for j in run:
            tok = tokens[j]
            out.append(tok)
            self.stats.generated_tokens += 1
            if samples.logprobs is not None and p.logprobs is not None:
                req.output_logprobs.append(samples.logprobs[j])
                req.output_top_logprobs.append(samples.top[j][: p.logprobs])  # type: ignore[index]
            n = len(out)
            if (
                p.stop
                or tok in req.stop_ids
                or n >= p.max_tokens
                or n + len(req.prompt_ids) >= self.max_context
            ):
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._finish(req, reason)
                    return True
            if req.grammar is not None and req.grammar.advance(tok):  # complete: the rest is dropped
                self._finish(req, "stop")
                return True
        return False
