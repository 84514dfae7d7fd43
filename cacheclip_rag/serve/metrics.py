"""The server's Prometheus metrics (one registry per app): requests by endpoint and status, time to
first token per method, reused and recomputed prompt tokens, store reads per tier, queue depth,
batched decode steps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("cacheclip_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("cacheclip_ttft_seconds", "time to first token", ["method"], registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
        self.tokens = Counter("cacheclip_prompt_tokens", "prompt tokens by how they were obtained", ["kind"],
                              registry=self.registry)  # kind: reused (from stored caches), recomputed, computed
        self.store_reads = Counter("cacheclip_store_reads", "chunk-cache reads by tier and outcome",
                                   ["tier", "outcome"], registry=self.registry)
        self.recognised = Counter("cacheclip_chunks_recognised", "stored chunks found in prompts", registry=self.registry)
        self.queue_depth = Gauge("cacheclip_queue_depth", "requests waiting or running", registry=self.registry)
        self.batched_steps = Gauge("cacheclip_batched_decode_steps", "decode forwards run for 2+ requests at once",
                                   registry=self.registry)
        self.batched_rows = Gauge("cacheclip_batched_decode_requests", "request steps inside those forwards",
                                  registry=self.registry)

    def observe_store(self, store: dict[str, float]) -> None:
        for name, value in store.items():
            tier, _, what = name.rpartition("_")
            if what in ("hits", "misses") and value:
                self.store_reads.labels(tier, what).inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
