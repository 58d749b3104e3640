"""Helpers for packed sequences (``cu_seqlens``, the FlashAttention convention).

``cu_seqlens`` is an int64 tensor ``[N+1]`` of document boundaries into a packed batch of one row
(``B = 1``, ``T = cu_seqlens[-1]``): document ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n+1]``.
"""

from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is a valid int64 ``[N+1]`` boundary list for ``[1, T]``."""
    if cu_seqlens.dtype not in (torch.int64, torch.int32) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be an int64 tensor [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {batch}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != seq_len or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T={seq_len}, got {cu_seqlens.tolist()}")


def document_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document index of every packed token: int64 ``[T]``."""
    positions = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)


def document_starts(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Start offset of each token's document: int64 ``[T]``."""
    return cu_seqlens.to(torch.int64)[document_ids(cu_seqlens, seq_len)]
