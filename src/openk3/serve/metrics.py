"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own (no global state).

Names follow vLLM's (``docs/references.md#openai-api``) under the ``openk3:`` prefix: running and waiting
requests,
cache usage, prefix-cache query/hit tokens and hit rate, prompt/generation tokens, generated tokens per
second (over the last ``window_s`` seconds), a time-to-first-token histogram, admission rejections, and
the host-memory tier's hit tokens and usage.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("openk3:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("openk3:num_requests_waiting", "Requests in the waiting queue.", registry=r)
        self.usage = Gauge(
            "openk3:kv_cache_usage_perc", "Fraction of pool blocks used by requests (0-1).", registry=r
        )
        self.prefix_queries = Counter(
            "openk3:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            "openk3:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.hit_rate = Gauge(
            "openk3:prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens.", registry=r
        )
        self.prompt_tokens = Counter(
            "openk3:prompt_tokens", "Prompt tokens of admitted API requests.", registry=r
        )
        self.generation_tokens = Counter("openk3:generation_tokens", "Generated tokens.", registry=r)
        self.tokens_per_s = Gauge(
            "openk3:generation_tokens_per_second",
            f"Generated tokens per second over the last {window_s:g} s.",
            registry=r,
        )
        self.ttft = Histogram(
            "openk3:time_to_first_token_seconds",
            "Time from request arrival to first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.rejections = Counter("openk3:admission_rejections", "Requests answered 429.", registry=r)
        self.host_hits = Counter(
            "openk3:host_tier_hits", "Prompt tokens of hits that used the host-memory tier.", registry=r
        )
        self.host_usage = Gauge(
            "openk3:host_tier_usage_perc",
            "Fraction of host-tier pages holding cache entries (0-1).",
            registry=r,
        )
        self.window_s = window_s
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._seen = (0, 0)
        self._seen_host = 0

    def on_step(self, outputs, duration_s: float) -> None:
        """Engine-thread hook: count generated tokens."""
        n = sum(len(o.new_token_ids) for o in outputs)
        if n:
            self.generation_tokens.inc(n)
            with self._lock:
                self._window.append((time.monotonic(), n))

    def render(self, stats) -> bytes:
        """Refresh the gauges from :class:`~openk3.serve.engine.EngineStats` and render the text format."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.usage.set(stats.kv_cache_usage)
        queried, hit = self._seen
        self.prefix_queries.inc(stats.prefix_query_tokens - queried)
        self.prefix_hits.inc(stats.prefix_hit_tokens - hit)
        self.host_hits.inc(stats.host_hit_tokens - self._seen_host)
        self._seen, self._seen_host = (
            (stats.prefix_query_tokens, stats.prefix_hit_tokens),
            stats.host_hit_tokens,
        )
        self.host_usage.set(stats.host_tier_usage)
        self.hit_rate.set(
            stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0
        )
        now = time.monotonic()
        with self._lock:
            while self._window and now - self._window[0][0] > self.window_s:
                self._window.popleft()
            self.tokens_per_s.set(sum(n for _, n in self._window) / self.window_s)
        return generate_latest(self.registry)
