"""Prometheus metrics of the router (``GET /metrics`` of ``openk3 route``), in a registry of its own.

Per worker: requests by route (``session``, ``prefix``, ``primary``, ``secondary``: routed by cache or
hash; ``fallback``: load spill), retries by reason, prompt and cached prompt tokens from the workers'
``usage`` (streams report usage only when the client asks for it with ``stream_options.include_usage``)
and their ratio, requests in flight, up/down. Fleet-wide: 503s for want of a worker, client disconnects.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "openk3:router_requests", "Requests sent to a worker, by route.", ["worker", "route"], registry=r
        )
        self.retries = Counter(
            "openk3:router_retries",
            "Requests moved to another worker, by the failed worker and reason.",
            ["worker", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "openk3:router_prompt_tokens", "Prompt tokens in workers' usage.", ["worker"], registry=r
        )
        self.cached_tokens = Counter(
            "openk3:router_cached_tokens",
            "Prompt tokens the worker served from its prefix cache (usage cached_tokens).",
            ["worker"],
            registry=r,
        )
        self.hit_rate = Gauge(
            "openk3:router_prefix_cache_hit_rate",
            "Cached / prompt tokens of the worker's answers so far.",
            ["worker"],
            registry=r,
        )
        self.inflight = Gauge(
            "openk3:router_requests_in_flight", "Requests in flight at the worker.", ["worker"], registry=r
        )
        self.healthy = Gauge("openk3:router_worker_up", "1 when the worker is up.", ["worker"], registry=r)
        self.unavailable = Counter(
            "openk3:router_unavailable", "Requests answered 503: no worker up.", registry=r
        )
        self.disconnects = Counter(
            "openk3:router_client_disconnects", "Requests whose client went away first.", registry=r
        )
        self._tokens: dict[str, list[int]] = {}
        """worker → [prompt tokens, cached tokens], for the hit-rate gauge."""

    def record_usage(self, worker: str, usage) -> None:
        """Count a worker answer's ``usage`` object (ignored when it is not one)."""
        if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
        cached = cached if isinstance(cached, int) and cached > 0 else 0
        self.prompt_tokens.labels(worker).inc(usage["prompt_tokens"])
        self.cached_tokens.labels(worker).inc(cached)
        totals = self._tokens.setdefault(worker, [0, 0])
        totals[0] += usage["prompt_tokens"]
        totals[1] += cached
        if totals[0]:
            self.hit_rate.labels(worker).set(totals[1] / totals[0])

    def render(self) -> bytes:
        return generate_latest(self.registry)
