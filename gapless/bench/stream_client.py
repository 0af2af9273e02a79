"""One streamed completion as the serving benchmark sees it: the server-sent events parsed
(`SSEDecoder`, `parse_chunk`), the request sent and timed (`send_request`, into a `RequestRecord`), and
the per-request and summary metrics (`request_metrics`, `summarize`). What counts as a content chunk,
a token and a failure is described in `gapless.bench.serving`'s docstring."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

PERCENTILES = (50, 90, 99)

# ---------------------------------------------------------------------------------------------- SSE


DONE = "[DONE]"


class SSEDecoder:
    """Server-sent events from text lines: `feed` each line, get an event's data when a blank line ends it.

    Follows the SSE format as far as a client of an OpenAI-style stream needs: `data:` lines (one optional
    space after the colon is dropped; several in one event join with newlines), comments (`:`) and other
    fields (`event:`, `id:`, `retry:`) are skipped. `flush` returns an event the stream ended inside.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class StreamError(Exception):
    """The server reported an error inside the stream, or sent something that is not a chunk."""


def parse_chunk(data: str) -> dict[str, Any] | None:
    """One event's data as a chunk dict; None for the final `[DONE]`; StreamError for an error event."""
    if data.strip() == DONE:
        return None
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"bad JSON in stream: {data[:200]!r}") from e
    if not isinstance(chunk, dict):
        raise StreamError(f"stream event is not an object: {data[:200]!r}")
    if "error" in chunk or chunk.get("object") == "error":
        err = chunk.get("error", chunk)
        message = err.get("message", err) if isinstance(err, dict) else err
        raise StreamError(f"error in stream: {message}")
    return chunk


def is_content_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk that carries output: non-empty `choices`, unless it is only an empty-text finish marker."""
    choices = chunk.get("choices")
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def usage_tokens(chunk: dict[str, Any]) -> int | None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"])
    return None


# ---------------------------------------------------------------------------------------------- metrics


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds from the benchmark start; latencies seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float  # Poisson arrival time
    send_s: float | None = None  # when it was sent (later than scheduled_s if it waited for a slot)
    end_s: float | None = None
    success: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


def request_metrics(send: float, chunk_times: list[float], end: float, output_tokens: int) -> dict[str, Any]:
    """TTFT, ITLs, e2e and TPOT of a request from its send time, content-chunk times and end time."""
    if not chunk_times:
        raise ValueError("no content chunks: TTFT is undefined")
    ttft = chunk_times[0] - send
    e2e = end - send
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return dict(ttft_s=ttft, e2e_s=e2e, itl_s=itl, tpot_s=tpot)


def stats(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, std and the PERCENTILES of `values` times `scale`; all None when there are none."""
    keys = ["mean", "std", *(f"p{p}" for p in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=np.float64) * scale
    out = dict(mean=float(a.mean()), std=float(a.std()))
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES))})
    return out


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs over `duration_s` and latency stats (ms) of the successful requests."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return dict(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        requested_output_tokens=sum(r.max_tokens for r in ok),
        wrong_length_requests=sum(r.output_tokens != r.max_tokens for r in ok),
        request_throughput=per_s(len(ok)),
        input_throughput=per_s(input_tokens),
        output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        ttft_ms=stats([r.ttft_s for r in ok], 1e3),
        itl_ms=stats([x for r in ok for x in r.itl_s], 1e3),
        tpot_ms=stats([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        e2e_ms=stats([r.e2e_s for r in ok], 1e3),
        errors=dict(Counter(r.error for r in failed).most_common()),
    )


async def send_request(
    client: httpx.AsyncClient,
    endpoint: str,
    payload: dict[str, Any],
    record: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Stream one completion into `record` (times relative to `t0`); any failure goes into its `error`."""
    chunk_times: list[float] = []
    first_choice: float | None = None  # the first chunk with choices, text or not
    n_tokens: int | None = None
    send = time.perf_counter()
    end: float | None = None
    record.send_s = send - t0
    try:
        async with client.stream("POST", endpoint, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace").strip()
                raise StreamError(f"HTTP {resp.status_code}: {body[:300]}")
            decoder = SSEDecoder()

            def handle(data: str | None) -> bool:
                """Account for one event; True at [DONE]."""
                nonlocal n_tokens, first_choice
                if data is None:
                    return False
                now = time.perf_counter()
                chunk = parse_chunk(data)
                if chunk is None:
                    return True
                if first_choice is None and chunk.get("choices"):
                    first_choice = now
                if is_content_chunk(chunk):
                    chunk_times.append(now)
                usage = usage_tokens(chunk)
                if usage is not None:
                    n_tokens = usage
                return False

            async for line in resp.aiter_lines():
                if handle(decoder.feed(line)):
                    end = time.perf_counter()
                    break
            else:
                if handle(decoder.flush()):
                    end = time.perf_counter()
        if end is None:
            raise StreamError("stream ended without [DONE]")
        if n_tokens is None and not chunk_times:
            raise StreamError("neither usage nor output in stream: its tokens cannot be counted")
        record.output_tokens = n_tokens if n_tokens is not None else len(chunk_times)
        # no text at all: the client's first output was the finish chunk, or [DONE]
        times = chunk_times or [first_choice if first_choice is not None else end]
        for name, value in request_metrics(send, times, end, record.output_tokens).items():
            setattr(record, name, value)
        record.success = True
    except Exception as e:  # every failure is a failed request, never a crashed run
        record.error = str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"
        end = time.perf_counter()
    record.end_s = end - t0
    return record
