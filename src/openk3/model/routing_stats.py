"""Routing statistics an MoE block keeps about its own routing, for load balancing.

A :class:`~openk3.model.moe.SparseMoeBlock` that tracks its routing (``block.track_routing(bins)``) adds, at
every forward in training mode, what the routing decided to two integer buffers of its own:

* ``expert_counts_E``: tokens routed to each expert (its load);
* ``margin_hist_EB``: per expert ``j``, a histogram of the **required bias** ``r_ij = α_i − s_ij`` over the
  tokens ``i``, where ``α_i`` is token ``i``'s biased ``(k+1)``-th score (the cutoff it must beat) and
  ``s_ij`` its unbiased score for expert ``j``. Expert ``j`` would take token ``i`` exactly when
  ``b_j > r_ij``, so the histogram's ``k/E`` quantile is the bias that gives expert ``j`` its target load
  (Quantile Balancing, :mod:`openk3.train.balance`).

Histogram range: scores lie in ``[0, 1]`` and ``α_i = s_ij* + b_j*`` for a chosen expert ``j*``, so
``r_ij ∈ [lo, hi] = [min(b) − 1, max(b) + 1]`` for the bias ``b`` of the forward passes. The range is fixed
from the bias at the first counted forward after a reset; with ``B`` bins of width ``w = (hi − lo)/B``, value
``r`` goes to bin ``clamp(⌊(r − lo)/w⌋, 0, B − 1)``.

The statistics are sums over tokens, so the copies of several data-parallel ranks combine by an
``all_reduce(SUM)`` of ``expert_counts_E`` and ``margin_hist_EB`` (the range is the same on every rank: it
comes from the replicated bias). Sources: ``docs/references.md#quantile-balancing``.

Legend: ``N`` tokens, ``E`` experts, ``B`` histogram bins, ``k`` experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COUNT_DTYPE = torch.int32
"""Counts are int32: exact up to 2^31 − 1 tokens per expert and bin per step, all ranks summed."""


@dataclass(frozen=True)
class RoutingStats:
    """Views (not copies) of one MoE block's routing statistics since its last reset.

    Attributes:
        expert_counts_E: int32 ``[E]``, tokens routed to each expert.
        margin_hist_EB: int32 ``[E, B]``, histogram of the required biases ``r_ij`` (module docstring), or
            ``None`` when the block tracks loads only (``bins = 0``) or every expert is chosen (``k ≥ E``).
        margin_lo, margin_width: fp64 0-dim, the histogram's lower edge and bin width (meaningful once a
            forward was counted since the reset, see ``range_fixed``); ``None`` without a histogram.
        range_fixed: whether a counted forward fixed the range since the last reset.
        top_k: experts per token ``k``.
    """

    expert_counts_E: torch.Tensor
    margin_hist_EB: torch.Tensor | None
    margin_lo: torch.Tensor | None
    margin_width: torch.Tensor | None
    range_fixed: bool
    top_k: int


def histogram_range(bias_E: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo = min(b) − 1`` and bin width ``w = (max(b) − min(b) + 2) / bins`` over the last dim, fp64.

    ``bias_E``: ``[..., E]`` (one layer, or ``[L, E]`` stacked layers); returns two fp64 tensors ``[...]``.
    """
    b = bias_E.detach().to(torch.float64)
    lo = b.amin(-1) - 1.0
    return lo, (b.amax(-1) + 1.0 - lo) / bins


def accumulate_histogram_(
    hist_EB: torch.Tensor, r_NE: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, valid_N: torch.Tensor
) -> None:
    """Add each valid token's ``r_ij`` to bin ``clamp(⌊(r_ij − lo)/w⌋, 0, B−1)`` of ``hist_EB[j]``, in place.

    ``hist_EB``: contiguous int32 ``[..., E, B]``; ``r_NE``: float ``[..., N, E]``; ``lo``, ``width``: fp64
    ``[...]`` (one per leading index, e.g. per layer); ``valid_N``: int32 ``[N]`` of 0/1 (the count each
    token adds). Leading dims batch several layers into one scatter. Binning runs in ``r_NE``'s dtype;
    no host sync. A NaN score lands in bin 0 and ±inf in the end bins (the trainer stops on a non-finite
    loss before the statistics are used; this only keeps the index in range).
    """
    E, B = hist_EB.shape[-2:]
    lo_11 = lo.to(r_NE.dtype)[..., None, None]
    width_11 = width.to(r_NE.dtype)[..., None, None]
    bin_NE = ((r_NE - lo_11) / width_11).floor_().nan_to_num_(nan=0.0).clamp_(0, B - 1).to(torch.int64)
    row_1E = torch.arange(hist_EB.numel() // B, device=bin_NE.device).view(*hist_EB.shape[:-2], 1, E)
    flat_NE = bin_NE + row_1E * B  # index of (leading, expert, bin) in the flat histogram
    counts_NE = valid_N[:, None].expand(flat_NE.shape)
    hist_EB.view(-1).scatter_add_(0, flat_NE.reshape(-1), counts_NE.reshape(-1))
