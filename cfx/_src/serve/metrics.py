"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Read live from the engine at each scrape: ``cfx_requests_running``, ``cfx_requests_waiting``,
``cfx_kv_blocks_free`` (blocks no running request holds: cached unreferenced blocks count as free),
``cfx_kv_blocks_total``, ``cfx_prefix_cache_hits_total``; observed as requests run:
``cfx_time_to_first_token_seconds`` and ``cfx_inter_token_latency_seconds`` (histograms),
``cfx_requests_total`` by how they ended, ``cfx_generation_tokens_total`` and ``cfx_engine_steps_total``.
"""
from __future__ import annotations

from typing import Any

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Live:
    """A collector reading the engine's state when scraped."""

    def __init__(self, runner: Any):
        self.runner = runner

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        e = self.runner.engine
        yield GaugeMetricFamily("cfx_requests_running", "Sequences holding KV blocks (prefilling or decoding).",
                                value=len(e.scheduler.running))
        yield GaugeMetricFamily("cfx_requests_waiting", "Sequences waiting to start or to resume.",
                                value=len(e.scheduler.waiting))
        yield GaugeMetricFamily("cfx_kv_blocks_free", "KV blocks no running sequence holds (cached ones included).",
                                value=e.blocks.available)
        yield GaugeMetricFamily("cfx_kv_blocks_total", "KV blocks in the pool.", value=e.blocks.num_blocks)
        yield CounterMetricFamily("cfx_prefix_cache_hits", "Prompt blocks found in the prefix cache.",
                                  value=e.blocks.hits)


class Metrics:
    def __init__(self, runner: Any):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_Live(runner))
        self.ttft = Histogram("cfx_time_to_first_token_seconds", "From a request's arrival to its first token.",
                              buckets=BUCKETS, registry=self.registry)
        self.itl = Histogram("cfx_inter_token_latency_seconds", "Between a sample's consecutive tokens.",
                             buckets=BUCKETS, registry=self.registry)
        self.requests = Counter("cfx_requests", "Requests answered, by how they ended.", ["status"],
                                registry=self.registry)
        self.tokens = Counter("cfx_generation_tokens", "Tokens generated.", registry=self.registry)
        self.steps = Counter("cfx_engine_steps", "Engine steps run.", registry=self.registry)

    def on_step(self, engine: Any, outputs: list, seconds: float) -> None:
        del engine, seconds
        self.steps.inc()
        self.tokens.inc(sum(1 for o in outputs if o.token is not None))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
