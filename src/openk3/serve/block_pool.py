"""The block pool: a fixed list of pages with reference counts, an LRU free queue and a hash index.

One pool holds every page of the server ("one pool, one page size",
``docs/references.md#paged-pool-and-prefix-cache``): an MLA
latent block is one page; a KDA state (fp32 recurrent state + conv state of every KDA layer) spans
``state_pages`` pages. The pool only does bookkeeping; :mod:`openk3.serve.cache_storage` holds the tensors.

Invariants (checked by :meth:`BlockPool.check_invariants`):

1. Block 0 is the null block: ``ref_cnt`` pinned at 1, never allocated, freed, cached or queued.
2. A non-null block is in ``free_queue`` exactly when its ``ref_cnt`` is 0. The queue is in eviction
   order: the front is taken first.
3. ``cached`` maps a :class:`CacheKey` to the tuple of blocks that hold its content, and a block's
   ``cache_key`` is set exactly when it belongs to such an entry. A cached entry's blocks always share one
   ``ref_cnt`` (they are touched and freed together).
4. Allocation takes blocks from the front of the queue; taking a block that belongs to a cached entry
   evicts the whole entry (its other blocks stay free and move to the front, being empty now).
5. Freed blocks that hold a cached entry go to the back (most recently used); freed blocks that hold
   nothing go to the front (reused first), so cached content is evicted only when no empty block is left.

``ref_cnt`` counts the requests using a block (vLLM ``BlockPool`` semantics).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

NULL_BLOCK_ID = 0


class CacheKey(NamedTuple):
    """What a cached entry holds: ``kind`` ``"mla"`` (latent block) or ``"kda"`` (state checkpoint at the
    block's end boundary), and the chained hash of the token block (:mod:`openk3.serve.prefix_cache`)."""

    kind: str
    block_hash: bytes


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "cache_key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: CacheKey | None = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.cache_key is not None})"
        )


class PoolExhaustedError(RuntimeError):
    """More blocks were requested than the free queue holds (a scheduler bug: admission reserves)."""


class BlockPool:
    """``num_blocks`` pages, ids ``0..num_blocks-1`` (0 = null). Raises ``ValueError`` for ``num_blocks < 2``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[CacheKey, tuple[int, ...]] = {}
        self.num_evicted_entries = 0
        self.on_evict: Callable[[CacheKey, tuple[int, ...]], object] | None = None
        """Called with an entry's key and blocks just before eviction reuses them (their content intact):
        the host-memory tier's write-back (:meth:`openk3.serve.host_tier.HostTier.save`)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (empty or holding evictable cached content)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (evicting cached entries), ``ref_cnt`` = 1.

        Raises :class:`PoolExhaustedError` when fewer than ``n`` are free.
        """
        if n > len(self.free_queue):
            raise PoolExhaustedError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.cache_key is not None:
                self._evict(block.cache_key)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def _evict(self, key: CacheKey) -> None:
        if self.on_evict is not None:
            self.on_evict(key, self.cached[key])
        self.num_evicted_entries += 1
        self.uncache(key)

    def uncache(self, key: CacheKey) -> None:
        """Forget a cached entry (no-op when absent): its blocks stay with their users, or, unused, move to
        the front of the free queue as empty blocks."""
        ids = self.cached.pop(key, None)
        if ids is None:
            return
        for block_id in ids:
            self.blocks[block_id].cache_key = None
        for block_id in reversed(ids):
            if block_id in self.free_queue:
                self.free_queue.move_to_end(block_id, last=False)

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request starts using ``block_ids`` (cache hits): ``ref_cnt += 1``, leaving the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block_id == NULL_BLOCK_ID:
                raise ValueError("the null block cannot be touched")
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """``ref_cnt -= 1``; blocks reaching 0 join the free queue (invariant 5). Pass them in eviction
        order: among the cached ones, the first given is evicted first."""
        empty = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block_id == NULL_BLOCK_ID or block.ref_cnt <= 0:
                raise ValueError(f"block {block_id} is not in use")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.cache_key is None:
                    empty.append(block_id)
                else:
                    self.free_queue[block_id] = None
        for block_id in reversed(empty):
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)

    def cache(self, key: CacheKey, block_ids: tuple[int, ...]) -> bool:
        """Register ``block_ids`` as holding ``key``. Returns False (and changes nothing) when ``key`` is
        already cached or a block already holds another entry."""
        if key in self.cached or any(self.blocks[b].cache_key is not None for b in block_ids):
            return False
        if len({self.blocks[b].ref_cnt for b in block_ids}) != 1 or NULL_BLOCK_ID in block_ids:
            raise ValueError(f"blocks {block_ids} of one entry must be non-null and share one ref_cnt")
        self.cached[key] = tuple(block_ids)
        for block_id in block_ids:
            self.blocks[block_id].cache_key = key
        return True

    def lookup(self, key: CacheKey) -> tuple[int, ...] | None:
        return self.cached.get(key)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when an invariant of the module docstring does not hold."""
        null = self.blocks[NULL_BLOCK_ID]
        assert null.ref_cnt == 1 and null.cache_key is None and NULL_BLOCK_ID not in self.free_queue
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
        for key, ids in self.cached.items():
            assert all(self.blocks[b].cache_key == key for b in ids), key
            assert len({self.blocks[b].ref_cnt for b in ids}) == 1, key
        keyed = sum(1 for b in self.blocks if b.cache_key is not None)
        assert keyed == sum(len(ids) for ids in self.cached.values())
