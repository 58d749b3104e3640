"""Token ↔ chunk layouts: pad every sequence to whole chunks so chunks never straddle two sequences.

The chunked op works on a flat list of ``P`` chunks of ``C`` tokens. Each sequence (a batch row, or a
document of a packed ``cu_seqlens`` row) is split into ``ceil(len / C)`` chunks, the last one padded with
*identity tokens*: zeros for q, k, v, g and beta. An identity token leaves the state unchanged (decay
``e^0 = 1``, update ``β k = 0``), so a padded chunk ends in the same state as its real tokens.

The inter-chunk recurrence runs over a grid of ``M`` chunk slots × ``N`` sequences (``M`` = most chunks of
any sequence); slots past a sequence's end hold an identity fill, so its state passes through unchanged.

Legend: ``B`` batch, ``T`` tokens per row, ``N`` sequences, ``P`` chunks (flat list), ``C`` chunk length,
``M`` chunk slots per sequence, ``*`` trailing dims carried along (heads, channels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class ChunkLayout:
    """Where each token and each chunk goes; built once per call from ``B, T`` and the document lengths."""

    def __init__(self, B: int, T: int, seq_lens: tuple[int, ...] | None, chunk_size: int, device) -> None:
        self.B, self.T, self.C = B, T, chunk_size
        self.varlen = seq_lens is not None
        lengths = seq_lens if self.varlen else (T,) * B
        chunks_per_seq = [math.ceil(n / chunk_size) for n in lengths]
        self.N = len(chunks_per_seq)
        self.M = max(chunks_per_seq)
        self.P = sum(chunks_per_seq)
        if self.varlen:
            self._build_varlen_index(seq_lens, chunks_per_seq, device)

    def _build_varlen_index(self, seq_lens, chunks_per_seq, device) -> None:
        C, T = self.C, self.T
        token_of_slot = torch.full((self.P * C,), T, dtype=torch.long)  # T → the appended zero row
        slot_of_token = torch.empty(T, dtype=torch.long)
        chunk_of_cell = torch.full((self.M, self.N), self.P, dtype=torch.long)  # P → the appended fill
        start, first_chunk = 0, 0
        for n, (length, count) in enumerate(zip(seq_lens, chunks_per_seq, strict=True)):
            slots = torch.arange(first_chunk * C, first_chunk * C + length)
            token_of_slot[slots] = torch.arange(start, start + length)
            slot_of_token[start : start + length] = slots
            chunk_of_cell[:count, n] = torch.arange(first_chunk, first_chunk + count)
            start, first_chunk = start + length, first_chunk + count
        cell_of_chunk = torch.empty(self.P, dtype=torch.long)
        valid = chunk_of_cell.flatten() < self.P
        cell_of_chunk[chunk_of_cell.flatten()[valid]] = torch.arange(self.M * self.N)[valid]
        self._token_of_slot = token_of_slot.to(device)
        self._slot_of_token = slot_of_token.to(device)
        self._chunk_of_cell = chunk_of_cell.flatten().to(device)
        self._cell_of_chunk = cell_of_chunk.to(device)

    def to_chunks(self, x_BT: torch.Tensor) -> torch.Tensor:
        """``[B, T, *]`` → ``[P, C, *]``, identity (zero) tokens after each sequence's end."""
        rest = x_BT.shape[2:]
        if self.varlen:
            x_T = torch.cat([x_BT[0], x_BT.new_zeros(1, *rest)])
            return x_T.index_select(0, self._token_of_slot).view(self.P, self.C, *rest)
        pad = self.M * self.C - self.T
        x_BT = F.pad(x_BT, (0, 0) * len(rest) + (0, pad)) if pad else x_BT
        return x_BT.reshape(self.P, self.C, *rest)

    def from_chunks(self, x_PC: torch.Tensor) -> torch.Tensor:
        """``[P, C, *]`` → ``[B, T, *]``, dropping the padding."""
        rest = x_PC.shape[2:]
        if self.varlen:
            return x_PC.reshape(self.P * self.C, *rest).index_select(0, self._slot_of_token).unsqueeze(0)
        return x_PC.reshape(self.B, self.M * self.C, *rest)[:, : self.T]

    def to_grid(self, x_P: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """``[P, *]`` → ``[M, N, *]`` (slot-major: each slot contiguous); empty cells get ``fill`` ``[*]``."""
        rest = x_P.shape[1:]
        if self.varlen:
            x_P = torch.cat([x_P, fill.expand(1, *rest)])
            return x_P.index_select(0, self._chunk_of_cell).view(self.M, self.N, *rest)
        return x_P.reshape(self.N, self.M, *rest).transpose(0, 1).contiguous()

    def from_grid(self, x_MN: torch.Tensor) -> torch.Tensor:
        """``[M, N, *]`` → ``[P, *]``, dropping the empty cells."""
        rest = x_MN.shape[2:]
        if self.varlen:
            return x_MN.reshape(self.M * self.N, *rest).index_select(0, self._cell_of_chunk)
        return x_MN.transpose(0, 1).reshape(self.P, *rest)
