"""Triton device functions shared by the KDA kernels: the in-kernel gates, row L2 norm, the dot precision,
and tile loads/stores by token rows.

Units: the chunk kernels keep log-decays in **log2** units (natural-log gate × log2(e)) so every decay is
one ``exp2`` (kda_kernels reference §1.5, "log-base convention"); gradients stay w.r.t. the natural-log gate,
because ``d/dΓ e^{Γ} = 2^{Γ·log2 e}``.

Legend: ``R`` rows of a tile (tokens), ``K`` key dim, ``C`` columns of a 16×16 block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""log2(e): natural-log decay × LOG2E = log2 decay."""


def dot_precision(dtype) -> str:
    """``tl.dot`` input precision of the chunk kernels for inputs of ``dtype``: ``"tf32"`` for half-precision
    inputs (their fp32 intermediates carry bf16/fp16 information, fla's choice, §1.5) and ``"tf32x3"`` (three
    tensor-core passes, ~fp32 accuracy) for fp32 inputs, whose users expect fp32 results."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def k3_gate_log2(x, A_h, bias, lower_bound_log2):
    """K3 lower-bounded gate in log2 units: ``lb·log2(e)·σ(e^{A_log}·(x + dt_bias))`` (§1.3).

    ``x`` ``[R, K]`` raw gate (fp32), ``A_h`` scalar ``e^{A_log_h}``, ``bias`` ``[K]`` (zeros without
    ``dt_bias``), ``lower_bound_log2`` = ``lb·log2(e)``. Returns ``[R, K]`` fp32 in ``(lb·log2 e, 0)``.
    """
    z = A_h * (x + bias[None, :])
    return lower_bound_log2 * tl.sigmoid(z)


@triton.jit
def l2norm_rstd(x, USE_L2NORM: tl.constexpr):
    """``1/sqrt(Σ_k x² + 1e-6)`` per row of ``x`` ``[R, K]`` (fla's l2norm epsilon, §1.4); ones without."""
    if USE_L2NORM:
        return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)
    else:
        return tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def load_rows(
    ptr, t_start, n_rows, i_h, col0, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    """Load ``[R, C]`` from a ``[tokens, H, W]`` tensor: rows ``t_start + r`` (``r < n_rows``), columns
    ``col0 + c`` of head ``i_h``; rows past ``n_rows`` read as 0. The row offset is one 64-bit scalar; the
    per-element offsets stay 32-bit."""
    o_r = tl.arange(0, R)
    o_c = tl.arange(0, C)
    base = ptr + (t_start.to(tl.int64) * H + i_h) * W + col0
    return tl.load(base + o_r[:, None] * (H * W) + o_c[None, :], mask=(o_r < n_rows)[:, None], other=0.0)


@triton.jit
def store_rows(
    ptr, value, t_start, n_rows, i_h, col0, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    """Store ``value`` ``[R, C]`` into rows ``t_start + r < t_start + n_rows`` of a ``[tokens, H, W]``
    tensor at columns ``col0 + c`` (cast to the tensor's dtype)."""
    o_r = tl.arange(0, R)
    o_c = tl.arange(0, C)
    base = ptr + (t_start.to(tl.int64) * H + i_h) * W + col0
    tl.store(
        base + o_r[:, None] * (H * W) + o_c[None, :],
        value.to(ptr.dtype.element_ty),
        mask=(o_r < n_rows)[:, None],
    )


@triton.jit
def load_row_vec(ptr, t_start, n_rows, i_h, H: tl.constexpr, R: tl.constexpr):
    """Load ``[R]`` from a ``[tokens, H]`` tensor (rows past ``n_rows`` read as 0), as fp32."""
    o_r = tl.arange(0, R)
    base = ptr + t_start.to(tl.int64) * H + i_h
    return tl.load(base + o_r * H, mask=o_r < n_rows, other=0.0).to(tl.float32)


@triton.jit
def store_row_vec(ptr, value, t_start, n_rows, i_h, H: tl.constexpr, R: tl.constexpr):
    """Store ``[R]`` into rows ``t_start + r < t_start + n_rows`` of a ``[tokens, H]`` tensor."""
    o_r = tl.arange(0, R)
    base = ptr + t_start.to(tl.int64) * H + i_h
    tl.store(base + o_r * H, value.to(ptr.dtype.element_ty), mask=o_r < n_rows)
