"""The host-memory tier: a bounded pool in CPU memory that keeps cache entries the device pool evicted.

When the block pool evicts a cached entry (an MLA latent block, or a KDA checkpoint spanning
``state_pages`` pages) to reuse its pages, :meth:`HostTier.save` copies the entry's pages here first. A
later lookup that misses on the device but finds the entry here brings it back with one copy per page
instead of recomputing it (:class:`~openk3.serve.kv_manager.KVCacheManager`): MLA blocks move back into
the device pool (and leave this tier, so an entry lives in one tier), a checkpoint is copied straight
into the request's own state slot (and stays here). The copies are exact, so a hit served from this tier
gives the same outputs as a device hit or a cold run. The KDA state of a request is a few fixed-size
pages however long its prefix, which makes checkpoints cheap to keep here
(``docs/references.md#host-memory-tier``).

Layout: ``pages`` ``[num_pages, page_numel]`` in the device pool's storage dtype, on the CPU, pinned
when the pool is on CUDA (so copies both ways run asynchronously on the current stream, ordered with the
kernels that read and write the device pages). Entries are kept least recently used first; saving into a
full tier drops the least recently used entries that are not locked (an entry being brought back is
locked), and an entry that still does not fit is not kept.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from openk3.serve.block_pool import CacheKey


class HostTier:
    """``num_pages`` host pages for the entries of ``storage``'s pool. Raises ``ValueError`` for
    ``num_pages < 1``."""

    def __init__(self, storage, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.storage = storage
        pin = storage.pages.device.type == "cuda"
        self.pages = torch.zeros(
            num_pages, storage.layout.page_numel, dtype=storage.layout.dtype, pin_memory=pin
        )
        self.free_rows: list[int] = list(range(num_pages - 1, -1, -1))
        self.entries: OrderedDict[CacheKey, tuple[int, ...]] = OrderedDict()
        self.locks: dict[CacheKey, int] = {}
        self.num_saved = 0
        self.num_loaded = 0
        self.num_dropped = 0

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_rows)

    def lookup(self, key: CacheKey) -> tuple[int, ...] | None:
        """The host rows of ``key`` (``None`` when not here); a hit makes it most recently used."""
        rows = self.entries.get(key)
        if rows is not None:
            self.entries.move_to_end(key)
        return rows

    def save(self, key: CacheKey, block_ids: tuple[int, ...]) -> bool:
        """Copy a device entry's pages here (the block pool calls this just before reusing them). Returns
        whether it was kept (not when it is here already or cannot fit beside the locked entries)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        if not self._make_room(len(block_ids)):
            self.num_dropped += 1
            return False
        rows = tuple(self.free_rows.pop() for _ in block_ids)
        self.storage.copy_to_host(block_ids, self.pages, rows)
        self.entries[key] = rows
        self.num_saved += 1
        return True

    def _make_room(self, n: int) -> bool:
        if n > self.num_pages:
            return False
        for key in list(self.entries):
            if len(self.free_rows) >= n:
                break
            if not self.locks.get(key):
                self._drop(key)
        return len(self.free_rows) >= n

    def _drop(self, key: CacheKey) -> None:
        self.free_rows.extend(reversed(self.entries.pop(key)))

    def load(self, key: CacheKey, block_ids: tuple[int, ...]) -> None:
        """Copy ``key``'s pages into the device pages ``block_ids``. Raises ``KeyError`` when not here."""
        rows = self.entries[key]
        if len(rows) != len(block_ids):
            raise ValueError(f"{key.kind} entry has {len(rows)} pages, {len(block_ids)} given")
        self.storage.copy_from_host(self.pages, rows, block_ids)
        self.num_loaded += 1

    def lock(self, keys) -> None:
        """Keep ``keys`` while their device copies are being made (saving other entries cannot drop them)."""
        for key in keys:
            self.locks[key] = self.locks.get(key, 0) + 1

    def unlock(self, keys) -> None:
        for key in keys:
            self.locks[key] -= 1
            if not self.locks[key]:
                del self.locks[key]

    def discard(self, key: CacheKey) -> None:
        """Forget ``key`` (it moved back to the device pool). Raises ``ValueError`` while it is locked."""
        if self.locks.get(key):
            raise ValueError(f"{key.kind} entry is locked")
        if key in self.entries:
            self._drop(key)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when rows are lost or shared."""
        used = [r for rows in self.entries.values() for r in rows]
        assert len(used) == len(set(used)) and not set(used) & set(self.free_rows)
        assert len(used) + len(self.free_rows) == self.num_pages
        assert all(key in self.entries for key in self.locks)
