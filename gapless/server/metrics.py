"""Prometheus metrics of the API server: request latencies and token counters it observes itself (from
the deltas it receives), and gauges of the scheduler's state, refreshed from the scheduler on each scrape:
one series per data-parallel replica, labelled `replica="0"`, `replica="1"`, ... (one replica: `"0"`).

With several API server processes (`--api-server-count`), a scrape reaches one of them, so each keeps its
metrics in files of a directory they share (prometheus_client's multiprocess mode: `Metrics(shared_dir=)`),
and every one answers with the sums over all: counters and histograms added up, requests in flight summed over
the live processes, the scheduler's gauges as most recently refreshed by any of them."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from gapless.server.protocol import ReqDelta, Stats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# scheduler stats (Engine.get_stats keys) exported as gauges: metric name -> (stats key, help)
_ENGINE_GAUGES = {
    "num_requests_running": ("running_requests", "Requests admitted and not finished"),
    "num_requests_waiting": ("waiting_requests", "Requests queued for admission"),
    "kv_total_tokens": ("kv_total_tokens", "KV cache capacity in tokens"),
    "kv_used_tokens": ("kv_used_tokens", "KV tokens held by requests"),
    "kv_cached_tokens": ("kv_cached_tokens", "KV tokens kept in the prefix cache, evictable"),
    "kv_free_tokens": ("kv_free_tokens", "KV tokens free"),
    "prefix_cache_hit_rate": ("prefix_hit_rate", "Share of prompt tokens served from the prefix cache"),
    "device_idle_fraction": ("device_idle_fraction", "Share of wall time the device had no work queued"),
    "spec_drafted_tokens": ("spec_drafted_tokens", "Tokens drafted by speculative decoding"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Drafted tokens the target model accepted"),
    "spec_acceptance_rate": ("spec_acceptance_rate", "Share of drafted tokens accepted"),
    "spec_mean_accepted_length": ("spec_mean_accepted_length", "Tokens a request gains per verify step"),
}


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable


class RequestClock:
    """When one HTTP request arrived, and when each of its engine requests last produced tokens."""

    def __init__(self) -> None:
        self.arrival = time.perf_counter()
        self.last_token: dict[str, float] = {}  # engine rid -> when its last tokens arrived


class Metrics:
    """The server's Prometheus registry, and the one place that observes requests into it."""

    def __init__(self, model: str, api_server: int = 0, shared_dir: str | None = None) -> None:
        """`api_server`: this process's index among the API server processes. `shared_dir`: keep the
        values in files there, where every API server process keeps its own, and render the sums over all
        of them; this turns prometheus_client's multiprocess mode on for the whole process, so it is given
        to the process's only `Metrics`, before any other metric is made."""
        if shared_dir is not None:
            os.environ[MULTIPROC_DIR_ENV] = shared_dir
            values.ValueClass = values.get_value_class()  # read when a metric is made
        self.shared_dir = shared_dir
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model"]
        self.model = model
        self.prompt_tokens = Counter(
            "gapless_prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        )
        self.generation_tokens = Counter("gapless_generation_tokens", "Generated tokens", labels, registry=r)
        self.requests = Counter(
            "gapless_requests", "Finished requests by reason", ["model", "finish_reason"], registry=r
        )
        self.in_flight = Gauge(
            "gapless_api_requests_in_flight",
            "Requests the API server awaits",
            registry=r,
            multiprocess_mode="livesum",
        )
        self._submitted = Counter(
            "gapless_api_server_requests",
            "HTTP requests submitted to the engine, by the API server process that took them",
            ["api_server"],
            registry=r,
        ).labels(str(api_server))
        hist = lambda name, doc: Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = hist("gapless_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("gapless_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = hist("gapless_e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.engine = {
            name: Gauge(f"gapless_{name}", doc, ["replica"], registry=r, multiprocess_mode="mostrecent")
            for name, (_, doc) in _ENGINE_GAUGES.items()
        }
        # the one model's series, bound once: `labels()` looks its child up under a lock on every call,
        # and `observe` runs for every delta
        self._ttft, self._itl, self._e2e = (h.labels(model) for h in (self.ttft, self.itl, self.e2e))
        self._generation_tokens = self.generation_tokens.labels(model)
        self._prompt_tokens = self.prompt_tokens.labels(model)
        self.weight_formats = Gauge(
            "gapless_weight_format_layers",
            "Layers whose weights are held in each format (fp8, GGUF types, float dtypes)",
            ["model", "format"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.kv_cache = Gauge(
            "gapless_kv_cache_info",
            "The KV cache's element type and bytes per token, as a label (value 1): bfloat16, fp8_e4m3, "
            "fp8_e5m2, ...",
            ["model", "kv_cache"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.integrity = Gauge(
            "gapless_integrity_ok",
            "1 if the KV integrity check passed when last idle, 0 if it failed, -1 if not checked (busy)",
            ["replica"],
            registry=r,
            multiprocess_mode="mostrecent",
        )

    def set_weights(self, formats: dict[str, int]) -> None:
        """The weights' formats, once at start-up: layers holding each (e.g. "fp8 e4m3 block 128x128")."""
        for label, layers in formats.items():
            self.weight_formats.labels(self.model, label).set(layers)

    def set_kv_cache(self, summary: str) -> None:
        """The KV cache's format, once at start-up (`KVPool.summary`: "fp8_e4m3, 57344 B/token")."""
        if summary:
            self.kv_cache.labels(self.model, summary).set(1)

    def started(self) -> None:
        """An HTTP request was submitted."""
        self.in_flight.inc()
        self._submitted.inc()

    def ended(self) -> None:
        """An HTTP request is done (answered, failed, or its client gone)."""
        self.in_flight.dec()

    def aborted(self) -> None:
        """An engine request was aborted before it finished (its client went away)."""
        self.requests.labels(self.model, "abort").inc()

    def observe(self, clock: RequestClock, d: ReqDelta, now: float) -> None:
        """Token counts and latencies of a delta that arrived at `now`; the request's totals when it ends."""
        n = len(d.token_ids)
        if n:
            last = clock.last_token.get(d.rid)
            if last is None:
                self._ttft.observe(now - clock.arrival)
            else:
                itl = (now - last) / n
                for _ in range(n):
                    self._itl.observe(itl)
            clock.last_token[d.rid] = now
            self._generation_tokens.inc(n)
        if d.finish_reason is not None:
            self._prompt_tokens.inc(d.prompt_tokens)
            self.requests.labels(self.model, d.finish_reason).inc()
            self._e2e.observe(now - clock.arrival)

    def set_engine(self, replicas: list[Stats]) -> None:
        """Refresh the schedulers' gauges from each replica's stats."""
        for replica, stats in enumerate(replicas):
            label = str(replica)
            for name, (key, _) in _ENGINE_GAUGES.items():
                if key in stats:
                    self.engine[name].labels(label).set(float(stats[key]))
            integrity = str(stats.get("integrity", ""))
            ok = 1 if integrity == "ok" else 0 if integrity.startswith("failed") else -1
            self.integrity.labels(label).set(ok)

    def render(self) -> bytes:
        """The exposition: this process's metrics, or with `share_metrics` every API server's, summed."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self.shared_dir)
        return generate_latest(merged)
