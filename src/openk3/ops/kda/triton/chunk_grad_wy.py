"""Backward, per chunk: the state-facing gradients and the WY (UT) backward (docs/references.md#kda-chunked-backward step 3).

One program per (chunk, head, key block). With ``S₀ = h`` (state at the chunk start), ``dS₁ = dh`` (gradient
of the state at the chunk end), ``E = v_new`` and ``dE = dv_new`` from the two state passes::

    dQ̃ = dO S₀ᵀ      dK̂ = E dS₁ᵀ      dW = −dE S₀ᵀ      dD = Σ_v S₀ ⊙ dS₁      dAqk = tril(dO Eᵀ)
    WY backward, W = T Xk, U = T Xv with Xk = Diag(β) K̃, Xv = Diag(β) V, T = (I + L)^{-1}:
        dXk = Tᵀ dW       dXv = Tᵀ dE       dL = −strict_lower(dXk Wᵀ + dXv Uᵀ)   (= −Tᵀ dT Tᵀ)
    and since dW = −dE S₀ᵀ and E = U − W S₀, the two terms of dL collapse to one:
        dXk Wᵀ + dXv Uᵀ = Tᵀ dE (U − W S₀)ᵀ = dXv Eᵀ,   so   dL = −strict_lower(dXv Eᵀ)
    dv = β ⊙ dXv          dβ ← Σ_v V ⊙ dXv + Σ_d K̃ ⊙ dXk
    through Q̃ = scale·Q ⊙ e^{Γ}, K̃ = K ⊙ e^{Γ}, K̂ = K ⊙ e^{Γ_C − Γ}, D = e^{Γ_C}:
        dq += scale·dQ̃ ⊙ e^{Γ}         dk += β dXk ⊙ e^{Γ} + dK̂ ⊙ e^{Γ_C − Γ}
        dΓ += dQ̃ ⊙ Q̃ + β dXk ⊙ K̃ − dK̂ ⊙ K̂      dΓ_C += Σ_rows dK̂ ⊙ K̂ + D ⊙ dD   (Γ_C is the last row)

The one-term ``dL`` is exact algebra and needs neither ``W`` nor ``U`` nor the key side's share of ``dL``.
Its ``E`` is the stored one, rounded to the input dtype, where the two-term form would be the exact
derivative with respect to the stored ``U``, ``W`` and ``h``.

Two kernels: the value side (``dAqk``, ``dXv``, ``dv``, ``dL``, the ``dXv`` term of ``dβ``) once per chunk,
and the key side per key block of ``BK`` (``dQ̃``, ``dK̂``, ``dW``, the ``dXk`` terms), so neither holds more
than a few 64×64 fp32 tiles. They write the partial ``dq, dk, dΓ`` (fp32, w.r.t. the normalised q, k and the
cumulative gate), ``dAqk``, ``dL``, and ``1 + NK`` partials of ``dβ`` that the intra kernel sums.

Legend: ``H`` heads, ``K``/``V`` key/value dims, ``BK``/``BV`` key/value blocks, ``BT`` chunk rows,
``P`` chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import Prepared
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, GradWYLaunch
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    chunk_grid,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    gate_cumsum_slice,
    load_beta,
    load_row_vec,
    load_rows,
    store_row_vec,
    store_rows,
)


@triton.jit
def chunk_grad_wy_value_kernel(
    v, beta, Akk, v_new, dv_new, do, dv, dA, dL, dbeta,
    cu_seqlens, chunk_table,
    H: tl.constexpr, DOT: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H)``: the value-side terms ``dAqk = tril(dO Eᵀ)``, ``dXv = Tᵀ dE``,
    ``dv = β dXv``, ``dL = −strict_lower(dXv Eᵀ)`` and ``dβ ← Σ_v V dXv`` (partial 0 of ``dβ``)."""
    i_c, i_h = chunk_program(H)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    o_t = tl.arange(0, BT)
    dt = v_new.dtype.element_ty
    b_T = load_rows(Akk, t0, n_valid, i_h, 0, H, BT, BT, BT).to(tl.float32)
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    acc_dA = tl.zeros([BT, BT], dtype=tl.float32)
    acc_dL = tl.zeros([BT, BT], dtype=tl.float32)
    acc_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, V // BV):
        b_e = load_rows(v_new, t0, n_valid, i_h, i_v * BV, H, V, BT, BV)
        b_do = load_rows(do, t0, n_valid, i_h, i_v * BV, H, V, BT, BV).to(dt)
        acc_dA += dot(b_do, tl.trans(b_e), DOT)
        b_ef = b_e.to(tl.float32)
        b_de = load_rows(dv_new, t0, n_valid, i_h, i_v * BV, H, V, BT, BV).to(tl.float32)
        b_dxv = dot(tl.trans(b_T), b_de, DOT)
        store_rows(dv, b_dxv * b_beta[:, None], t0, n_valid, i_h, i_v * BV, H, V, BT, BV)
        acc_db += tl.sum(
            b_dxv * load_rows(v, t0, n_valid, i_h, i_v * BV, H, V, BT, BV).to(tl.float32), axis=1
        )
        acc_dL -= dot(b_dxv, tl.trans(b_ef), DOT)
    store_rows(dA, tl.where(o_t[:, None] >= o_t[None, :], acc_dA, 0.0), t0, n_valid, i_h, 0, H, BT, BT, BT)
    store_rows(dL, tl.where(o_t[:, None] > o_t[None, :], acc_dL, 0.0), t0, n_valid, i_h, 0, H, BT, BT, BT)
    store_row_vec(dbeta, acc_db, t0, n_valid, i_h, H, BT)


@triton.jit
def chunk_grad_wy_key_kernel(
    q, k, g, beta, A_log, dt_bias, q_rstd, k_rstd,
    Akk, h, dh, v_new, dv_new, do,
    dqn, dkn, dG, dbeta,
    cu_seqlens, chunk_table, part_stride_b,
    scale, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H, K/BK)``: the key-side terms of one key block (partial ``1 + i_k`` of
    ``dβ``)."""
    i_c, i_h = chunk_program(H)
    i_k = tl.program_id(2)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    dt = v_new.dtype.element_ty

    acc_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    acc_dkg = tl.zeros([BT, BK], dtype=tl.float32)
    acc_dwn = tl.zeros([BT, BK], dtype=tl.float32)
    acc_dD = tl.zeros([BK], dtype=tl.float32)
    p_chunk = (i_c.to(tl.int64) * H + i_h) * K * V
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_hv = p_chunk + o_k[:, None] * V + o_v[None, :]
        b_h32 = tl.load(h + p_hv)  # fp32: whole in dD, rounded to the storage dtype in the products
        b_dh32 = tl.load(dh + p_hv)
        b_h = b_h32.to(dt)
        b_dh = b_dh32.to(dt)
        b_do = load_rows(do, t0, n_valid, i_h, i_v * BV, H, V, BT, BV).to(dt)
        acc_dqg += dot(b_do, tl.trans(b_h), DOT)
        b_de = load_rows(dv_new, t0, n_valid, i_h, i_v * BV, H, V, BT, BV)
        acc_dwn += dot(b_de, tl.trans(b_h), DOT)
        b_e = load_rows(v_new, t0, n_valid, i_h, i_v * BV, H, V, BT, BV)
        acc_dkg += dot(b_e, tl.trans(b_dh), DOT)
        acc_dD += tl.sum(b_h32 * b_dh32, axis=1)

    # WY: dXk = −Tᵀ dWn (its share of dL is in the value side's dXv Eᵀ)
    b_T = load_rows(Akk, t0, n_valid, i_h, 0, H, BT, BT, BT).to(tl.float32)
    b_dxk = -dot(tl.trans(b_T), acc_dwn, DOT)

    # the gate and the normalised q, k of this key block
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_G, b_GC = gate_cumsum_slice(
        g, t0, n_valid, i_h, A_h, dt_bias, i_k * BK, lower_bound_log2, H, K, BT, BK, HAS_BIAS, False
    )
    b_eG = tl.exp2(b_G)
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)

    b_q = load_rows(q, t0, n_valid, i_h, i_k * BK, H, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        b_q = b_q * load_row_vec(q_rstd, t0, n_valid, i_h, H, BT)[:, None]
    store_rows(dqn, acc_dqg * b_eG * scale, t0, n_valid, i_h, i_k * BK, H, K, BT, BK)
    b_dG = acc_dqg * b_q * b_eG * scale
    b_k = load_rows(k, t0, n_valid, i_h, i_k * BK, H, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        b_k = b_k * load_row_vec(k_rstd, t0, n_valid, i_h, H, BT)[:, None]
    b_kt = b_k * b_eG
    store_row_vec(dbeta + (1 + i_k) * part_stride_b, tl.sum(b_dxk * b_kt, axis=1), t0, n_valid, i_h, H, BT)
    b_dkt = b_beta[:, None] * b_dxk
    b_dG += b_dkt * b_kt
    b_eR = tl.exp2(b_GC[None, :] - b_G)
    b_kh = b_k * b_eR
    store_rows(dkn, b_dkt * b_eG + acc_dkg * b_eR, t0, n_valid, i_h, i_k * BK, H, K, BT, BK)
    b_dG -= acc_dkg * b_kh
    b_dGC = tl.sum(acc_dkg * b_kh, axis=0) + tl.exp2(b_GC) * acc_dD
    b_dG += tl.where(o_t[:, None] == n_valid - 1, b_dGC[None, :], 0.0)
    store_rows(dG, b_dG, t0, n_valid, i_h, i_k * BK, H, K, BT, BK)


class WYGrads(NamedTuple):
    """Outputs of :func:`chunk_grad_wy`: ``dv`` in v's dtype, the rest fp32 partials."""

    dv: torch.Tensor
    """``[tokens, H, V]``."""
    dqn: torch.Tensor
    """``[tokens, H, K]`` gradient of the normalised q (without the intra-chunk ``Aqk`` term)."""
    dkn: torch.Tensor
    """``[tokens, H, K]`` gradient of the normalised k (without the ``Aqk``/``L`` terms)."""
    dG: torch.Tensor
    """``[tokens, H, K]`` gradient of the cumulative gate Γ (without the ``Aqk``/``L`` terms)."""
    dA: torch.Tensor
    """``[tokens, H, BT]`` ``dAqk`` (lower, diagonal included)."""
    dL: torch.Tensor
    """``[tokens, H, BT]`` ``dL`` (strictly lower)."""
    dbeta: torch.Tensor
    """``[1 + NK, tokens, H]`` partials of ``dβ``: value side, then each key block."""


def blocks(K: int, V: int, launch: GradWYLaunch) -> tuple[int, int]:
    """The key and value blocks ``(BK, BV)`` the kernels take for head dims ``K``, ``V``: ``BK = min(K,
    key_block)`` and ``BV = min(V, value_block, 2·BK)``: small head dims never give a value block of four key
    blocks or more (such a pair faulted on the H200, cause unknown; docs/LOG.md)."""
    BK = min(K, launch.key_block)
    return BK, min(V, launch.value_block, 2 * BK)


def chunk_grad_wy(
    q, k, v, g, beta, A_log, dt_bias, pre: Prepared, h, dh, v_new, dv_new, do, index: ChunkIndex,
    *, scale: float, lower_bound: float, use_l2norm: bool, beta_sigmoid: bool = False,
    launch: GradWYLaunch = DEFAULT_GEOMETRY.chunk_grad_wy,
) -> WYGrads:  # fmt: skip
    """Launch the value-side and key-side kernels (arguments as the tensors of the forward and the two
    state passes, flat ``[tokens, H, ·]``; ``launch``: warps, stages, key and value blocks, :func:`blocks`)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    BK, BV = blocks(K, V, launch)
    NK = K // BK
    f32 = torch.float32
    out = WYGrads(
        dv=v.new_empty(TT, H, V),
        dqn=q.new_empty(TT, H, K, dtype=f32),
        dkn=q.new_empty(TT, H, K, dtype=f32),
        dG=q.new_empty(TT, H, K, dtype=f32),
        dA=q.new_empty(TT, H, CHUNK, dtype=f32),
        dL=q.new_empty(TT, H, CHUNK, dtype=f32),
        dbeta=q.new_empty(1 + NK, TT, H, dtype=f32),
    )
    P = index.num_chunks
    chunk_grad_wy_value_kernel[chunk_grid(P, H)](
        v, beta, pre.Akk, v_new, dv_new, do, out.dv, out.dA, out.dL, out.dbeta,
        index.cu_seqlens, index.chunk_table,
        H=H, DOT=dot_precision(q.dtype), V=V, BT=CHUNK, BV=BV, BETA_SIGMOID=beta_sigmoid, **launch.options(),
    )  # fmt: skip
    chunk_grad_wy_key_kernel[chunk_grid(P, H, NK)](
        q, k, g, beta, A_log, dt_bias, pre.q_rstd, pre.k_rstd,
        pre.Akk, h, dh, v_new, dv_new, do,
        out.dqn, out.dkn, out.dG, out.dbeta,
        index.cu_seqlens, index.chunk_table, TT * H,
        scale, lower_bound * LOG2E,
        H=H, DOT=dot_precision(q.dtype), K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None, BETA_SIGMOID=beta_sigmoid, **launch.options(),
    )  # fmt: skip
    return out
