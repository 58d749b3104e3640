"""Block pool, prefix hashing, two-stage lookup, the KV cache manager and the host-memory tier on tiny
pools: exact block ids, reference counts and eviction order, derived by hand from the invariants in
``serve/block_pool.py`` and ``serve/host_tier.py``."""

from __future__ import annotations

import pytest
import torch

from openk3.serve.block_pool import BlockPool, CacheKey, PoolExhaustedError
from openk3.serve.cache_storage import CacheStorage, PageLayout
from openk3.serve.config import CacheConfig
from openk3.serve.host_tier import HostTier
from openk3.serve.kv_manager import KVCacheManager
from openk3.serve.prefix_cache import (
    ROOT_HASH,
    extend_block_hashes,
    find_longest_cache_hit,
    hash_block_tokens,
)
from openk3.serve.request import Request, SamplingParams


def queue(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_pool_allocation_free_order_and_eviction():
    pool = BlockPool(8)  # block 0 is null: 7 usable
    assert queue(pool) == [1, 2, 3, 4, 5, 6, 7] and pool.blocks[0].ref_cnt == 1
    a = pool.get_new_blocks(3)
    assert a == [1, 2, 3] and [pool.blocks[i].ref_cnt for i in a] == [1, 1, 1]
    assert pool.cache(CacheKey("mla", b"h1"), (1,)) and pool.cache(CacheKey("mla", b"h2"), (2,))
    assert not pool.cache(CacheKey("mla", b"h1"), (3,))  # key taken: nothing changes
    pool.free_blocks([3, 2, 1])  # eviction order: uncached 3 to the front, cached 2 then 1 to the back
    assert queue(pool) == [3, 4, 5, 6, 7, 2, 1]
    pool.check_invariants()
    b = pool.get_new_blocks(5)  # empty blocks first
    assert b == [3, 4, 5, 6, 7] and set(pool.cached) == {CacheKey("mla", b"h1"), CacheKey("mla", b"h2")}
    c = pool.get_new_blocks(1)  # now the LRU cached block goes: 2 (freed before 1)
    assert (
        c == [2]
        and pool.lookup(CacheKey("mla", b"h2")) is None
        and pool.lookup(CacheKey("mla", b"h1")) == (1,)
    )
    assert pool.num_evicted_entries == 1 and queue(pool) == [1]
    with pytest.raises(PoolExhaustedError):
        pool.get_new_blocks(2)
    pool.check_invariants()


def test_pool_ref_counts_touch_and_errors():
    pool = BlockPool(5)
    (x,) = pool.get_new_blocks(1)
    pool.cache(CacheKey("mla", b"x"), (x,))
    pool.touch([x])  # a second request shares it
    assert pool.blocks[x].ref_cnt == 2
    pool.free_blocks([x])
    assert pool.blocks[x].ref_cnt == 1 and x not in pool.free_queue
    pool.free_blocks([x])
    assert pool.blocks[x].ref_cnt == 0 and queue(pool)[-1] == x  # cached: back of the queue
    pool.touch([x])  # a hit takes it out of the free queue again
    assert x not in pool.free_queue and pool.blocks[x].ref_cnt == 1
    with pytest.raises(ValueError):
        pool.free_blocks([0])
    with pytest.raises(ValueError):
        pool.touch([0])
    with pytest.raises(ValueError):
        BlockPool(1)
    pool.free_blocks([x])
    with pytest.raises(ValueError):
        pool.free_blocks([x])
    pool.check_invariants()


def test_multi_page_entry_is_evicted_whole():
    pool = BlockPool(6)
    ckpt = tuple(pool.get_new_blocks(2))  # a KDA state of two pages
    assert ckpt == (1, 2)
    pool.cache(CacheKey("kda", b"s"), ckpt)
    pool.free_blocks(ckpt)
    assert queue(pool) == [3, 4, 5, 1, 2]
    assert pool.get_new_blocks(4) == [3, 4, 5, 1]  # taking page 1 evicts the entry; page 2 moves to the front
    assert pool.lookup(CacheKey("kda", b"s")) is None and pool.blocks[2].cache_key is None
    assert queue(pool) == [2]
    pool.check_invariants()


def test_block_hash_chain():
    h0 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) and len(h0) == 16
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])  # parent matters
    hashes = extend_block_hashes([], list(range(11)), 4)  # 2 full blocks, 3 tokens left over
    assert hashes == [hash_block_tokens(ROOT_HASH, [0, 1, 2, 3]), hash_block_tokens(hashes[0], [4, 5, 6, 7])]
    assert extend_block_hashes(hashes, list(range(12)), 4)[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])


def test_two_stage_lookup():
    pool = BlockPool(16)
    hs = extend_block_hashes([], list(range(20)), 4)  # 5 blocks
    mla = pool.get_new_blocks(4)  # blocks 0..3 of the prompt cached
    for h, b in zip(hs, mla):
        pool.cache(CacheKey("mla", h), (b,))
    ck1 = tuple(pool.get_new_blocks(2))
    pool.cache(CacheKey("kda", hs[1]), ck1)  # a state after 8 tokens
    hit = find_longest_cache_hit(pool, hs, 20, 4, has_state=True)
    assert (hit.num_tokens, hit.mla_blocks, hit.checkpoint_blocks, hit.num_mla_matched_tokens) == (
        8,
        mla[:2],
        ck1,
        16,
    )
    ck3 = tuple(pool.get_new_blocks(2))
    pool.cache(CacheKey("kda", hs[3]), ck3)  # now a state after 16 tokens: the deepest one wins
    assert find_longest_cache_hit(pool, hs, 20, 4, True).num_tokens == 16
    # a 16-token prompt must compute its last token: the hit is capped at 15 → 3 blocks → state after 8
    assert find_longest_cache_hit(pool, hs[:4], 16, 4, True).num_tokens == 8
    assert find_longest_cache_hit(pool, hs, 20, 4, has_state=False).num_tokens == 16  # no KDA layers
    other = extend_block_hashes([], [9] + list(range(1, 20)), 4)  # first block differs: nothing matches
    assert find_longest_cache_hit(pool, other, 20, 4, True).num_tokens == 0


def tiny_manager(num_blocks=16, **kw) -> KVCacheManager:
    # page = 1 MLA layer × 4 tokens × 8 numbers = 32; state = 2·4·4 + 3·8·1 = 56 numbers → 2 pages
    layout = PageLayout(4, 1, 1, 8, (2, 4, 4, 2), torch.float32, torch.float32)
    assert (layout.page_numel, layout.state_pages) == (32, 2)
    config = CacheConfig(block_size=4, num_blocks=num_blocks, **{"checkpoint_interval": 0, **kw})
    return KVCacheManager(BlockPool(num_blocks), CacheStorage(layout, num_blocks), config)


def run_prefill(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the scheduler does around a step: allocate, (the runner writes), advance, cache."""
    kv.allocate_slots(req, n)
    kv.storage.pages[list(kv.state_slots[req.request_id])] += 1.0  # the "model" changes the running state
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    if req.num_computed_tokens in req.checkpoint_positions:
        assert kv.store_checkpoint(req)


def test_manager_hit_copy_on_write_and_free_order():
    kv = tiny_manager()
    pool = kv.pool
    a = Request("a", list(range(10)), SamplingParams(max_tokens=3))
    plan = kv.plan_admission(a)
    assert plan.hit.num_tokens == 0 and plan.num_new_blocks == 3  # ceil((13 - 1) / 4)
    kv.admit(a, plan)
    assert kv.state_slots["a"] == (1, 2) and kv.reserved["a"] == 3 and a.checkpoint_positions == {8}
    run_prefill(kv, a, 8)  # blocks 3, 4 (cached), then the checkpoint at 8 tokens on pages 5, 6
    assert kv.block_tables["a"] == [3, 4] and pool.lookup(CacheKey("kda", a.block_hashes[1])) == (5, 6)
    assert [pool.blocks[i].ref_cnt for i in (3, 4, 5, 6)] == [1, 1, 0, 0]
    assert queue(pool) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6]
    run_prefill(kv, a, 2)
    assert kv.block_tables["a"] == [3, 4, 7] and kv.reserved["a"] == 0
    ckpt_state = kv.storage.pages[[5, 6]].clone()
    kv.free(a)  # slot and the partial block 7 to the front; cached 4 then 3 to the back (tail first)
    assert queue(pool) == [1, 2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6, 4, 3]
    pool.check_invariants()

    b = Request("b", list(range(9)) + [99], SamplingParams(max_tokens=3))  # same first 9 tokens
    plan = kv.plan_admission(b)
    assert plan.hit.num_tokens == 8 and plan.hit.mla_blocks == [3, 4] and plan.hit.checkpoint_blocks == (5, 6)
    assert plan.num_pages_needed == 2 + 2 + 2  # slot + two hit blocks leaving the queue + max(1 new, 2 held)
    kv.admit(b, plan)
    assert b.num_computed_tokens == b.num_cached_tokens == 8 and kv.block_tables["b"] == [3, 4]
    assert kv.state_slots["b"] == (1, 2) and [pool.blocks[i].ref_cnt for i in (3, 4, 5, 6)] == [1, 1, 0, 0]
    assert torch.equal(kv.storage.pages[[1, 2]], ckpt_state)  # the checkpoint was copied into the slot
    run_prefill(kv, b, 2)  # writing the running state leaves the checkpoint untouched (copy-on-write)
    assert torch.equal(kv.storage.pages[[5, 6]], ckpt_state)
    assert kv.prefix_query_tokens == 20 and kv.prefix_hit_tokens == 8
    kv.free(b)
    pool.check_invariants()
    assert pool.usage == 0.0


def test_manager_admission_budget_and_checkpoint_eviction():
    kv = tiny_manager(num_blocks=12, checkpoint_interval=1)
    big = Request("big", list(range(30)), SamplingParams(max_tokens=11))  # 10 blocks + 2 state pages > 11
    with pytest.raises(ValueError, match="need 12 cache blocks"):
        kv.check_fits_pool(big)
    a = Request("a", list(range(9)), SamplingParams(max_tokens=2))  # 3 blocks + 2 state pages
    kv.admit(a, kv.plan_admission(a))
    assert a.checkpoint_positions == {4, 8}
    b = Request("b", list(range(100, 113)), SamplingParams(max_tokens=8))  # 5 blocks + 2 pages = 7
    assert kv.plan_admission(b) is None  # 11 - 2 (a's slot) - 3 (a's reservation) = 6 available
    run_prefill(kv, a, 4)  # block 3; checkpoint at 4 tokens (8 free - 2 reserved ≥ 2 pages) on pages 4, 5
    assert kv.num_checkpoints_stored == 1
    kv.free(a)
    pool = kv.pool
    # free: slot 1, 2 and nothing else uncached; cached block 3 and checkpoint pages 4, 5 at the back
    assert queue(pool) == [1, 2, 6, 7, 8, 9, 10, 11, 4, 5, 3]
    kv.admit(b, kv.plan_admission(b))  # slot takes 1, 2
    kv.allocate_slots(b, 13)  # 4 blocks: 6..9
    assert kv.block_tables["b"] == [6, 7, 8, 9] and kv.reserved["b"] == 1
    b.num_computed_tokens = 13
    kv.allocate_slots(b, 4)  # the 5th block: 10, still empty
    kv.allocate_slots(b, 0)
    assert kv.block_tables["b"] == [6, 7, 8, 9, 10]
    c = Request("c", [7, 7, 7, 7, 7], SamplingParams(max_tokens=1))
    kv.admit(
        c, kv.plan_admission(c)
    )  # its slot needs 2 pages: 11, then the LRU cached entry (pages 4, 5) goes
    assert kv.state_slots["c"] == (11, 4) and pool.num_evicted_entries == 1 and queue(pool) == [5, 3]
    pool.check_invariants()


def flat_state(storage: CacheStorage, slot: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot's state read by hand from the page layout of ``serve/cache_storage.py``: the slot's pages
    concatenated, ``[L, H, K, V]`` recurrent states first, then ``[L, 3, P, W−1]`` conv caches."""
    lo = storage.layout
    H, K, V, W = lo.kda_shape
    L = lo.num_kda_layers
    flat = storage.pages[list(slot)].reshape(-1)
    rec = flat[: L * H * K * V].view(L, H, K, V)
    return rec, flat[L * H * K * V : lo.state_numel].view(L, 3, H * K, W - 1)


def test_state_gather_units_match_the_page_layout_and_flush_on_touch():
    # 2 KDA layers of H=2, K=V=4, W=3: recurrent 32 + conv 48 numbers per layer; pages of 24 numbers, so
    # units are gcd(24, 32, 48) = 8 numbers and layer states straddle pages
    layout = PageLayout(3, 1, 2, 8, (2, 4, 4, 3), torch.float64, torch.float64)
    storage = CacheStorage(layout, 30)
    assert (layout.page_numel, layout.state_pages, storage.unit) == (24, 7, 8)
    storage.pages.copy_(torch.randn(30, 24, dtype=torch.float64))
    slots = [(9, 2, 3, 17, 5, 6, 8), (10, 11, 25, 13, 14, 15, 16)]
    batch = storage.gather_states(slots)
    for b, slot in enumerate(slots):
        rec, conv = flat_state(storage, slot)
        assert torch.equal(batch.recurrent[:, b], rec) and torch.equal(batch.conv[:, b], conv)
    assert batch.recurrent[1].is_contiguous() and batch.conv[0].is_contiguous()
    before = storage.pages.clone()
    batch.recurrent[1, 0].add_(1.0)  # the runner changes request 0's layer-1 state in place
    batch.conv[0, 1].mul_(2.0)
    assert storage.gather_states(list(slots)) is batch and torch.equal(storage.pages, before)  # checked out
    rec0, _ = flat_state(storage, slots[0])
    storage.copy_pages(slots[0], (20, 21, 22, 23, 24, 26, 27))  # reading the slot writes the batch back
    rec0_new, _ = flat_state(storage, slots[0])
    assert torch.equal(rec0_new[1], rec0[1] + 1.0) and torch.equal(rec0_new[0], rec0[0])
    assert torch.equal(flat_state(storage, (20, 21, 22, 23, 24, 26, 27))[0], rec0_new)
    _, conv1 = flat_state(storage, slots[1])
    assert torch.equal(conv1[0], 2.0 * before[list(slots[1])].reshape(-1)[64:112].view(3, 8, 2))
    untouched = [p for p in range(30) if p not in (*slots[0], *slots[1], 20, 21, 22, 23, 24, 26, 27)]
    assert torch.equal(storage.pages[untouched], before[untouched])

    batch = storage.gather_states(slots[1:])
    batch.recurrent.zero_()
    storage.release_states(slots[1])  # a finishing request's state reaches its pages before they are freed
    assert flat_state(storage, slots[1])[0].abs().max() == 0


def test_host_tier_lru_order_locks_and_exact_copies():
    kv = tiny_manager(num_blocks=8)
    storage = kv.storage
    storage.pages.copy_(torch.arange(8 * 32, dtype=torch.float32).view(8, 32))
    host = HostTier(storage, 4)
    e1, e2, e3, e4 = (CacheKey("mla", bytes([i])) for i in range(1, 5))
    assert host.save(e1, (1,)) and host.save(e2, (2, 3)) and host.save(e3, (4,))
    assert host.entries[e2] == (1, 2) and host.free_rows == []
    assert torch.equal(host.pages[1:3], storage.pages[2:4])
    host.lock([e2])
    assert host.save(e4, (5, 6))  # needs 2 rows: e1 (least recently used) and e3 go, the locked e2 stays
    assert list(host.entries) == [e2, e4] and host.entries[e4] == (3, 0)
    assert not host.save(CacheKey("kda", b"x"), (1, 2, 3, 4, 5)) and host.num_dropped == 1
    with pytest.raises(ValueError, match="locked"):
        host.discard(e2)
    host.unlock([e2])
    host.load(e4, (7, 1))
    assert torch.equal(storage.pages[7], storage.pages[5]) and torch.equal(storage.pages[1], storage.pages[6])
    host.lookup(e2)  # now most recently used: a save that needs room drops e4 first
    assert host.save(e1, (1,)) and list(host.entries) == [e2, e1]
    host.check_invariants()


def test_manager_brings_evicted_blocks_and_checkpoint_back_from_the_host_tier():
    page_mib = 32 * 4 / 2**20
    kv = tiny_manager(num_blocks=12, host_pool_mib=8 * page_mib)
    pool, host = kv.pool, kv.host
    assert host.num_pages == 8 and pool.on_evict == host.save
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1))  # 3 blocks; checkpoint at 8 on 2 pages
    kv.admit(a, kv.plan_admission(a))
    run_prefill(kv, a, 8)
    run_prefill(kv, a, 1)
    latents = kv.storage.pages[kv.block_tables["a"][:2]].clone()
    ckpt_key = CacheKey("kda", a.block_hashes[1])
    checkpoint = kv.storage.pages[list(pool.lookup(ckpt_key))].clone()
    kv.free(a)
    b = Request("b", list(range(100, 125)), SamplingParams(max_tokens=1))  # 7 blocks + a 2-page slot
    kv.admit(b, kv.plan_admission(b))  # takes the 7 empty blocks and a's checkpoint pages (evicted)
    run_prefill(kv, b, 24)  # b's checkpoint at 24 takes the last 2 pages: a's MLA blocks are evicted
    run_prefill(kv, b, 1)
    kv.free(b)
    assert pool.lookup(CacheKey("mla", a.block_hashes[0])) is None and pool.lookup(ckpt_key) is None
    assert host.lookup(CacheKey("mla", a.block_hashes[0])) is not None and host.lookup(ckpt_key) is not None
    c = Request("c", list(range(9)) + [50], SamplingParams(max_tokens=1))
    plan = kv.plan_admission(c)
    hit = plan.hit
    assert hit.num_tokens == 8 and hit.mla_blocks == [0, 0] and hit.host_checkpoint == ckpt_key
    assert sorted(hit.host_mla) == [0, 1] and plan.num_pages_needed == 2 + 2 + 1  # slot, 2 back, 1 new
    kv.admit(c, plan)
    assert c.num_cached_tokens == 8 and kv.host_hit_tokens == 8
    assert torch.equal(kv.storage.pages[kv.block_tables["c"]], latents)
    assert torch.equal(kv.storage.pages[list(kv.state_slots["c"])], checkpoint)
    assert pool.lookup(CacheKey("mla", a.block_hashes[0])) == (kv.block_tables["c"][0],)
    assert host.lookup(CacheKey("mla", a.block_hashes[0])) is None and host.lookup(ckpt_key) is not None
    kv.free(c)
    pool.check_invariants()
    host.check_invariants()


def test_host_tier_sizes_are_checked():
    with pytest.raises(ValueError, match="host_pool_mib must be"):
        CacheConfig(host_pool_mib=-1.0)
    with pytest.raises(ValueError, match="fewer than one cache entry"):
        tiny_manager(host_pool_mib=100 / 2**20)  # 0 pages of 128 B; a checkpoint needs 2
    assert tiny_manager(host_pool_mib=1.0).host.num_pages == 2**20 // 128
    assert tiny_manager(host_pool_mib=1.0, enable_prefix_caching=False).host is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned host memory)")
def test_gpu_host_tier_is_pinned_and_round_trips_exactly():
    layout = PageLayout(4, 1, 1, 8, (2, 4, 4, 2), torch.float32, torch.float32)
    storage = CacheStorage(layout, 8, device="cuda")
    storage.pages.copy_(torch.randn(8, 32, device="cuda"))
    host = HostTier(storage, 4)
    assert host.pages.is_pinned() and host.pages.device.type == "cpu"
    key = CacheKey("kda", b"k")
    before = storage.pages[[1, 2]].clone()
    assert host.save(key, (1, 2))
    storage.pages[[1, 2]] = 0.0  # the pool reuses the pages right after the (asynchronous) copy
    host.load(key, (5, 6))
    torch.cuda.synchronize()
    assert torch.equal(storage.pages[[5, 6]], before)


def test_decode_checkpoint_keeps_only_the_latest_boundary_of_the_output():
    kv = tiny_manager(num_blocks=20)
    pool = kv.pool
    a = Request("a", list(range(5)), SamplingParams(max_tokens=9))  # decode boundaries at 8 and 12
    kv.admit(a, kv.plan_admission(a))
    assert a.checkpoint_positions == {4}
    run_prefill(kv, a, 4)
    run_prefill(kv, a, 1)
    stored = []
    for token in range(8):  # each step: one generated token appended, then computed
        a.output_token_ids.append(100 + token)
        run_prefill(kv, a, 1)
        stored.append(kv.store_decode_checkpoint(a))
    assert a.num_computed_tokens == 13 and stored == [False, False, True, False, False, False, True, False]
    at_8, at_12 = (CacheKey("kda", a.block_hashes[i]) for i in (1, 2))
    assert (
        pool.lookup(at_8) is None and pool.lookup(at_12) is not None and kv.decode_checkpoints == {"a": at_12}
    )
    assert kv.num_checkpoints_stored == 3  # prompt boundary 4, then 8 (dropped), 12
    kv.free(a)
    assert kv.decode_checkpoints == {} and pool.lookup(at_12) is not None
    b = Request("b", a.all_token_ids[:12] + [7, 7], SamplingParams(max_tokens=1))  # the next turn
    assert kv.plan_admission(b).hit.num_tokens == 12
    pool.check_invariants()


def test_uncache_frees_unused_blocks_to_the_front():
    pool = BlockPool(5)
    ids = tuple(pool.get_new_blocks(2))
    key = CacheKey("kda", b"z")
    assert pool.cache(key, ids)
    pool.free_blocks(ids)
    assert queue(pool) == [3, 4, 1, 2]
    pool.uncache(key)
    assert queue(pool) == [1, 2, 3, 4] and pool.lookup(key) is None and pool.num_evicted_entries == 0
    pool.uncache(key)
    pool.check_invariants()
