"""Typed configuration of the router (``openk3 route``); ``__post_init__`` raises ``ValueError`` naming the
field and how to fix it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit


def normalize_worker_url(url: str) -> str:
    """``http://host:port`` without a trailing slash or path. Raises ``ValueError`` for anything that is not
    an ``http``/``https`` URL with a host and no path, query or credentials (a worker is a server root)."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"worker URL {url!r} has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} must look like http://host:port")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"worker URL {url!r} must be a server root (no path, query or credentials)")
    if port is None:
        raise ValueError(f"worker URL {url!r} needs an explicit port, e.g. http://127.0.0.1:8001")
    return text


@dataclass
class RouterConfig:
    workers: tuple[str, ...]
    """Worker roots (``http://host:port`` of ``openk3 serve`` processes), normalized and unique."""
    virtual_nodes: int = 64
    """Points per worker on the consistent-hash ring (more: a more even share per worker)."""
    chunk_chars: int = 64
    """Characters per prefix block of a text prompt (chat messages are flattened to text first)."""
    chunk_tokens: int = 16
    """Token ids per prefix block of a token-id prompt."""
    key_chunks: int = 4
    """A request without a session id is placed on the ring by the hash of its first this-many blocks."""
    cache_threshold: float = 0.5
    """Route to the worker holding the longest prefix when it covers at least this fraction of the
    prompt's blocks (SGLang's ``cache_threshold``)."""
    max_inflight: int = 32
    """A worker with this many requests in flight through the router is saturated: its requests spill to
    the next worker on the ring, then to the least loaded."""
    health_interval_s: float = 2.0
    """Seconds between ``GET /health`` probes of every worker."""
    health_timeout_s: float = 2.0
    health_failures: int = 2
    """Failed health probes in a row that take a worker out (a failed request does at once)."""
    quarantine_s: float = 30.0
    """A worker that answered garbage stays out at least this long, whatever its health probe says."""
    request_timeout_s: float = 600.0
    """Longest wait for a worker's answer (between two bytes of a stream)."""
    max_sessions: int = 100_000
    """Session → worker entries kept (least recently used dropped first)."""
    max_index_blocks: int = 1_000_000
    """Prefix blocks remembered per worker (least recently used dropped first)."""
    max_request_bytes: int = 64 << 20
    """Largest request body the router reads (413 beyond it, before it is read or forwarded); at least the
    workers' own ``--max-request-mib``."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):
            raise ValueError("workers must be a sequence of URLs, not one string")
        urls = tuple(normalize_worker_url(u) for u in self.workers)
        if not urls:
            raise ValueError("workers is empty: give at least one worker URL")
        dup = {u for u in urls if urls.count(u) > 1}
        if dup:
            raise ValueError(f"workers lists {sorted(dup)[0]} twice")
        self.workers = urls
        for name in (
            "virtual_nodes",
            "chunk_chars",
            "chunk_tokens",
            "key_chunks",
            "max_inflight",
            "health_failures",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_sessions", "max_index_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.quarantine_s) and self.quarantine_s >= 0):
            raise ValueError(f"quarantine_s must be >= 0 seconds, got {self.quarantine_s}")

    @property
    def retry_after_s(self) -> int:
        """``Retry-After`` of a 503 when no worker is up: the next health probe's time, in whole seconds."""
        return max(1, math.ceil(self.health_interval_s))
