"""Prefix caching: hash-chained token blocks and the two-stage longest-hit lookup.

A full block of ``block_size`` tokens is named by ``hash(parent_hash, tokens)`` (a chain, so equal hashes
mean equal whole prefixes; vLLM automatic prefix caching). The pool indexes two kinds of entries by it
(:class:`~openk3.serve.block_pool.CacheKey`): the block's MLA latents (``"mla"``) and, at selected
boundaries, the KDA state after the block's last token (``"kda"``).

Lookup (as vLLM's ``find_longest_cache_hit``; ``docs/references.md#paged-pool-and-prefix-cache``):

1. left to right over the request's block hashes while the MLA block is cached → an upper bound;
2. right to left from that bound to the deepest boundary with a KDA checkpoint → the hit.

An entry missing from the pool counts when the host-memory tier (:mod:`openk3.serve.host_tier`) has it.

With one attention group and one state group a single pass is the fixed point. The hit is capped at
``num_tokens − 1`` tokens so the last prompt token is always computed (its logits give the first output).

Legend: ``bs`` block size.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from openk3.serve.block_pool import NULL_BLOCK_ID, BlockPool, CacheKey
from openk3.serve.host_tier import HostTier

ROOT_HASH = hashlib.blake2b(b"openk3 prefix cache root", digest_size=16).digest()
"""Parent hash of a request's first block."""


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """16-byte BLAKE2b of the parent hash and the block's token ids (int64 little-endian).

    Raises ``OverflowError`` for an id outside int64."""
    ids = array.array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(ids.tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes = ROOT_HASH
) -> list[bytes]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes`` (in place; returned).
    ``root``: the first block's parent (a request's ``hash_root``, which carries its images)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


@dataclass
class CacheHit:
    num_tokens: int = 0
    """Tokens served from the cache (a multiple of ``bs``)."""
    mla_blocks: list[int] = field(default_factory=list)
    """Pool blocks holding the latents of the hit tokens (``num_tokens // bs`` of them);
    ``NULL_BLOCK_ID`` at the positions of :attr:`host_mla` (brought back from the host tier at admission)."""
    checkpoint_blocks: tuple[int, ...] = ()
    """Pages of the KDA state at ``num_tokens`` (empty for no hit, a model without KDA layers, or a
    checkpoint on the host tier)."""
    num_mla_matched_tokens: int = 0
    """Stage-1 bound: tokens whose MLA blocks are cached (≥ ``num_tokens``)."""
    host_mla: dict[int, CacheKey] = field(default_factory=dict)
    """Position in :attr:`mla_blocks` → key of a block that is only on the host tier."""
    host_checkpoint: CacheKey | None = None
    """Key of the KDA checkpoint at ``num_tokens`` when it is only on the host tier."""


def find_longest_cache_hit(
    pool: BlockPool,
    block_hashes: Sequence[bytes],
    num_tokens: int,
    block_size: int,
    has_state: bool,
    host: HostTier | None = None,
) -> CacheHit:
    """The longest usable prefix of a request with ``num_tokens`` prompt tokens and these block hashes.

    ``has_state``: the model has KDA layers, so a hit needs a KDA checkpoint at its end boundary.
    ``host``: entries missing from the pool may be found on this host-memory tier (both stages look in the
    pool first, then there).
    """
    max_blocks = min(len(block_hashes), (num_tokens - 1) // block_size)
    mla: list[int] = []
    host_mla: dict[int, CacheKey] = {}
    for i in range(max_blocks):
        key = CacheKey("mla", block_hashes[i])
        ids = pool.lookup(key)
        if ids is not None:
            mla.append(ids[0])
        elif host is not None and host.lookup(key) is not None:
            host_mla[i] = key
            mla.append(NULL_BLOCK_ID)
        else:
            break
    matched = len(mla)
    if not has_state:
        return CacheHit(matched * block_size, mla, (), matched * block_size, host_mla)
    for n in range(matched, 0, -1):
        key = CacheKey("kda", block_hashes[n - 1])
        state = pool.lookup(key)
        on_host = state is None and host is not None and host.lookup(key) is not None
        if state is not None or on_host:
            return CacheHit(
                n * block_size,
                mla[:n],
                state or (),
                matched * block_size,
                {i: k for i, k in host_mla.items() if i < n},
                key if on_host else None,
            )
    return CacheHit(0, [], (), matched * block_size)
