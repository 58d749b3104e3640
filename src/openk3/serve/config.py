"""Typed engine configuration: the paged cache and the scheduler (one dataclass each).

Names follow vLLM (``block_size``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
``long_prefill_token_threshold``; ``docs/references.md#token-budgets``). Every ``__post_init__`` raises
``ValueError`` naming the field and how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceSizes:
    """The engine's sizes on one device kind (:data:`DEVICE_SIZES`). On a GPU a prefill step costs the host
    a fixed few tens of milliseconds of launches whatever its length, so chunks hold thousands of tokens and
    the blocks are large; on a CPU the work itself dominates and small chunks keep short requests flowing."""

    block_size: int
    pool_mib: float
    long_prefill_token_threshold: int

    def checkpoint_interval(self) -> int:
        """A KDA checkpoint every chunk's worth of blocks: closer checkpoints would cut the chunks (the
        scheduler ends a chunk at the next checkpoint)."""
        return max(1, self.long_prefill_token_threshold // self.block_size)

    def max_num_batched_tokens(self, max_num_seqs: int) -> int:
        """A step budget of two chunks (one request's last and another's first), at least one chunk beside a
        full decode batch of ``max_num_seqs``."""
        chunk = self.long_prefill_token_threshold
        return max(2 * chunk, chunk + max_num_seqs)


DEVICE_SIZES = {"cpu": DeviceSizes(16, 256.0, 256), "cuda": DeviceSizes(512, 8192.0, 16384)}
"""The engine's default sizes per device kind (:func:`engine_defaults`)."""

ENGINE_SIZE_NAMES = (
    "block_size",
    "pool_mib",
    "long_prefill_token_threshold",
    "checkpoint_interval",
    "max_num_batched_tokens",
)
"""The engine options whose default depends on the device: the fields of :class:`DeviceSizes` and its two
derived sizes."""


def engine_defaults(device: str, given: dict[str, int | float | None], max_num_seqs: int) -> dict:
    """``given`` (names of :data:`ENGINE_SIZE_NAMES`; ``None`` or absent: not given) with every missing value
    filled for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) from :data:`DEVICE_SIZES`; the derived sizes
    follow the given block size and chunk when those are given. Returns a new dict."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    out = {k: v for k, v in given.items() if v is not None}
    base = DEVICE_SIZES[kind]
    for name in ("block_size", "pool_mib", "long_prefill_token_threshold"):
        out.setdefault(name, getattr(base, name))
    sized = DeviceSizes(max(out["block_size"], 1), out["pool_mib"], out["long_prefill_token_threshold"])
    out.setdefault("checkpoint_interval", sized.checkpoint_interval())  # a bad size: refused later
    out.setdefault("max_num_batched_tokens", sized.max_num_batched_tokens(max_num_seqs))
    return out


def default_by_device(name: str, max_num_seqs: int = 64) -> str:
    """``"A on CPU, B on CUDA"``: the default of the engine size ``name`` (one of :data:`ENGINE_SIZE_NAMES`)
    on each device kind, for help texts (``max_num_seqs``: the decode batch the step budget leaves room for)."""
    return ", ".join(
        f"{engine_defaults(kind, {}, max_num_seqs)[name]:g} on {kind.upper()}" for kind in DEVICE_SIZES
    )


@dataclass
class CacheConfig:
    """The paged pool of MLA latent blocks and KDA state pages, and the prefix cache."""

    block_size: int = 16
    """Tokens per MLA latent block (also the prefix-hash unit and the KDA checkpoint grid)."""
    num_blocks: int | None = None
    """Pages in the pool, null block 0 included; ``None`` sizes the pool from ``pool_mib``."""
    pool_mib: float = 256.0
    """Pool memory in MiB when ``num_blocks`` is ``None``."""
    checkpoint_interval: int = 16
    """Keep a KDA state checkpoint every this many blocks of a prompt (0: only the last boundary before
    the prompt's end, plus branching points)."""
    enable_prefix_caching: bool = True
    host_pool_mib: float = 0.0
    """Host-memory tier in MiB (pinned on CUDA) that keeps the cache entries the pool evicts, so a later
    hit copies them back instead of recomputing them; 0: no host tier."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.host_pool_mib) and self.host_pool_mib >= 0):
            raise ValueError(
                f"host_pool_mib must be a number of MiB >= 0 (0: no host tier), got {self.host_pool_mib}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.num_blocks is None and not self.pool_mib > 0:
            raise ValueError(f"pool_mib must be > 0, got {self.pool_mib}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0 blocks, got {self.checkpoint_interval}")


@dataclass
class SchedulerConfig:
    """Per-step budgets and the admission queue."""

    max_num_batched_tokens: int = 512
    """Token budget of one engine step, shared by decodes (1 token each) and prefill chunks."""
    max_num_seqs: int = 64
    """Most requests running at once (decode batch size)."""
    max_waiting: int = 128
    """Bound of the waiting queue; a request arriving when it is full is rejected (HTTP 429)."""
    long_prefill_token_threshold: int = 256
    """Most prompt tokens one request prefills in one step, so a long prompt cannot starve short ones."""
    max_model_len: int = 8192
    """Most tokens (prompt + output) of one request."""
    queue_timeout_s: float = 60.0
    """A request still waiting after this many seconds is rejected (HTTP 429)."""

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_waiting",
            "long_prefill_token_threshold",
            "max_model_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed max_num_seqs="
                f"{self.max_num_seqs}, or a full decode batch leaves no budget for any prefill"
            )
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")


@dataclass
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    static_decode: bool | None = None
    """Run greedy one-token decode batches through the static-shape step of ``serve/decode_graph.py`` (with
    a speculative draft: greedy speculative steps through ``serve/speculative_graph.py``), captured in CUDA
    graphs on CUDA (eager elsewhere); ``None``: on CUDA only."""

    def __post_init__(self) -> None:
        if self.static_decode not in (None, True, False):
            raise ValueError(f"static_decode must be None, True or False, got {self.static_decode!r}")
