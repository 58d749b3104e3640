"""A consistent-hash ring with virtual nodes (Karger et al., 1997; ``docs/references.md#cache-aware-routing``).

Each worker owns ``virtual_nodes`` points ``hash(worker, i)`` on a 64-bit circle; a key belongs to the
first point clockwise from ``hash(key)``. The preference list of a key is the distinct workers met walking
clockwise from there: the first is its primary, the second its secondary, and so on. Adding a worker
moves to it only the keys whose walk now meets one of its points first (about ``1 / (n + 1)`` of them);
removing one moves only its own keys, each to its former secondary. Nothing else changes.
"""

from __future__ import annotations

import bisect
import hashlib


def ring_hash(data: bytes) -> int:
    """64-bit position on the ring: the first 8 bytes of BLAKE2b, big-endian."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """The ring over ``workers`` (any order: the ring depends only on the set). Raises ``ValueError`` for
    ``virtual_nodes < 1``."""

    def __init__(self, workers, virtual_nodes: int = 64) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self.workers: list[str] = []
        self._points: list[tuple[int, str]] = []
        for worker in workers:
            self.add(worker)

    def add(self, worker: str) -> None:
        """Put ``worker``'s points on the ring (no-op when it is there)."""
        if worker in self.workers:
            return
        self.workers.append(worker)
        for i in range(self.virtual_nodes):
            bisect.insort(self._points, (ring_hash(f"{worker}#{i}".encode()), worker))

    def remove(self, worker: str) -> None:
        """Take ``worker``'s points off the ring (no-op when it is not there)."""
        if worker in self.workers:
            self.workers.remove(worker)
            self._points = [p for p in self._points if p[1] != worker]

    def preference(self, key: bytes) -> list[str]:
        """Every worker once, in the order a walk clockwise from ``hash(key)`` meets them (empty ring: [])."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, (ring_hash(key), ""))
        order: list[str] = []
        for j in range(len(self._points)):
            worker = self._points[(start + j) % len(self._points)][1]
            if worker not in order:
                order.append(worker)
                if len(order) == len(self.workers):
                    break
        return order
