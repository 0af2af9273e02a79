"""Prometheus metrics of the API server: request latencies and token counters it observes itself, and
gauges of the scheduler's state, refreshed from the scheduler on each scrape."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
}


class Metrics:
    def __init__(self, model: str) -> None:
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
        self.in_flight = Gauge("gapless_api_requests_in_flight", "Requests the API server awaits", registry=r)
        hist = lambda name, doc: Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = hist("gapless_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("gapless_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = hist("gapless_e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.engine = {
            name: Gauge(f"gapless_{name}", doc, registry=r) for name, (_, doc) in _ENGINE_GAUGES.items()
        }
        self.integrity = Gauge(
            "gapless_integrity_ok",
            "1 if the KV integrity check passed when last idle, 0 if it failed, -1 if not checked (busy)",
            registry=r,
        )

    def set_engine(self, stats: dict[str, Any]) -> None:
        for name, (key, _) in _ENGINE_GAUGES.items():
            if key in stats:
                self.engine[name].set(stats[key])
        integrity = stats.get("integrity", "")
        self.integrity.set(1 if integrity == "ok" else 0 if integrity.startswith("failed") else -1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
