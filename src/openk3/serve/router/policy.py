"""The routing decision: which worker gets a request (session affinity, prefix match, consistent hashing
with a secondary, load-aware fallback). Pure bookkeeping; :mod:`openk3.serve.router.app` does the I/O.

For the workers that are up and not excluded (failed earlier for this request), in this order:

1. ``session``: the worker that last served the request's session, unless it is saturated;
2. ``prefix``: the worker whose index holds the longest run of the prompt's leading blocks, when that run
   covers at least ``cache_threshold`` of them and the worker is not saturated (SGLang's cache-aware
   policy, ``docs/references.md#cache-aware-routing``);
3. ``primary`` / ``secondary``: the first unsaturated worker of the key's preference list on the
   consistent-hash ring (key: the session id, else the prompt's first ``key_chunks`` blocks), so a new
   session or prefix lands on a stable worker and spills to a stable second one when that is saturated or
   down (``secondary`` also names any later ring choice);
4. ``fallback``: every worker is saturated; the least loaded one.

"Saturated" is ``max_inflight`` requests in flight through the router. The ring spans every registered
worker, up or down, so a worker going down moves only its own keys and coming back moves them home.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from openk3.serve.router.config import RouterConfig
from openk3.serve.router.hash_ring import HashRing
from openk3.serve.router.prefix_index import PrefixIndex

ROUTES = ("session", "prefix", "primary", "secondary", "fallback")
"""Why a worker was chosen (the ``route`` label of the router's metrics)."""


@dataclass
class WorkerState:
    url: str
    index: PrefixIndex
    healthy: bool = False
    """Up: its last health probe or request succeeded (a new worker is down until its first probe)."""
    inflight: int = 0
    quarantined_until: float = 0.0
    """``time.monotonic()`` before which the worker stays out (it answered garbage)."""
    quarantine_reason: str = ""
    """Why it was quarantined; kept while the quarantine lasts, whatever its health probes answer meanwhile
    (they overwrite ``last_error``)."""
    last_error: str = ""
    failed_probes: int = 0
    """Health probes failed in a row."""
    max_request_bytes: int | None = None
    """The body limit its ``GET /health`` reports (``None``: not told); the router answers a longer body's
    413 itself rather than upload what the worker will refuse."""

    def is_up(self, now: float) -> bool:
        return self.healthy and now >= self.quarantined_until


@dataclass
class Decision:
    worker: WorkerState
    route: str
    """One of :data:`ROUTES`."""
    matched_blocks: int = 0
    blocks: list[bytes] = field(default_factory=list)


class RoutingPolicy:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerState] = {}
        self.ring = HashRing([], config.virtual_nodes)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        for url in config.workers:
            self.add_worker(url)

    def add_worker(self, url: str) -> WorkerState:
        """Register a worker (down until its first health probe); returns its state."""
        if url not in self.workers:
            self.workers[url] = WorkerState(url, PrefixIndex(self.config.max_index_blocks))
            self.ring.add(url)
        return self.workers[url]

    def remove_worker(self, url: str) -> None:
        """Forget a worker: its ring share moves to the next workers, its sessions are routed afresh."""
        self.workers.pop(url, None)
        self.ring.remove(url)
        for session in [s for s, w in self.sessions.items() if w == url]:
            del self.sessions[session]

    def choose(
        self,
        session: str | None,
        blocks: list[bytes],
        short_key: bytes = b"",
        exclude: set[str] = frozenset(),
        now: float | None = None,
    ) -> Decision | None:
        """The worker for a request with this session id (or ``None``) and prompt blocks; ``short_key``
        places a prompt with no full block on the ring. ``None`` when no worker is up outside ``exclude``."""
        now = time.monotonic() if now is None else now
        up = {u: w for u, w in self.workers.items() if u not in exclude and w.is_up(now)}
        if not up:
            return None
        room = {u: w for u, w in up.items() if w.inflight < self.config.max_inflight}
        if session is not None and self.sessions.get(session) in room:
            worker = room[self.sessions[session]]
            return Decision(worker, "session", worker.index.match(blocks), blocks)
        if blocks and room:
            best = max(room.values(), key=lambda w: (w.index.match(blocks), -w.inflight))
            matched = best.index.match(blocks)
            if matched and matched >= self.config.cache_threshold * len(blocks):
                return Decision(best, "prefix", matched, blocks)
        if session is not None:
            key = b"session\x00" + session.encode("utf-8", "surrogatepass")
        else:
            key = b"".join(blocks[: self.config.key_chunks]) or short_key
        order = [u for u in self.ring.preference(key) if u in room]
        if order:
            first = self.ring.preference(key)[0] == order[0]
            worker = room[order[0]]
            return Decision(worker, "primary" if first else "secondary", worker.index.match(blocks), blocks)
        worker = min(up.values(), key=lambda w: w.inflight)
        return Decision(worker, "fallback", worker.index.match(blocks), blocks)

    def record_success(self, decision: Decision, session: str | None) -> None:
        """The worker served the request: remember the session's worker and the prompt's blocks there."""
        decision.worker.index.insert(decision.blocks)
        if session is not None and self.config.max_sessions:
            self.sessions[session] = decision.worker.url
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.config.max_sessions:
                self.sessions.popitem(last=False)
