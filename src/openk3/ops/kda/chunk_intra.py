"""Intra-chunk matrices of the chunked KDA form, with no ``exp`` that can overflow into a gradient.

For one chunk of ``C`` tokens with inclusive gate cumsum ``Γ_i = Σ_{t≤i} g_t`` (vector over K),
kda_kernels reference §1.5 needs::

    Aqk_ij = Σ_d q_id k_jd e^{Γ_id − Γ_jd}          i ≥ j   (q already carries the scale)
    Lkk_ij = Σ_d k_id k_jd e^{Γ_id − Γ_jd}          i > j   (L = Diag(β) Lkk)

``e^{Γ_i − Γ_j} ≤ 1`` for ``i ≥ j`` since every ``g ≤ 0``, but the factorised ``(q e^{Γ})(k e^{−Γ})ᵀ`` of
fla's naive chunk form overflows (``e^{−Γ}`` is ``e^{+large}``) and its gradient turns inf·0 into NaN
(§1.8). Here the chunk is cut into ``S`` sub-chunks of ``R = 16`` rows (fla's ``BC``), giving ``S × S``
blocks; the rows of sub-chunk ``s`` are anchored at ``c_s = a_s + o``, where ``a_s`` is ``Γ`` at the last
row of sub-chunk ``s − 1`` and ``o = −λ/2`` a constant (``λ`` = :data:`FACTORISED_SPAN_LIMIT`, 80 nats in
fp32), so ``e^{Γ_i − Γ_j} = e^{Γ_i − c_s} · e^{c_s − Γ_j}`` with a row factor ``≤ e^{λ/2}``:

* blocks ``(s, u)`` with ``u < s``: the column factor ``e^{c_s − Γ_j}`` is ≤ 1 (§1.5 step 3b, the anchor
  at the row sub-chunk's start);
* diagonal ``R × R`` blocks: the column factor ``e^{c_s − Γ_j}`` stays within ``e^{±λ/2}`` while the gates
  of the sub-chunk up to row ``j`` sum to at least ``−λ`` in every channel (always for K3's ``lb = −5``
  gate: 16 rows of at most 5 nats; fla's ``safe_gate`` with a shifted row-0 anchor, §1.7). A wider column
  (the unbounded Kimi-Linear gate can give any) takes, for its entries, the sum of exactly the gates each
  pair spans, set to −inf on and above the diagonal *before* ``exp`` (fla's token-parallel path, §1.5
  step 3a).

**Causal, bit for bit**: the anchor is a constant and a column's form depends on its own and earlier gates
only, so row ``i`` of every matrix (and, through it, every output and gradient before a position ``t``)
is the same bits whatever the tokens at or after ``t`` hold; anchoring at a later row would let rounding
carry future gates into past outputs (the leak 0.6.0 of fla mended, §1.7).

Entries above the diagonal (possibly inf in a factorised block) are dropped by a select, never multiplied by
0; the diagonal ``i = j`` is the exact ``q_i·k_i``.

The exponents are sums of exactly the gates they span (prefix, suffix and between-sub-chunk sums, see
:func:`gate_sums`; the pairwise exponents), never differences of long cumsums. So with a strong decay
(``Γ`` large, the true ``dg`` tiny) the gradient of ``g`` is not swamped by the rounding of ``x − x``
cancellations, and a sum that overflows to −inf (log-decays of −1e38) gives a factor 0, never ``inf − inf``
or ``0·inf``. All plain torch: autograd gives the gradients, finite for any finite gate ≤ 0.

Legend: ``P`` chunks, ``H`` heads, ``C`` chunk length, ``K`` key dim, ``S``/``U`` row/column sub-chunk,
``R`` rows per sub-chunk (``C = S·R``), ``W`` a sub-chunk in between, ``X`` the ``P·H·S`` diagonal blocks
flattened, ``Y`` the wide ones (taken pairwise), ``I``/``J`` row/column token of a block, ``2`` the (q, k)
stack.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

SUB_CHUNK = 16
"""Rows per sub-chunk ``R`` (fla's ``BC``)."""
FACTORISED_SPAN_LIMIT = {torch.float32: 80.0, torch.float64: 1000.0}
"""``λ``: the largest ``−Σ g`` (nats, one channel, from a sub-chunk's first row to column ``j``'s row) for
which column ``j`` of a diagonal block is factorised; the factors stay within ``e^{±λ/2}`` (fp32 overflows
past ``e^{88.7}``, fp64 past ``e^{709}``)."""


class GateSums(NamedTuple):
    """Sums of the log-decay over the spans the chunk form needs; all ≤ 0 (−inf where they overflow)."""

    step: torch.Tensor
    """``[P, H, S, R, K]``: the log-decay ``g`` itself, by sub-chunk."""
    local: torch.Tensor
    """``[P, H, S, R, K]``: ``Σ g`` from the sub-chunk start to row ``i`` (inclusive)."""
    local_suffix: torch.Tensor
    """``[P, H, S, R, K]``: ``Σ g`` after row ``i`` to the sub-chunk end."""
    between: torch.Tensor
    """``[P, H, S, U, K]``: ``Σ g`` over the whole sub-chunks strictly between ``u`` and ``s`` (0 unless
    ``u + 1 < s``)."""
    prefix: torch.Tensor
    """``[P, H, C, K]``: ``Γ_i``, from the chunk start to row ``i`` (inclusive)."""
    suffix: torch.Tensor
    """``[P, H, C, K]``: ``Γ_C − Γ_i``, after row ``i`` to the chunk end."""


def gate_sums(g_PHCK: torch.Tensor, sub_chunk: int = SUB_CHUNK) -> GateSums:
    """Prefix/suffix/between sums of ``g_PHCK`` (``C`` a multiple of ``sub_chunk``), without subtractions."""
    P, H, C, K = g_PHCK.shape
    S, R = C // sub_chunk, sub_chunk
    g_PHSRK = g_PHCK.view(P, H, S, R, K)
    local_PHSRK = g_PHSRK.cumsum(dim=-2)
    local_suffix_PHSRK = _exclusive_reverse_cumsum(g_PHSRK, dim=-2)
    total_PHWK = local_PHSRK[..., -1, :]
    before_PHSK = F.pad(total_PHWK.cumsum(dim=-2)[..., :-1, :], (0, 0, 1, 0))
    after_PHSK = _exclusive_reverse_cumsum(total_PHWK, dim=-2)
    return GateSums(
        step=g_PHSRK,
        local=local_PHSRK,
        local_suffix=local_suffix_PHSRK,
        between=_between(total_PHWK),
        prefix=(local_PHSRK + before_PHSK.unsqueeze(-2)).view(P, H, C, K),
        suffix=(local_suffix_PHSRK + after_PHSK.unsqueeze(-2)).view(P, H, C, K),
    )


def intra_chunk_matrices(
    q_PHCK: torch.Tensor, k_PHCK: torch.Tensor, sums: GateSums
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``Aqk`` (lower, diagonal included) and ``Lkk`` (strictly lower, still without ``β_i``).

    Every row sub-chunk ``s`` is anchored at ``c_s = a_s + o`` with the constant ``o = −λ/2`` (``λ`` =
    :data:`FACTORISED_SPAN_LIMIT` of the dtype): row factor ``e^{local_i − o}`` (≤ ``e^{λ/2}``) serves both of
    its matmuls:

    * against the earlier sub-chunks ``u < s``, column factor ``e^{o + between(s,u)} · e^{suffix_j}``: two
      factors ≤ 1, so the ``[S, C, K]`` column tensor costs one multiply. The same product is finite (and
      unused) for ``u ≥ s``;
    * against its own sub-chunk, column factor ``e^{o − local_j}``, within ``e^{±λ/2}`` unless
      ``−local_j > λ`` in some channel (a *wide* column; never for K3's ``lb = −5`` gate, ``16·5 = 80``
      nats at most); the entries of a wide column take the sum of exactly the gates they span instead
      (:func:`_diagonal_pairwise`).

    Nothing here reads a row after ``i`` to form row ``i``: neither the anchor (a constant) nor the choice of
    a column's form (its own gates), so changing later tokens changes no bit of earlier entries.

    Args:
        q_PHCK: scaled queries. k_PHCK: keys. Same dtype (fp32/fp64) as the gate sums.
        sums: :func:`gate_sums` of the chunk's log-decay.

    Returns:
        ``(Aqk_PHCC, Lkk_PHCC)``.
    """
    P, H, C, K = q_PHCK.shape
    S, R = sums.local.shape[2:4]
    shift = -0.5 * FACTORISED_SPAN_LIMIT[q_PHCK.dtype]
    q_PHSRK, k_PHSRK = q_PHCK.view(P, H, S, R, K), k_PHCK.view(P, H, S, R, K)
    row_PHSRK = (sums.local - shift).exp()
    qk_PHS2RK = torch.stack([q_PHSRK * row_PHSRK, k_PHSRK * row_PHSRK], dim=-3)

    A_PHS2RC = _earlier_blocks(qk_PHS2RK, k_PHSRK, sums, shift)
    own_PHS2RR = _own_blocks(qk_PHS2RK, q_PHSRK, k_PHSRK, sums, shift)
    A_PHS2RSR = A_PHS2RC.view(P, H, S, 2, R, S, R)
    A_PHS2RSR = torch.diagonal_scatter(A_PHS2RSR, own_PHS2RR.permute(0, 1, 3, 4, 5, 2), dim1=2, dim2=5)
    A_2PHCC = A_PHS2RSR.permute(3, 0, 1, 2, 4, 5, 6).reshape(2, P, H, C, C)
    strict_CC = torch.ones(C, C, dtype=torch.bool, device=q_PHCK.device).tril(-1)
    # a select, not a product with a 0/1 mask: the dropped entries may be inf
    Aqk_PHCC, Lkk_PHCC = torch.where(strict_CC, A_2PHCC, 0.0).unbind(0)
    return Aqk_PHCC + torch.diag_embed((q_PHCK * k_PHCK).sum(dim=-1)), Lkk_PHCC


def _earlier_blocks(qk_PHS2RK, k_PHSRK, sums: GateSums, shift: float):
    """Row sub-chunk ``s`` against every column: ``[P, H, S, 2, R, C]``, valid for columns before ``s``."""
    P, H, S, R, K = k_PHSRK.shape
    decay_PHSU1K = (sums.between + shift).exp().unsqueeze(-2)
    keys_PH1URK = (k_PHSRK * sums.local_suffix.exp()).unsqueeze(2)
    col_PHSCK = (keys_PH1URK * decay_PHSU1K).view(P, H, S, S * R, K)
    return (qk_PHS2RK.view(P, H, S, 2 * R, K) @ col_PHSCK.transpose(-1, -2)).view(P, H, S, 2, R, S * R)


def _own_blocks(qk_PHS2RK, q_PHSRK, k_PHSRK, sums: GateSums, shift: float):
    """The ``R × R`` diagonal blocks ``[P, H, S, 2, R, R]``; only their strictly-lower part is used.

    A column ``j`` with ``o − local_j ≤ −o`` in every channel: ``e^{local_i − o} · e^{o − local_j}``. A wide
    one gets a finite placeholder (column exponent 0) in the product, then its entries are replaced by
    :func:`_diagonal_pairwise`'s (computed for the blocks that have a wide column).
    """
    P, H, S, R, K = k_PHSRK.shape
    exponent_PHSRK = shift - sums.local
    wide_PHSR = (exponent_PHSRK > -shift).any(dim=-1)
    exponent_PHSRK = torch.where(wide_PHSR.unsqueeze(-1), 0.0, exponent_PHSRK)
    col_PHSRK = k_PHSRK * exponent_PHSRK.exp()
    own_PHS2RR = (qk_PHS2RK.view(P, H, S, 2 * R, K) @ col_PHSRK.transpose(-1, -2)).view(P, H, S, 2, R, R)
    wide_XR = wide_PHSR.reshape(P * H * S, R)
    if not wide_XR.any():
        return own_PHS2RR
    idx_Y = wide_XR.any(dim=-1).nonzero().squeeze(-1)
    picked = [t.reshape(P * H * S, R, K).index_select(0, idx_Y) for t in (q_PHSRK, k_PHSRK, sums.step)]
    own_X2RR = own_PHS2RR.reshape(P * H * S, 2, R, R)
    wide_Y11J = wide_XR.index_select(0, idx_Y)[:, None, None, :]
    merged_Y2RR = torch.where(wide_Y11J, _diagonal_pairwise(*picked), own_X2RR.index_select(0, idx_Y))
    return own_X2RR.index_copy(0, idx_Y, merged_Y2RR).view_as(own_PHS2RR)


def _diagonal_pairwise(q_YRK, k_YRK, g_YRK):
    """Strictly-lower ``[Y, 2, R, R]`` blocks with the exponent ``Σ_{j < t ≤ i} g_t`` of each pair, summed
    from the gates themselves (a cumsum over ``i`` of the gates after ``j``, not a difference of cumsums, so
    a −1e38 gate elsewhere neither swamps it nor makes ``inf − inf``); −inf on and above the diagonal before
    ``exp``."""
    R = q_YRK.shape[-2]
    strict_IJ1 = torch.ones(R, R, dtype=torch.bool, device=q_YRK.device).tril(-1).unsqueeze(-1)
    span_YIJK = torch.where(strict_IJ1, g_YRK.unsqueeze(-2), 0.0).cumsum(dim=-3)
    kd_YIJK = k_YRK.unsqueeze(-3) * torch.where(strict_IJ1, span_YIJK, -torch.inf).exp()
    A_YI2J = torch.stack([q_YRK, k_YRK], dim=-2) @ kd_YIJK.transpose(-1, -2)
    return A_YI2J.transpose(-3, -2)


def _exclusive_reverse_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``y_i = Σ_{t > i} x_t`` along ``dim`` (a sum of the later terms, not a difference of cumsums)."""
    inclusive = x.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([inclusive.narrow(dim, 1, x.shape[dim] - 1), torch.zeros_like(x.narrow(dim, 0, 1))], dim)


def _between(total_PHWK: torch.Tensor) -> torch.Tensor:
    """``[P, H, S, U, K]``: ``Σ_{u < w < s} total_w``, by cumsums of selected sub-chunk totals (a select, not
    a 0/1 weight: a total may be −inf, and 0·(−inf) is NaN)."""
    S = total_PHWK.shape[-2]
    idx = torch.arange(S, device=total_PHWK.device)
    after_UW1 = (idx.view(1, S) > idx.view(S, 1)).unsqueeze(-1)
    upto_PHUWK = torch.where(after_UW1, total_PHWK.unsqueeze(-3), 0.0).cumsum(dim=-2)  # Σ_{u < w' ≤ w}
    return F.pad(upto_PHUWK[..., :-1, :], (0, 0, 1, 0)).transpose(-3, -2).contiguous()  # (s, u): Σ_{u<w<s}
