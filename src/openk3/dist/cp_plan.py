"""Context-parallel plan: which tokens of one packed sequence each rank holds, and what it needs from others.

The global stream (one row of ``T`` tokens, documents given by ``cu_seqlens``) is cut into equal
*fragments*; rank ``r`` of ``W`` holds (``docs/references.md#kda-context-parallel``):

* ``contiguous``: fragment ``r`` of ``W`` (``T/W`` tokens each);
* ``zigzag``: fragments ``r`` and ``2W−1−r`` of ``2W`` (``T/(2W)`` tokens each), which balances causal
  attention's work.

A rank's local row is its fragments in that order. Each fragment is cut at document boundaries into *pieces*
(the local ``cu_seqlens`` of the KDA op; empty documents give no piece). Only a fragment's first piece can
continue a document from earlier fragments and only its last piece can continue into later ones, so every
fragment has one *slot*: the summary of its last piece (needed when that document goes on past the
fragment), and one *chain*: the slots, in stream order, of the fragments between its first piece's document
start and the fragment's start (folded from zero they give that piece's entry state). Slots are numbered
``rank·S + i`` (``S`` fragments per rank), the order of the all-gather.

Everything here is host-side integers, the same on every rank, computed once per plan (a plan is built per
sequence); every check raises before any collective.

Legend: ``T`` global tokens, ``W`` ranks (the CP degree), ``S`` fragments per rank, ``L`` local tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property

import torch

LAYOUTS = ("contiguous", "zigzag")
"""Fragment layouts; ``zigzag`` gives rank ``r`` the intervals ``r`` and ``2W−1−r`` of ``2W``."""


@dataclass(frozen=True)
class ContextParallelPlan:
    """The plan of one rank for one packed sequence.

    Attributes:
        cu_seqlens: global document offsets ``(0, …, T)`` (non-decreasing; empty documents allowed).
        world: the CP degree ``W``.
        rank: this rank's index in the CP group.
        layout: one of :data:`LAYOUTS`.

    Raises ``ValueError`` naming the numbers when ``cu_seqlens`` is not a rise from 0 to ``T``, ``world`` or
    ``rank`` is out of range, the layout is unknown, or ``T`` is not divisible by ``W`` (``2W`` for zig-zag).
    """

    cu_seqlens: tuple[int, ...]
    world: int
    rank: int
    layout: str = "contiguous"
    fragments: tuple[tuple[tuple[int, int], ...], ...] = field(init=False, repr=False)
    """Per rank, its fragments' global ``(start, end)`` in local order."""

    def __post_init__(self) -> None:
        cu = tuple(int(c) for c in self.cu_seqlens)
        object.__setattr__(self, "cu_seqlens", cu)
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
            raise ValueError(f"cu_seqlens must rise from 0 to T with at least one document; got {list(cu)}")
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world={self.world!r} (the CP degree) must be a positive integer")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank={self.rank} is outside the CP group of {self.world} ranks")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")
        T, W = cu[-1], self.world
        parts = W if self.layout == "contiguous" else 2 * W
        if T == 0 or T % parts:
            raise ValueError(
                f"sequence length T={T} cannot be split by the {self.layout} layout over {W} CP ranks: "
                f"T must be a positive multiple of {parts}"
            )
        n = T // parts
        bounds = [(i * n, (i + 1) * n) for i in range(parts)]
        if self.layout == "contiguous":
            frags = tuple((bounds[r],) for r in range(W))
        else:
            frags = tuple((bounds[r], bounds[parts - 1 - r]) for r in range(W))
        object.__setattr__(self, "fragments", frags)

    # ------------------------------------------------------------------------------------------ geometry
    @property
    def total(self) -> int:
        """``T``, the global token count."""
        return self.cu_seqlens[-1]

    @property
    def slots_per_rank(self) -> int:
        """``S``: fragments (summary slots) per rank."""
        return len(self.fragments[0])

    @property
    def local_len(self) -> int:
        """``L``: tokens held by each rank."""
        return sum(e - s for s, e in self.fragments[0])

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """int64 ``[L]``: the global position of each local token of ``rank`` (default: this rank)."""
        frags = self.fragments[self.rank if rank is None else rank]
        return torch.cat([torch.arange(s, e) for s, e in frags])

    def shard(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens ``[B, L, *]`` of a global ``[B, T, *]`` tensor (any device)."""
        return x_BT.index_select(1, self.positions().to(x_BT.device))

    def document_of(self, position: int) -> int:
        """Index of the (non-empty) document holding global token ``position``."""
        return bisect.bisect_right(self.cu_seqlens, position) - 1

    def _slot_of(self, position: int) -> int:
        """Global slot index of the fragment holding ``position`` (arithmetic: fragments are equal)."""
        W = self.world
        interval = position // (self.total // (W * self.slots_per_rank))
        if self.layout == "contiguous":
            return interval
        return 2 * interval if interval < W else 2 * (2 * W - 1 - interval) + 1

    def slot_range(self, slot: int) -> tuple[int, int]:
        """Global ``(start, end)`` of a slot's fragment."""
        return self.fragments[slot // self.slots_per_rank][slot % self.slots_per_rank]

    # -------------------------------------------------------------------------------------------- pieces
    @cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        """int64 ``[N_local + 1]``: this rank's pieces (fragments cut at document boundaries) in local order."""
        cu, offset = [0], 0
        for s, e in self.fragments[self.rank]:
            for b in [*self._inner_boundaries(s, e), e]:
                cu.append(offset + b - s)
            offset += e - s
        return torch.tensor(cu, dtype=torch.int64)

    @cached_property
    def fragment_pieces(self) -> list[tuple[int, int]]:
        """For each local fragment: the index of its first and of its last piece in :attr:`local_cu_seqlens`."""
        out, first = [], 0
        for s, e in self.fragments[self.rank]:
            count = 1 + len(self._inner_boundaries(s, e))
            out.append((first, first + count - 1))
            first += count
        return out

    def _inner_boundaries(self, start: int, end: int) -> list[int]:
        """Document boundaries strictly inside ``(start, end)``, each once (empty documents add none)."""
        return sorted({c for c in self.cu_seqlens if start < c < end})

    # ----------------------------------------------------------------------------- summaries and chains
    def chain(self, slot: int) -> list[int]:
        """The slots whose summaries, folded from zero in this order, give the entry state of ``slot``'s
        first piece (empty when that piece starts its document)."""
        start, _ = self.slot_range(slot)
        doc_start = self.cu_seqlens[self.document_of(start)]
        chain, p = [], doc_start
        while p < start:
            s = self._slot_of(p)
            chain.append(s)
            p = self.slot_range(s)[1]
        return chain

    @cached_property
    def needed_slots(self) -> set[int]:
        """Slots that some rank's chain reads (whose summary must be computed)."""
        W, S = self.world, self.slots_per_rank
        return {s for slot in range(W * S) for s in self.chain(slot)}

    def local_slots(self) -> list[int]:
        """Global slot indices of this rank's fragments, in local order."""
        S = self.slots_per_rank
        return [self.rank * S + i for i in range(S)]

    # ------------------------------------------------------------------------------------------ conv halo
    def halo_sources(self, width: int) -> list[list[tuple[int, int] | None]]:
        """For each local fragment, the ``width`` tokens before its start: ``(slot, tail row)`` in the gathered
        fragment tails (row ``j`` of a slot's tail is token ``end − width + j``), or None where the token is
        before the stream or in an earlier document (the convolution never reads it)."""
        out = []
        for s, _ in self.fragments[self.rank]:
            doc_start = self.cu_seqlens[self.document_of(s)]
            rows = []
            for p in range(s - width, s):
                if p < doc_start:
                    rows.append(None)
                    continue
                slot = self._slot_of(p)
                rows.append((slot, p - (self.slot_range(slot)[1] - width)))
            out.append(rows)
        return out
