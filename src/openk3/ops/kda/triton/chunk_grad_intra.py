"""Backward, per chunk: the intra-chunk matrices' gradients, the gate, the L2 norm (§1.6 steps 4, 6–8).

One program per (chunk, head) walks the four 16-row sub-chunks from last to first. For sub-chunk ``s`` it
pushes ``dAqk`` and ``dL`` (from :mod:`~openk3.ops.kda.triton.chunk_grad_wy`) back through

    Aqk_ij = scale Σ_d q_id k_jd e^{Γ_id − Γ_jd}  (i ≥ j)        L_ij = β_i Σ_d k_id k_jd e^{Γ_id − Γ_jd}  (i > j)

with the same causal anchors as the forward (``a_s`` = Γ before sub-chunk ``s``; all off-diagonal factors
≤ 1, diagonal column factors ≤ 2^{16·|lb|·log2 e}):

* as the row block: ``dq_i += scale Σ_j dAqk_ij k_j e^{Γ_i−Γ_j}``, ``dk_i += Σ_j β_i dL_ij k_j e^{Γ_i−Γ_j}``,
  ``dβ_i += Σ_j dL_ij Lkk_ij``;
* as the column block (rows of this and later sub-chunks, anchored at the sub-chunk's last row):
  ``dk_j += Σ_i (scale dAqk_ij q_i + β_i dL_ij k_i) e^{Γ_i−Γ_j}``;
* ``dΓ_i += q_i ⊙ dq_i^{row} + k_i ⊙ dk_i^{row} − k_i ⊙ dk_i^{col}``.

Then ``dg = reverse cumsum of dΓ`` within the chunk (carried across sub-chunks), the K3 gate backward
(``dx = dg·lb·σ(z)(1 − σ(z))·e^{A_log}``, ``dA_log = Σ dx·(x + dt_bias)``, ``ddt_bias = Σ_t dx``, §1.3) and
the L2-norm backward ``dq = (dq̂ − q̂ (q̂·dq̂)) / ‖q‖``.

Legend: ``H`` heads, ``K`` key dim, ``BT`` chunk rows, ``BC`` sub-chunk rows, ``NL`` partials of dL and dβ,
``P`` chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_grad_wy import WYGrads
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import SUB_CHUNK, Prepared
from openk3.ops.kda.triton.kernel_math import load_row_vec, load_rows, store_row_vec, store_rows

LAUNCH = {"num_warps": 8}
"""Launch configuration; ``benchmarks/kda.py --sweep`` times the alternatives."""


@triton.jit
def _load_qk_gate(
    q,
    k,
    q_rstd,
    k_rstd,
    G,
    t_s,
    n_s,
    i_h,
    H: tl.constexpr,
    K: tl.constexpr,
    BC: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    """Normalised q, k and Γ (log2) ``[BC, K]`` of a sub-chunk; rows past ``n_s`` are 0."""
    b_q = load_rows(q, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32)
    b_k = load_rows(k, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32)
    if USE_L2NORM:
        b_q = b_q * load_row_vec(q_rstd, t_s, n_s, i_h, H, BC)[:, None]
        b_k = b_k * load_row_vec(k_rstd, t_s, n_s, i_h, H, BC)[:, None]
    b_G = load_rows(G, t_s, n_s, i_h, 0, H, K, BC, K)
    return b_q, b_k, b_G


@triton.jit
def _load_intra_grads(
    dA,
    dL,
    t_s,
    n_s,
    i_h,
    col0,
    part_stride,
    H: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    NL: tl.constexpr,
):
    """The ``[BC, BC]`` blocks of ``dAqk`` and ``dL`` at rows ``t_s..``, columns ``col0..``; ``dL`` summed
    over its ``NL`` partials."""
    b_dA = load_rows(dA, t_s, n_s, i_h, col0, H, BT, BC, BC)
    b_dL = tl.zeros([BC, BC], dtype=tl.float32)
    for i_p in tl.static_range(NL):
        b_dL += load_rows(dL + i_p * part_stride, t_s, n_s, i_h, col0, H, BT, BC, BC)
    return b_dA, b_dL


@triton.jit
def _sub_chunk_grads(
    q, k, g, beta, q_rstd, k_rstd, G, dA, dL, dqn, dkn, dG, dbeta_part, dq, dk, dg, dbeta,
    t0, n_valid, i_h, A_h, bias, carry, acc_dA_log, acc_ddt, part_stride, part_stride_b,
    scale, lower_bound,
    s, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NL: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):  # fmt: skip
    """All gradients of sub-chunk ``s`` (a run-time index: loops, not unrolled copies, keep the register
    footprint to one sub-chunk pair); returns the updated (dΓ suffix carry, dA_log and ddt_bias sums)."""
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    t_s = t0 + s * BC
    n_s = n_valid - s * BC
    m_r = o_r < n_s
    b_q, b_k, b_G = _load_qk_gate(q, k, q_rstd, k_rstd, G, t_s, n_s, i_h, H, K, BC, USE_L2NORM)
    b_beta = load_row_vec(beta, t_s, n_s, i_h, H, BC)
    a_s = tl.load(G + ((t_s - 1) * H + i_h) * K + o_k, mask=(o_k * 0 + s) > 0, other=0.0)
    b_lc = tl.where(m_r[:, None], b_G - a_s[None, :], 0.0)
    b_rf = tl.exp2(b_lc)
    b_cf = tl.exp2(-b_lc)
    b_qa = b_q * b_rf
    b_ka = b_k * b_rf

    # row side: columns of the earlier sub-chunks, then the diagonal block
    acc_q = tl.zeros([BC, K], dtype=tl.float32)
    acc_k = tl.zeros([BC, K], dtype=tl.float32)
    b_db = tl.zeros([BC], dtype=tl.float32)
    for u in range(0, s):
        b_qu, b_ku, b_Gu = _load_qk_gate(q, k, q_rstd, k_rstd, G, t0 + u * BC, BC, i_h, H, K, BC, USE_L2NORM)
        b_col = b_ku * tl.exp2(a_s[None, :] - b_Gu)
        b_dAb, b_dLb = _load_intra_grads(dA, dL, t_s, n_s, i_h, u * BC, part_stride, H, BT, BC, NL)
        acc_q += tl.dot(b_dAb, b_col)
        acc_k += tl.dot(b_dLb * b_beta[:, None], b_col)
        b_db += tl.sum(b_dLb * tl.dot(b_ka, tl.trans(b_col)), axis=1)
    b_cd = b_k * b_cf
    b_dAb, b_dLb = _load_intra_grads(dA, dL, t_s, n_s, i_h, s * BC, part_stride, H, BT, BC, NL)
    b_dLk = b_dLb * b_beta[:, None]
    acc_q += tl.dot(b_dAb, b_cd)
    acc_k += tl.dot(b_dLk, b_cd)
    b_Lkk = tl.where(o_r[:, None] > o_r[None, :], tl.dot(b_ka, tl.trans(b_cd)), 0.0)
    b_db += tl.sum(b_dLb * b_Lkk, axis=1)
    b_dq_in = acc_q * b_rf * scale
    b_dk_row = acc_k * b_rf

    # column side: the diagonal block, then the rows of the later sub-chunks
    b_dk_col = (tl.dot(tl.trans(b_dAb), b_qa) * scale + tl.dot(tl.trans(b_dLk), b_ka)) * b_cf
    a_n = tl.load(G + ((t_s + BC - 1) * H + i_h) * K + o_k, mask=(o_k * 0 + n_s) >= BC, other=0.0)
    acc_c = tl.zeros([BC, K], dtype=tl.float32)
    for s2 in range(s + 1, BT // BC):
        t2 = t0 + s2 * BC
        n2 = n_valid - s2 * BC
        b_q2, b_k2, b_G2 = _load_qk_gate(q, k, q_rstd, k_rstd, G, t2, n2, i_h, H, K, BC, USE_L2NORM)
        b_beta2 = load_row_vec(beta, t2, n2, i_h, H, BC)
        b_rf2 = tl.exp2(tl.where((o_r < n2)[:, None], b_G2 - a_n[None, :], 0.0))
        b_dA2, b_dL2 = _load_intra_grads(dA, dL, t2, n2, i_h, s * BC, part_stride, H, BT, BC, NL)
        acc_c += tl.dot(tl.trans(b_dA2), b_q2 * b_rf2) * scale
        acc_c += tl.dot(tl.trans(b_dL2 * b_beta2[:, None]), b_k2 * b_rf2)
    b_dk_col += acc_c * tl.exp2(tl.minimum(a_n[None, :] - b_G, 0.0))

    # totals of the normalised q, k and of Γ; the reverse cumsum gives the per-step gate gradient
    b_dqn = load_rows(dqn, t_s, n_s, i_h, 0, H, K, BC, K) + b_dq_in
    b_dkn = load_rows(dkn, t_s, n_s, i_h, 0, H, K, BC, K) + b_dk_row + b_dk_col
    b_dG = load_rows(dG, t_s, n_s, i_h, 0, H, K, BC, K) + b_q * b_dq_in + b_k * (b_dk_row - b_dk_col)
    for i_p in tl.static_range(NL):
        b_db += load_row_vec(dbeta_part + i_p * part_stride_b, t_s, n_s, i_h, H, BC)
    b_dgc = tl.cumsum(b_dG, axis=0, reverse=True) + carry[None, :]
    carry += tl.sum(b_dG, axis=0)

    # K3 gate backward (natural log): g = lb·σ(z), z = e^{A_log}(x + dt_bias)
    b_xb = load_rows(g, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32) + bias[None, :]
    b_sig = tl.sigmoid(A_h * b_xb)
    b_dx = tl.where(m_r[:, None], b_dgc * lower_bound * b_sig * (1.0 - b_sig) * A_h, 0.0)
    acc_dA_log += tl.sum(b_dx * b_xb, axis=0)
    acc_ddt += tl.sum(b_dx, axis=0)

    if USE_L2NORM:
        b_rq = load_row_vec(q_rstd, t_s, n_s, i_h, H, BC)
        b_rk = load_row_vec(k_rstd, t_s, n_s, i_h, H, BC)
        b_dqn = (b_dqn - b_q * tl.sum(b_q * b_dqn, axis=1)[:, None]) * b_rq[:, None]
        b_dkn = (b_dkn - b_k * tl.sum(b_k * b_dkn, axis=1)[:, None]) * b_rk[:, None]
    store_rows(dq, b_dqn, t_s, n_s, i_h, 0, H, K, BC, K)
    store_rows(dk, b_dkn, t_s, n_s, i_h, 0, H, K, BC, K)
    store_rows(dg, b_dx, t_s, n_s, i_h, 0, H, K, BC, K)
    store_row_vec(dbeta, b_db, t_s, n_s, i_h, H, BC)
    return carry, acc_dA_log, acc_ddt


@triton.jit
def chunk_grad_intra_kernel(
    q, k, g, beta, A_log, dt_bias, q_rstd, k_rstd,
    G, dA, dL, dqn, dkn, dG, dbeta_part,
    dq, dk, dg, dbeta, dA_log_part, ddt_part,
    cu_seqlens, chunk_table, part_stride, part_stride_b,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NL: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Grid ``(P, H)``. Writes ``dq, dk, dg`` ``[tokens, H, K]``, ``dβ`` ``[tokens, H]`` and the per-chunk
    partial sums ``dA_log_part`` ``[P, H]``, ``ddt_part`` ``[P, H, K]`` (fp32)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_table + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_table + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    n_valid = tl.minimum(eos - t0, BT).to(tl.int32)
    o_k = tl.arange(0, K)
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    if HAS_BIAS:
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        bias = tl.zeros([K], dtype=tl.float32)
    carry = tl.zeros([K], dtype=tl.float32)
    acc_dA_log = tl.zeros([K], dtype=tl.float32)
    acc_ddt = tl.zeros([K], dtype=tl.float32)
    for i in range(0, BT // BC):
        s = BT // BC - 1 - i
        if n_valid > s * BC:
            carry, acc_dA_log, acc_ddt = _sub_chunk_grads(
                q, k, g, beta, q_rstd, k_rstd, G, dA, dL, dqn, dkn, dG, dbeta_part, dq, dk, dg, dbeta,
                t0, n_valid, i_h, A_h, bias, carry, acc_dA_log, acc_ddt, part_stride, part_stride_b,
                scale, lower_bound, s, H, K, BT, BC, NL, USE_L2NORM,
            )  # fmt: skip
    p_part = i_c.to(tl.int64) * H + i_h
    tl.store(dA_log_part + p_part, tl.sum(acc_dA_log, axis=0))
    tl.store(ddt_part + p_part * K + o_k, acc_ddt)


def chunk_grad_intra(
    q, k, g, beta, A_log, dt_bias, pre: Prepared, wy: WYGrads, index: ChunkIndex,
    *, scale: float, lower_bound: float, use_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch :func:`chunk_grad_intra_kernel`.

    Returns:
        ``(dq, dk, dg, dbeta, dA_log [H] fp32, ddt_bias [H*K] fp32)``; dq, dk, dg in the dtypes of q, k, g,
        dbeta in beta's dtype, all flat ``[tokens, H, ·]``.
    """
    TT, H, K = q.shape
    NL = wy.dL.shape[0]
    P = index.num_chunks
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    dA_log_part = q.new_empty(P, H, dtype=torch.float32)
    ddt_part = q.new_empty(P, H, K, dtype=torch.float32)
    chunk_grad_intra_kernel[(P, H)](
        q, k, g, beta, A_log, dt_bias, pre.q_rstd, pre.k_rstd,
        wy.G, wy.dA, wy.dL, wy.dqn, wy.dkn, wy.dG, wy.dbeta,
        dq, dk, dg, dbeta, dA_log_part, ddt_part,
        index.cu_seqlens, index.chunk_table, TT * H * CHUNK, TT * H,
        scale, lower_bound,
        H=H, K=K, BT=CHUNK, BC=SUB_CHUNK, NL=NL, USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None,
        num_warps=LAUNCH["num_warps"], num_stages=1,
    )  # fmt: skip
    return dq, dk, dg, dbeta, dA_log_part.sum(0), ddt_part.sum(0).view(H * K)
