"""Chunk tables for the Triton chunk kernels: which sequence and which chunk each program works on.

Every call is treated as packed sequences in one flat token axis: ``B`` rows of ``T`` tokens are the
``N = B`` sequences ``[b·T, (b+1)·T)``; a ``cu_seqlens`` row is used as given. Chunks of ``BT`` tokens never
straddle two sequences (fla ``prepare_chunk_indices``, docs/references.md#kda-op-arguments).

Legend: ``N`` sequences, ``P`` chunks over all sequences.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

CHUNK = 64
"""Tokens per chunk ``BT`` of the Triton path (fla's default ``chunk_size``)."""


@dataclass(frozen=True)
class ChunkIndex:
    """Sequence offsets and chunk tables on the device, plus their sizes on the host."""

    cu_seqlens: torch.Tensor
    """int64 ``[N+1]`` token offsets of the sequences in the flat token axis."""
    chunk_table: torch.Tensor
    """int32 ``[P, 2]``: (sequence, chunk within the sequence) of every chunk, sequence-major."""
    chunk_offsets: torch.Tensor
    """int32 ``[N+1]``: index of each sequence's first chunk in the ``P`` chunks."""
    num_seqs: int
    num_chunks: int
    num_tokens: int


def fixed_length_index(B: int, T: int, device: torch.device, size: int = CHUNK) -> ChunkIndex:
    """``B`` sequences of ``T`` tokens in chunks of ``size`` tokens (no host↔device sync). The last 32 built
    are reused (a model calls the op with the same shape in every layer, and building one costs six small
    launches); during CUDA-graph capture a fresh index is built and not kept, since its tables are filled only
    when the graph replays. The kernels only read them."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _build_fixed_length_index(B, T, device, size)
    return _cached_fixed_length_index(B, T, device, size)


def _build_fixed_length_index(B: int, T: int, device: torch.device, size: int) -> ChunkIndex:
    """The index of :func:`fixed_length_index`, built afresh."""
    nt = math.ceil(T / size)
    ids = torch.arange(B * nt, device=device, dtype=torch.int32)
    table = torch.stack([ids // nt, ids % nt], dim=1).contiguous()
    return ChunkIndex(
        cu_seqlens=torch.arange(0, B * T + 1, T, device=device, dtype=torch.int64),
        chunk_table=table,
        chunk_offsets=torch.arange(0, B * nt + 1, nt, device=device, dtype=torch.int32),
        num_seqs=B,
        num_chunks=B * nt,
        num_tokens=B * T,
    )


_cached_fixed_length_index = functools.lru_cache(maxsize=32)(_build_fixed_length_index)


def varlen_index(cu_seqlens: torch.Tensor, seq_lens: tuple[int, ...], size: int = CHUNK) -> ChunkIndex:
    """Packed documents of the given lengths (``seq_lens`` already on the host, from validation), in chunks of
    ``size`` tokens."""
    counts = [math.ceil(n / size) for n in seq_lens]
    table = [(n, c) for n, count in enumerate(counts) for c in range(count)]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    device = cu_seqlens.device
    return ChunkIndex(
        cu_seqlens=cu_seqlens.to(torch.int64).contiguous(),
        chunk_table=torch.tensor(table or [(0, 0)], dtype=torch.int32).to(device)[: len(table)],
        chunk_offsets=torch.tensor(offsets, dtype=torch.int32).to(device),
        num_seqs=len(seq_lens),
        num_chunks=len(table),
        num_tokens=sum(seq_lens),
    )
