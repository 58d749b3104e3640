"""Backward, per chunk: the intra-chunk matrices' gradients, the gate, the L2 norm (docs/references.md#kda-chunked-backward steps 4, 6–8).

One program per (chunk, head) pushes ``dAqk`` and ``dL`` (from :mod:`~openk3.ops.kda.triton.chunk_grad_wy`)
back through

    Aqk_ij = scale Σ_d q_id k_jd e^{Γ_id − Γ_jd}  (i ≥ j)        L_ij = β_i Σ_d k_id k_jd e^{Γ_id − Γ_jd}  (i > j)

(q, k normalised) with the forward's anchors, as whole-chunk tensor-core products, one key slice of ``BK``
channels at a time (every term is per channel until the L2 norm):

* row side, row block ``s`` anchored at ``a_s`` = Γ before it (columns ``k_j 2^{a_s − Γ_j}`` of the blocks
  ``≤ s``, rows ``2^{Γ_i − a_s}`` of block ``s``): ``dq_i += scale Σ_j dAqk_ij k_j e^{Γ_i−Γ_j}`` and
  ``M_i = Σ_j dL_ij k_j e^{Γ_i−Γ_j}``, giving ``dk_i += β_i M_i`` and ``dβ_i += k_i · M_i``;
* column side, column block ``u`` anchored at ``b_u`` = Γ at its last row (rows ``2^{Γ_i − b_u}`` of the
  blocks ``≥ u``, columns ``2^{b_u − Γ_j}`` of block ``u``, ≤ 1):
  ``dk_j += Σ_i (scale dAqk_ij q_i + β_i dL_ij k_i) e^{Γ_i−Γ_j}``;
* ``dΓ_i += q_i ⊙ dq_i^{row} + k_i ⊙ dk_i^{row} − k_i ⊙ dk_i^{col}``.

The per-step ``dg_t = Σ_{i ≥ t} dΓ_i`` keeps only the pairs ``j < t ≤ i``: every other pair enters ``+`` on its
row side and ``−`` on its column side and must cancel. Two things make it cancel in the kernel as it does in
exact arithmetic (otherwise the residue of the pairs that should cancel, rounded differently on the two
sides, adds up along the reverse cumsum and, through it, in ``dA_log`` and ``dt_bias``, sums over a head's
tokens): the diagonal ``dAqk_ii`` (no gate in ``Aqk_ii = scale q_i·k_i``) is kept out of the tensor-core
tiles, its ``dq``/``dk`` terms added in fp32 and its two ``dΓ`` terms (equal and opposite) left out; and both
sides carry each pair to ~2^-16: with bf16 tiles every factor tile goes to the tensor cores as two bf16
pieces (``hi + lo``, :func:`~openk3.ops.kda.triton.kernel_math.split_bf16`), and with tf32 tiles the pairs
inside one anchor block (where a fast gate's ``dg`` lives; across blocks the decay makes them small) are
taken once more with the tf32 rounding remainder of their factors, against the block-diagonal part of the
gradient tiles. The gradient tiles ``dAqk``, ``dL`` are rounded once, the same values on both sides (β goes
with the column side's keys).

Then ``dg = reverse cumsum of dΓ`` within the chunk, the K3 gate backward (``dx = dg·lb·σ(z)(1 − σ(z))·
e^{A_log}``, ``dA_log = Σ dx·(x + dt_bias)``, ``ddt_bias = Σ_t dx``, docs/references.md#kda-gates) and, after all slices (the totals
are parked in the fp32 ``dqn``/``dkn`` buffers), the L2-norm backward ``dq = (dq̂ − q̂ (q̂·dq̂)) / ‖q‖``.

Legend: ``H`` heads, ``K`` key dim, ``BK`` key slice, ``BT`` chunk rows, ``BC`` anchor-block rows, ``NB``
partials of dβ, ``P`` chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_grad_wy import WYGrads
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import SUB_CHUNK, Prepared
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, KernelLaunch
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    chunk_grid,
    chunk_program,
    chunk_rows,
    cumsum_rows,
    dot,
    dot_precision,
    gate_cumsum_slice,
    load_beta,
    load_row_vec,
    load_rows,
    round_tf32,
    row_at,
    sigmoid,
    split_bf16,
    store_row_vec,
    store_rows,
)

BF16_MIN_KEY_DIM = 128
"""Smallest key dim whose 16-bit inputs take bf16 operands here: the four loop-invariant ``[BT, BT]``
gradient tiles (``dAqk``, ``dL`` and their transposes) in bf16 and each decay-weighted factor tile as two
bf16 pieces, products accumulated in fp32 (half the registers of tf32 gradient tiles). Smaller key dims take
tf32 (fp32 inputs tf32x3)."""


@triton.jit
def tf32_remainder(x):
    """What the tensor cores drop of the fp32 factor ``x``: ``x − tf32(x)`` (exact in fp32; rounded to tf32
    again when it is a product's operand, :func:`~openk3.ops.kda.triton.kernel_math.dot`)."""
    return x - round_tf32(x)


@triton.jit
def chunk_grad_intra_kernel(
    q, k, g, beta, A_log, dt_bias, q_rstd, k_rstd,
    dA, dL, dqn, dkn, dG, dbeta_part,
    dq, dk, dg, dbeta, dA_log_part, ddt_part,
    cu_seqlens, chunk_table, part_stride_b,
    scale, lower_bound, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    NB: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, REMAINDER: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H)``. Writes ``dq, dk, dg`` ``[tokens, H, K]``, ``dβ`` ``[tokens, H]`` and the
    per-chunk partial sums ``dA_log_part`` ``[P, H]``, ``ddt_part`` ``[P, H, K]`` (fp32); overwrites
    ``dqn``/``dkn`` with the totals before the L2-norm backward."""
    i_c, i_h = chunk_program(H)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_valid
    blk = o_t // BC
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))

    b_dA = load_rows(dA, t0, n_valid, i_h, 0, H, BT, BT, BT) * scale
    # the diagonal dAqk_ii (e^{Γ_i − Γ_i} = 1, no gate) apart, exact in fp32: its q and k terms cancel in dΓ
    on_diag = o_t[:, None] == o_t[None, :]
    b_dA_ii = tl.sum(tl.where(on_diag, b_dA, 0.0), axis=1)
    b_dA = tl.where(on_diag, 0.0, b_dA)
    b_dL = load_rows(dL, t0, n_valid, i_h, 0, H, BT, BT, BT)
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    b_rq = load_row_vec(q_rstd, t0, n_valid, i_h, H, BT)
    b_rk = load_row_vec(k_rstd, t0, n_valid, i_h, H, BT)
    b_dAt = tl.trans(b_dA)
    b_dLt = tl.trans(b_dL)  # β goes with the column side's keys: both sides round the same dL
    if BF16:  # the loop-invariant operand tiles, once
        b_dA, b_dL = b_dA.to(tl.bfloat16), b_dL.to(tl.bfloat16)
        b_dAt, b_dLt = b_dAt.to(tl.bfloat16), b_dLt.to(tl.bfloat16)
    b_db = tl.zeros([BT], dtype=tl.float32)
    c_q = tl.zeros([BT], dtype=tl.float32)
    c_k = tl.zeros([BT], dtype=tl.float32)
    acc_dA_log = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        o_k = k0 + tl.arange(0, BK)
        b_G, _ = gate_cumsum_slice(
            g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, H, K, BT, BK, HAS_BIAS, True
        )
        b_q = load_rows(q, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rq[:, None]
        b_k = load_rows(k, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rk[:, None]
        acc_q = tl.zeros([BT, BK], dtype=tl.float32)
        acc_m = tl.zeros([BT, BK], dtype=tl.float32)
        acc_c = tl.zeros([BT, BK], dtype=tl.float32)
        a_s = tl.zeros([BK], dtype=tl.float32)
        e_a = tl.zeros([BT, BK], dtype=tl.float32)  # a_s − Γ on each row of block s (its own row anchor)
        e_b = tl.zeros([BT, BK], dtype=tl.float32)  # Γ − b_s on each row of block s (its own column anchor)
        for s in tl.static_range(BT // BC):
            b_s = row_at(b_G, s * BC + BC - 1, BT)
            if REMAINDER:
                e_a = tl.where((blk == s)[:, None], a_s[None, :] - b_G, e_a)
                e_b = tl.where((blk == s)[:, None], b_G - b_s[None, :], e_b)
            # row block s, anchor a_s (Γ before the block)
            b_col = b_k * tl.exp2(tl.where((blk <= s)[:, None], a_s[None, :] - b_G, float("-inf")))
            b_rf = tl.exp2(tl.where((blk == s)[:, None], b_G - a_s[None, :], float("-inf")))
            # column block s, anchor b_s (Γ at its last row)
            b_rows = tl.exp2(tl.where((blk >= s)[:, None], b_G - b_s[None, :], float("-inf")))
            b_cf = tl.exp2(tl.where((blk == s)[:, None], b_s[None, :] - b_G, float("-inf")))
            if BF16:  # each factor tile as two bf16 pieces, hi + lo (~16 significant bits)
                b_ch, b_cl = split_bf16(b_col)
                acc_q += tl.dot(b_dA, b_cl, tl.dot(b_dA, b_ch)) * b_rf
                acc_m += tl.dot(b_dL, b_cl, tl.dot(b_dL, b_ch)) * b_rf
                b_qh, b_ql = split_bf16(b_q * b_rows)
                b_kh, b_kl = split_bf16(b_k * b_rows * b_beta[:, None])
                b_c = tl.dot(b_dAt, b_ql, tl.dot(b_dAt, b_qh))
                acc_c += tl.dot(b_dLt, b_kl, tl.dot(b_dLt, b_kh, b_c)) * b_cf
            else:
                acc_q += dot(b_dA, b_col, DOT) * b_rf
                acc_m += dot(b_dL, b_col, DOT) * b_rf
                b_c = dot(b_dAt, b_q * b_rows, DOT)
                acc_c += dot(b_dLt, b_k * b_rows * b_beta[:, None], DOT, b_c) * b_cf
            a_s = b_s
        if REMAINDER:
            # tf32 tiles: the pairs i > j of one 16-row block once more, with what the operand rounding dropped
            # of their factors (the same fp32 values as in the loop), so a pair's row-side and column-side
            # terms of dΓ cancel to ~2^-16 instead of tf32's 2^-11
            same = blk[:, None] == blk[None, :]
            c_lo = tf32_remainder(b_k * tl.exp2(e_a))
            b_rf = tl.exp2(-e_a)
            acc_q += dot(tl.where(same, b_dA, 0.0), c_lo, DOT) * b_rf
            acc_m += dot(tl.where(same, b_dL, 0.0), c_lo, DOT) * b_rf
            b_rows = tl.exp2(e_b)
            b_c = dot(tl.where(same, b_dAt, 0.0), tf32_remainder(b_q * b_rows), DOT)
            b_c += dot(tl.where(same, b_dLt, 0.0), tf32_remainder(b_k * b_rows * b_beta[:, None]), DOT)
            acc_c += b_c * tl.exp2(-e_b)
        b_db += tl.sum(b_k * acc_m, axis=1)
        b_dk_row = acc_m * b_beta[:, None]
        b_dqn = load_rows(dqn, t0, n_valid, i_h, k0, H, K, BT, BK) + acc_q + b_dA_ii[:, None] * b_k
        b_dkn = load_rows(dkn, t0, n_valid, i_h, k0, H, K, BT, BK) + b_dk_row + acc_c + b_dA_ii[:, None] * b_q
        b_dG = load_rows(dG, t0, n_valid, i_h, k0, H, K, BT, BK) + b_q * acc_q + b_k * (b_dk_row - acc_c)
        c_q += tl.sum(b_q * b_dqn, axis=1)
        c_k += tl.sum(b_k * b_dkn, axis=1)
        store_rows(dqn, b_dqn, t0, n_valid, i_h, k0, H, K, BT, BK)
        store_rows(dkn, b_dkn, t0, n_valid, i_h, k0, H, K, BT, BK)

        # per-step gate gradient, then the K3 gate backward (natural log): g = lb·σ(z), z = e^{A_log}(x + b)
        b_dgc = cumsum_rows(b_dG, BT, True, True)
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        else:
            bias = tl.zeros([BK], dtype=tl.float32)
        b_xb = load_rows(g, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) + bias[None, :]
        b_sig = sigmoid(A_h * b_xb)  # as the forward's gate (kernel_math.k3_gate_log2)
        b_dx = tl.where(m_t[:, None], b_dgc * lower_bound * b_sig * (1.0 - b_sig) * A_h, 0.0)
        store_rows(dg, b_dx, t0, n_valid, i_h, k0, H, K, BT, BK)
        acc_dA_log += tl.sum(b_dx * b_xb, axis=1)
        tl.store(ddt_part + (i_c.to(tl.int64) * H + i_h) * K + o_k, tl.sum(b_dx, axis=0))

    # the L2-norm backward over whole rows, from the totals parked above (this program's own rows)
    tl.debug_barrier()
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        b_dqn = load_rows(dqn, t0, n_valid, i_h, k0, H, K, BT, BK)
        b_dkn = load_rows(dkn, t0, n_valid, i_h, k0, H, K, BT, BK)
        if USE_L2NORM:
            b_q = load_rows(q, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rq[:, None]
            b_k = load_rows(k, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rk[:, None]
            b_dqn = (b_dqn - b_q * c_q[:, None]) * b_rq[:, None]
            b_dkn = (b_dkn - b_k * c_k[:, None]) * b_rk[:, None]
        store_rows(dq, b_dqn, t0, n_valid, i_h, k0, H, K, BT, BK)
        store_rows(dk, b_dkn, t0, n_valid, i_h, k0, H, K, BT, BK)
    for i_p in tl.static_range(NB):
        b_db += load_row_vec(dbeta_part + i_p * part_stride_b, t0, n_valid, i_h, H, BT)
    if BETA_SIGMOID:  # to the logits: dσ/dx = σ(1 − σ)
        b_db = b_db * b_beta * (1.0 - b_beta)
    store_row_vec(dbeta, b_db, t0, n_valid, i_h, H, BT)
    tl.store(dA_log_part + i_c.to(tl.int64) * H + i_h, tl.sum(acc_dA_log, axis=0))


def chunk_grad_intra(
    q, k, g, beta, A_log, dt_bias, pre: Prepared, wy: WYGrads, index: ChunkIndex,
    *, scale: float, lower_bound: float, use_l2norm: bool, beta_sigmoid: bool = False,
    launch: KernelLaunch = DEFAULT_GEOMETRY.chunk_grad_intra,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch :func:`chunk_grad_intra_kernel` (``wy.dqn``/``wy.dkn`` are overwritten; ``launch``: warps,
    stages and the key slice).

    Returns:
        ``(dq, dk, dg, dbeta, dA_log [H] fp32, ddt_bias [H*K] fp32)``; dq, dk, dg in the dtypes of q, k, g,
        dbeta in beta's dtype, all flat ``[tokens, H, ·]``.
    """
    TT, H, K = q.shape
    NB = wy.dbeta.shape[0]
    P = index.num_chunks
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    dA_log_part = q.new_empty(P, H, dtype=torch.float32)
    ddt_part = q.new_empty(P, H, K, dtype=torch.float32)
    bf16 = q.dtype != torch.float32 and K >= BF16_MIN_KEY_DIM
    chunk_grad_intra_kernel[chunk_grid(P, H)](
        q, k, g, beta, A_log, dt_bias, pre.q_rstd, pre.k_rstd,
        wy.dA, wy.dL, wy.dqn, wy.dkn, wy.dG, wy.dbeta,
        dq, dk, dg, dbeta, dA_log_part, ddt_part,
        index.cu_seqlens, index.chunk_table, TT * H,
        scale, lower_bound, lower_bound * LOG2E,
        H=H, DOT=dot_precision(q.dtype), K=K, BT=CHUNK, BC=SUB_CHUNK, BK=min(K, launch.key_block), NB=NB,
        USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None,
        BF16=bf16, BETA_SIGMOID=beta_sigmoid,
        REMAINDER=dot_precision(q.dtype) == "tf32" and not bf16, **launch.options(),
    )  # fmt: skip
    return dq, dk, dg, dbeta, dA_log_part.sum(0), ddt_part.sum(0).view(H * K)
