"""The engine's figures, one name each: what the scheduler counts and what the bubble meter measures.

One live `EngineStats` per engine (`Engine.stats`): the scheduler adds to its counters, the bubble meter
(`gapless.engine.meter`) to its time figures. `Engine.get_stats()` flattens it, beside the queue and KV
gauges of the moment, into the dict that `LLM.get_stats`, the server's /metrics and /debug/state show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started; the meter's (from `steps` on) since its last `reset`."""

    # counted by the scheduler
    prefill_batches: int = 0  # extend batches launched (whole prompts and prefill chunks)
    decode_batches: int = 0  # decode batches launched
    prompt_tokens: int = 0  # tokens computed in extend batches (a retracted request's recomputed ones too)
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at a request's first admission
    generated_tokens: int = 0  # output tokens appended to requests
    retractions: int = 0  # running requests sent back to the waiting queue for want of KV
    dropped_tokens: int = 0  # sampled for a request that had finished while the batch was in flight
    # speculative decoding: request-steps verified, tokens drafted for them, drafts accepted
    spec_verifies: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    # measured by the bubble meter
    steps: int = 0  # scheduler loop iterations (`Scheduler.step` calls)
    device_jobs: int = 0  # batches the device ran and the host processed
    device_busy_s: float = 0.0  # device time in those jobs
    device_idle_s: float = 0.0  # gaps between consecutive jobs while requests were pending
    # host time in the loop's schedule, launch and process spans: device waits excluded, but for the
    # rare drain a retraction needs, which lands in the schedule span. In the server's scheduler worker
    # also its receive and report spans (messages taken in before a step, updates sent after one; the
    # latter counts in the next step)
    host_s: float = 0.0
    # the same host time split by what the step launched: an extend (prefill) batch or a decode batch
    # (a step that launched nothing counts in neither); their costs differ by orders of magnitude on a GPU
    prefill_steps: int = 0
    prefill_host_s: float = 0.0
    decode_steps: int = 0
    decode_host_s: float = 0.0
    # the device time of extend and of decode jobs (`device_busy_s` split the same way)
    prefill_device_s: float = 0.0
    decode_device_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that the prefix cache served."""
        looked_up = self.prompt_tokens + self.cached_prompt_tokens
        return self.cached_prompt_tokens / looked_up if looked_up else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted."""
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step: its accepted drafts plus the one the target adds."""
        steps = self.spec_verifies
        return (self.spec_accepted_tokens + steps) / steps if steps else 0.0

    @property
    def device_idle_fraction(self) -> float:
        total = self.device_busy_s + self.device_idle_s
        return self.device_idle_s / total if total > 0 else 0.0

    # averages in milliseconds (0 when there was nothing to average)
    mean_host_ms_per_step = property(lambda self: _ms_per(self.host_s, self.steps))
    mean_host_ms_per_prefill_step = property(lambda self: _ms_per(self.prefill_host_s, self.prefill_steps))
    mean_host_ms_per_decode_step = property(lambda self: _ms_per(self.decode_host_s, self.decode_steps))
    mean_device_ms_per_job = property(lambda self: _ms_per(self.device_busy_s, self.device_jobs))
    mean_device_ms_per_decode_step = property(lambda self: _ms_per(self.decode_device_s, self.decode_steps))

    def as_dict(self) -> dict[str, float | int]:
        """Every figure, the derived ones included, under its own name."""
        derived = (
            "prefix_hit_rate",
            "device_idle_fraction",
            "spec_acceptance_rate",
            "spec_mean_accepted_length",
            "mean_host_ms_per_step",
            "mean_host_ms_per_prefill_step",
            "mean_host_ms_per_decode_step",
            "mean_device_ms_per_job",
            "mean_device_ms_per_decode_step",
        )
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in derived}}


def _ms_per(seconds: float, count: int) -> float:
    """Milliseconds per item; 0 when there was none."""
    return 1e3 * seconds / count if count else 0.0
