"""Prometheus metrics of a server (prometheus-client), in a registry of their own.

In: the online loop's observer hooks (serve/online.py `Observer`: first outputs, gaps, endings,
steps, called on the driver's thread), the HTTP layer's refusals, and at each scrape the loop's
queue and the engine's KV pools. Out: `render()`, the text exposition format for `/metrics`:

    mstar_requests_total{outcome}            requests by how they ended: stop, length, cancelled,
                                             error, refused (the engine or route refused it: 400),
                                             invalid (the HTTP layer refused it: 4xx), overloaded (429),
                                             unavailable (503: the run loop closing, or dead)
    mstar_time_to_first_token_seconds        submission to the first output delivered (histogram)
    mstar_inter_token_latency_seconds        between two outputs of one request (histogram)
    mstar_queue_depth                        requests waiting for admission (submitted ones in the loop's
                                             inbox, not its cancels, + the conductor's queue)
    mstar_requests_running                   requests admitted and not ended
    mstar_kv_pages_in_use{node}              KV pages held, per kv node
    mstar_kv_pages_total{node}               the pool's pages, per kv node
    mstar_steps_total{key,mixture}           steps run, by scheduling key and mixture (its walks)
    mstar_prefix_cache_lookups_total         prompt lookups in a prefix cache (a request's, one per kv node
                                             whose plan caches prefixes), counted when the request ends
    mstar_prefix_cache_hits_total            ended requests that found part of their prompt cached
    mstar_prefix_cache_tokens_total          prompt tokens served from the cache instead of prefilled
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mstar.runtime.serve.online import Observer

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def outcome_of(finish_reason: str, is_refused: bool, is_input_fault: bool = False) -> str:
    if is_refused:
        return "refused"
    if is_input_fault:  # its 400 is not counted again
        return "invalid"
    if finish_reason.startswith("error"):
        return "error"
    return finish_reason  # stop, length, cancelled


class ServerMetrics(Observer):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("mstar_requests", "Requests by outcome", ["outcome"], registry=registry)
        self.ttft = Histogram("mstar_time_to_first_token_seconds", "Submission to first output",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("mstar_inter_token_latency_seconds", "Time between two outputs of a request",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_depth = Gauge("mstar_queue_depth", "Requests waiting for admission", registry=registry)
        self.running = Gauge("mstar_requests_running", "Requests admitted and not ended", registry=registry)
        self.kv_in_use = Gauge("mstar_kv_pages_in_use", "KV pages held", ["node"], registry=registry)
        self.kv_total = Gauge("mstar_kv_pages_total", "KV pages in the pool", ["node"], registry=registry)
        self.steps = Counter("mstar_steps", "Steps run by key and mixture", ["key", "mixture"], registry=registry)
        self.prefix_lookups = Counter("mstar_prefix_cache_lookups", "Prompt lookups in a prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("mstar_prefix_cache_hits", "Requests that found part of their prompt cached",
                                   registry=registry)
        self.prefix_tokens = Counter("mstar_prefix_cache_tokens", "Prompt tokens served from the prefix cache",
                                     registry=registry)

    # observer hooks (driver thread)
    def on_first_output(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_output_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finish(self, finish_reason: str, is_refused: bool = False, is_input_fault: bool = False) -> None:
        self.requests.labels(outcome_of(finish_reason, is_refused, is_input_fault)).inc()

    def on_step(self, key: str, mixture: str) -> None:
        self.steps.labels(key, mixture).inc()

    def on_prefix_lookups(self, num_lookups: int, num_cached_tokens: int) -> None:
        self.prefix_lookups.inc(num_lookups)
        if num_cached_tokens:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(num_cached_tokens)

    # HTTP layer
    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self, loop: Any, kv_pages: Callable[[], dict[str, tuple[int, int]]]) -> bytes:
        """The exposition text, with the gauges read now."""
        self.queue_depth.set(loop.num_waiting)
        self.running.set(loop.num_running)
        for node, (in_use, total) in kv_pages().items():
            self.kv_in_use.labels(node).set(in_use)
            self.kv_total.labels(node).set(total)
        return generate_latest(self.registry)
