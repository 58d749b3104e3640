"""Chunk tables for the Triton chunk kernels: which sequence and which chunk each program works on.

Every call is treated as packed sequences in one flat token axis: ``B`` rows of ``T`` tokens are the
``N = B`` sequences ``[b·T, (b+1)·T)``; a ``cu_seqlens`` row is used as given. Chunks of ``BT`` tokens never
straddle two sequences (fla ``prepare_chunk_indices``, docs/references.md#kda-op-arguments).

Legend: ``N`` sequences, ``P`` chunks over all sequences.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
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


FIXED_LENGTH_CACHE: OrderedDict[tuple, ChunkIndex] = OrderedDict()
"""The last :data:`FIXED_LENGTH_CACHE_SIZE` fixed-length indexes, by ``(B, T, device, size)``: a model calls
the op with the same shape in every layer, and building one costs six small launches (about 0.1 ms of host
time before the first kernel of a call, measured on the H200). The kernels only read them."""
FIXED_LENGTH_CACHE_SIZE = 32
_CACHE_LOCK = threading.Lock()


def fixed_length_index(B: int, T: int, device: torch.device, size: int = CHUNK) -> ChunkIndex:
    """``B`` sequences of ``T`` tokens in chunks of ``size`` tokens (no host↔device sync; reused from
    :data:`FIXED_LENGTH_CACHE` when built before). During CUDA-graph capture a fresh index is built and not
    kept: its tables are filled only when the graph replays."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _build_fixed_length_index(B, T, device, size)
    key = (B, T, device, size)
    with _CACHE_LOCK:
        index = FIXED_LENGTH_CACHE.get(key)
        if index is None:
            index = FIXED_LENGTH_CACHE[key] = _build_fixed_length_index(B, T, device, size)
            while len(FIXED_LENGTH_CACHE) > FIXED_LENGTH_CACHE_SIZE:
                FIXED_LENGTH_CACHE.popitem(last=False)
        FIXED_LENGTH_CACHE.move_to_end(key)
    return index


def _build_fixed_length_index(B: int, T: int, device: torch.device, size: int) -> ChunkIndex:
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
