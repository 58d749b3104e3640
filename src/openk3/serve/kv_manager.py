"""The KV cache manager: block tables, KDA state slots, prefix hits, checkpoints and reservations.

Per running request it keeps an append-only ``block_table`` (MLA latent blocks, one per ``bs`` tokens), a
``state_slot`` (the pages of the request's own running KDA state) and a reservation: the blocks it may
still allocate before ``max_tokens`` (plus ``lookahead_tokens``: the drafts a speculative step verifies
past the request's last token, latents written then dropped). Admission reserves the worst case, so a
running request can never run out of blocks and no preemption is needed (a simpler, more conservative
policy than vLLM's recompute preemption; ``docs/references.md#token-budgets``).

Reservation invariant: ``Σ reserved ≤ pool.num_free_blocks`` (free blocks include evictable cached ones,
so "free plus evictable" is what admission compares against).

A hit (:func:`~openk3.serve.prefix_cache.find_longest_cache_hit`) reuses the matched MLA blocks (their
``ref_cnt`` goes up) and copies the matched KDA checkpoint into the request's own slot (copy-on-write: the
checkpoint itself is never written). Checkpoints are stored at ``request.checkpoint_positions``: the last
block boundary before the prompt's end, the prompt's end itself when it is a block boundary (so an extension
of the prompt reuses every full block), every ``checkpoint_interval``-th boundary, and the branching point
where a previous lookup's MLA match went deeper than its state (SGLang ``mamba_branching_seqlen``);
while decoding, the latest block boundary of the generated text (one per request: the next turn's prompt
holds that text).
A checkpoint is a cache entry with ``ref_cnt`` 0 (evictable at once); it is skipped when storing it would
eat into reservations.

With ``host_pool_mib`` > 0, entries the pool evicts are written back to a host-memory tier
(:mod:`openk3.serve.host_tier`) and a lookup finds them there too; admission counts the blocks such a hit
brings back as blocks it needs now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openk3.serve.block_pool import NULL_BLOCK_ID, BlockPool, CacheKey, PoolExhaustedError
from openk3.serve.cache_storage import CacheStorage
from openk3.serve.config import CacheConfig
from openk3.serve.host_tier import HostTier
from openk3.serve.prefix_cache import CacheHit, extend_block_hashes, find_longest_cache_hit
from openk3.serve.request import Request


@dataclass
class AdmissionPlan:
    hit: CacheHit
    num_new_blocks: int
    """MLA blocks the request may still allocate (its reservation)."""
    num_pages_needed: int
    """Free blocks admission needs: the state slot, hit blocks leaving the free queue, and the larger of
    the reservation and the checkpoint pages held during the copy."""


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, storage: CacheStorage, config: CacheConfig, lookahead_tokens: int = 0
    ) -> None:
        """``lookahead_tokens``: positions past ``max_tokens`` a request may write (an engine with a draft: its
        default ``k``, so a speculative step near the end still verifies a full chain)."""
        if lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be ≥ 0, got {lookahead_tokens}")
        self.pool, self.storage, self.config = pool, storage, config
        self.lookahead_tokens = lookahead_tokens
        self.block_size = config.block_size
        self.state_pages = storage.layout.state_pages
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots: dict[str, tuple[int, ...]] = {}
        self.reserved: dict[str, int] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_checkpoints_stored = 0
        self.decode_checkpoints: dict[str, CacheKey] = {}
        """Request id → its latest checkpoint inside its generated text (the one the next turn can use)."""
        self.host_hit_tokens = 0
        """Prompt tokens of hits whose MLA blocks or checkpoint came back from the host tier."""
        self.host: HostTier | None = None
        if config.host_pool_mib and config.enable_prefix_caching:
            page = storage.layout.page_bytes
            num_pages = int(config.host_pool_mib * 2**20 // page)
            if num_pages < max(1, self.state_pages):
                raise ValueError(
                    f"host_pool_mib={config.host_pool_mib:g} holds {num_pages} pages of {page} B, fewer than "
                    f"one cache entry ({max(1, self.state_pages)} pages); raise it or set it to 0"
                )
            self.host = HostTier(storage, num_pages)
            pool.on_evict = self.host.save

    # ---- budgets ---------------------------------------------------------------------------------------
    @property
    def num_available_blocks(self) -> int:
        """Free (or evictable) blocks not promised to a running request."""
        return self.pool.num_free_blocks - sum(self.reserved.values())

    def max_blocks(self, request: Request) -> int:
        """MLA blocks a request holds at most (:meth:`blocks_for_tokens` of its prompt + ``max_tokens``)."""
        return self.blocks_for_tokens(request.max_num_tokens)

    def blocks_for_tokens(self, max_num_tokens: int) -> int:
        """MLA blocks a request of ``max_num_tokens`` (prompt + ``max_tokens``) holds at most: its last
        sampled token is never computed, the lookahead's drafts may be."""
        return math.ceil((max_num_tokens - 1 + self.lookahead_tokens) / self.block_size)

    def max_table_blocks(self, max_model_len: int) -> int:
        """MLA blocks any request's table holds at most: a request of ``max_model_len`` tokens' or, when
        fewer, what :meth:`check_fits_pool` lets one request hold."""
        return min(self.blocks_for_tokens(max_model_len), self.pool.num_blocks - 1 - self.state_pages)

    def check_fits_pool(self, request: Request) -> None:
        """Raise ``ValueError`` when the request could not run even in an empty pool."""
        need = self.max_blocks(request) + self.state_pages
        if need > self.pool.num_blocks - 1:
            raise ValueError(
                f"prompt + max_tokens = {request.max_num_tokens} tokens need {need} cache blocks; "
                f"the pool has {self.pool.num_blocks - 1}"
            )

    # ---- admission -------------------------------------------------------------------------------------
    def plan_admission(self, request: Request) -> AdmissionPlan | None:
        """Look up the prefix and size the request's needs; ``None`` when it does not fit now."""
        hit = CacheHit()
        if self.config.enable_prefix_caching:
            extend_block_hashes(
                request.block_hashes, request.prompt_token_ids, self.block_size, request.hash_root
            )
            hit = find_longest_cache_hit(
                self.pool,
                request.block_hashes,
                request.num_prompt_tokens,
                self.block_size,
                self.state_pages > 0,
                self.host,
            )
        plan = self._plan(request, hit)
        if plan.num_pages_needed > self.num_available_blocks and hit.num_tokens:
            plan = self._plan(request, CacheHit())  # holding the hit costs more than recomputing it
        return plan if plan.num_pages_needed <= self.num_available_blocks else None

    def _plan(self, request: Request, hit: CacheHit) -> AdmissionPlan:
        device = [b for b in hit.mla_blocks if b != NULL_BLOCK_ID]
        leaving_free = sum(1 for b in device if self.pool.blocks[b].ref_cnt == 0)
        held = sum(1 for b in hit.checkpoint_blocks if self.pool.blocks[b].ref_cnt == 0)
        new_blocks = self.max_blocks(request) - len(hit.mla_blocks)
        need = self.state_pages + leaving_free + len(hit.host_mla) + max(new_blocks, held)
        return AdmissionPlan(hit, new_blocks, need)

    def admit(self, request: Request, plan: AdmissionPlan) -> None:
        """Take the hit blocks (bringing host-tier ones back into new blocks), allocate and fill the state
        slot (checkpoint copy from either tier, or zeros), reserve."""
        rid, hit = request.request_id, plan.hit
        on_host = list(hit.host_mla.values()) + ([hit.host_checkpoint] if hit.host_checkpoint else [])
        if on_host:
            self.host.lock(on_host)  # allocating below may evict device entries into the host tier
        self.pool.touch(hit.checkpoint_blocks)
        self.pool.touch([b for b in hit.mla_blocks if b != NULL_BLOCK_ID])
        table = list(hit.mla_blocks)
        for (i, key), block in zip(hit.host_mla.items(), self.pool.get_new_blocks(len(hit.host_mla))):
            self.host.load(key, (block,))
            table[i] = block
        slot = tuple(self.pool.get_new_blocks(self.state_pages))
        if hit.checkpoint_blocks:
            self.storage.copy_pages(hit.checkpoint_blocks, slot)
        elif hit.host_checkpoint:
            self.host.load(hit.host_checkpoint, slot)
        elif slot:
            self.storage.zero_pages(slot)
        self.pool.free_blocks(hit.checkpoint_blocks)
        if on_host:
            self.host.unlock(on_host)
            for i, key in hit.host_mla.items():  # back on the device: one tier holds a block
                self.pool.cache(key, (table[i],))
                self.host.discard(key)
            self.host_hit_tokens += hit.num_tokens
        self.block_tables[rid] = table
        self.state_slots[rid] = slot
        self.reserved[rid] = plan.num_new_blocks
        self.num_cached_blocks[rid] = len(hit.mla_blocks)
        request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
        request.checkpoint_positions = self._checkpoint_positions(request, hit)
        self.prefix_query_tokens += request.num_prompt_tokens
        self.prefix_hit_tokens += hit.num_tokens

    def _checkpoint_positions(self, request: Request, hit: CacheHit) -> frozenset[int]:
        if not (self.config.enable_prefix_caching and self.state_pages):
            return frozenset()
        bs, P = self.block_size, request.num_prompt_tokens
        # the last boundary before the end (an exact repeat of the prompt can use it) and the last at or
        # before the end: equal unless the prompt ends on a boundary, where the state after the whole
        # prompt is the one an extension of it (the next turn) can use
        positions = {(P - 1) // bs * bs, P // bs * bs, hit.num_mla_matched_tokens}
        if self.config.checkpoint_interval:
            step = self.config.checkpoint_interval * bs
            positions.update(range(step, P, step))
        return frozenset(p for p in positions if hit.num_tokens < p <= P)

    # ---- running ---------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> None:
        """Grow the block table to cover ``num_computed_tokens + num_new_tokens`` (from the reservation)."""
        rid = request.request_id
        table = self.block_tables[rid]
        need = math.ceil((request.num_computed_tokens + num_new_tokens) / self.block_size) - len(table)
        if need <= 0:
            return
        if need > self.reserved[rid]:
            raise PoolExhaustedError(f"request {rid} needs {need} blocks beyond its reservation")
        table.extend(self.pool.get_new_blocks(need))
        self.reserved[rid] -= need

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        rid = request.request_id
        n_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks[rid]
        if n_full <= start:
            return
        hashes = extend_block_hashes(
            request.block_hashes,
            request.all_token_ids[: n_full * self.block_size],
            self.block_size,
            request.hash_root,
        )
        table = self.block_tables[rid]
        for i in range(start, n_full):
            self.pool.cache(CacheKey("mla", hashes[i]), (table[i],))
        self.num_cached_blocks[rid] = n_full

    def store_checkpoint(self, request: Request) -> bool:
        """Copy the request's KDA state (at a block boundary) into a new cached checkpoint entry.

        Returns whether one was stored (not when it exists already or the pool has no spare blocks).
        """
        n = request.num_computed_tokens
        if n % self.block_size or not self.state_pages or self.num_available_blocks < self.state_pages:
            return False
        extend_block_hashes(
            request.block_hashes, request.all_token_ids[:n], self.block_size, request.hash_root
        )
        key = CacheKey("kda", request.block_hashes[n // self.block_size - 1])
        if self.pool.lookup(key) is not None:
            return False
        pages = tuple(self.pool.get_new_blocks(self.state_pages))
        self.storage.copy_pages(self.state_slots[request.request_id], pages)
        self.pool.cache(key, pages)
        self.pool.free_blocks(pages)
        self.num_checkpoints_stored += 1
        return True

    def store_decode_checkpoint(self, request: Request) -> bool:
        """At a block boundary inside the generated text, keep the state there as the request's one decode
        checkpoint (its previous one is dropped), so the next turn, whose prompt holds this output, reuses
        it. Returns whether one was stored."""
        n = request.num_computed_tokens
        if not self.config.enable_prefix_caching or n <= request.num_prompt_tokens or n % self.block_size:
            return False
        if not self.store_checkpoint(request):
            return False
        previous = self.decode_checkpoints.get(request.request_id)
        if previous is not None:
            self.pool.uncache(previous)
        self.decode_checkpoints[request.request_id] = CacheKey(
            "kda", request.block_hashes[n // self.block_size - 1]
        )
        return True

    def free(self, request: Request) -> None:
        """Release everything the request holds: blocks (tail first, so the prefix's end is evicted first),
        the state slot and the reservation. Idempotent."""
        rid = request.request_id
        if rid not in self.block_tables:
            return
        self.pool.free_blocks(reversed(self.block_tables.pop(rid)))
        slot = self.state_slots.pop(rid)
        self.storage.release_states(slot)
        self.pool.free_blocks(slot)
        del self.reserved[rid], self.num_cached_blocks[rid]
        self.decode_checkpoints.pop(rid, None)  # the last one stays cached
