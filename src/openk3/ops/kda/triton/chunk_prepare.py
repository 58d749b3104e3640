"""Per-chunk preparation of the chunked KDA (the token-parallel half of the forward, docs/references.md#kda-chunked-form).

One program per (chunk of ``BT = 64`` tokens, head). It applies the K3 gate and the optional L2 norm in the
kernel, and produces everything the sequential state pass needs, so that pass is three matmuls per chunk:

    Γ  = cumsum of the log2 gate over the chunk          Γ_C its last row
    Aqk_ij = scale Σ_d q_id k_jd 2^{Γ_id − Γ_jd}  (i ≥ j)      L_ij = β_i Σ_d k_id k_jd 2^{Γ_id − Γ_jd}  (i > j)
    T  = (I + L)^{-1}                                     (written to ``Akk``, fp32 or fp16)
    W  = T Diag(β) (K ⊙ 2^{Γ})     U = T Diag(β) V
    Q̃  = scale·Q ⊙ 2^{Γ}          K̂ = K ⊙ 2^{Γ_C − Γ}       D = 2^{Γ_C}

``Aqk`` and ``L`` are built per 16-row anchor block (fla's ``BC``): row block ``s`` factors
``2^{Γ_i − Γ_j} = 2^{Γ_i − a_s}·2^{a_s − Γ_j}`` with the anchor ``a_s`` = Γ just before it; its 16 rows meet
the columns of the blocks ``≤ s`` (later ones masked to 0 before the exponential) in one 16×64 tensor-core
dot per key slice. Before block ``s`` both factors are ≤ 1; inside it the column
factor is at most ``2^{16·|lb|·log2 e}`` = ``2^{115.4}`` for ``lb = −5``, inside fp32 (FlashKDA's bound,
docs/references.md#flashkda): this is why the Triton path needs ``lower_bound ≥ −5`` (docs/references.md#kda-gate-factors). Every row ``i`` reads only rows ``≤ i``
of its chunk, so outputs are bitwise causal. ``T`` comes from :func:`unit_lower_inverse` (fp32 substitution
within 16-row blocks, tensor-core products between them).

Register budget: ``Aqk`` and ``L`` are accumulated over key slices of ``BK`` channels (the gate and its cumsum
are per channel, and the L2 norm is a per-row factor applied after the sums); ``W``, ``U``, ``Q̃``, ``K̂`` are
produced slice by slice from ``T`` in registers, so no tile wider than one slice is live besides the three
64×64 ones. The backward reruns only that second pass, from the ``T`` and norms the forward wrote.

Legend: ``BT`` chunk rows, ``BC`` anchor-block rows, ``K``/``V`` key/value dims, ``H`` heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton import kernel_math
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    bounded_dot,
    cat4_cols,
    cat4_rows,
    check_launch_entries,
    check_outs,
    chunk_grid,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    gate_cumsum_slice,
    launch_options,
    load_beta,
    load_row_vec,
    load_rows,
    row_at,
    split4_cols,
    split4_rows,
    store_row_vec,
    store_rows,
    tf32_operand,
    unit_lower_inverse_stacked,
)

SUB_CHUNK = 16
"""Rows per sub-chunk ``BC``: the anchor blocks of the intra-chunk matrices (fla's ``BC``)."""
LAUNCH = {
    "num_warps": 4,
    "num_stages": 1,
    "maxnreg": 0,
    "key_block": 64,
    "wy_block": 64,
    "fp16_inverse": True,
    "cumsum_by_dot": False,
}
"""Launch configuration (``benchmarks/kda.py --sweep`` times the alternatives): warps, stages, a register cap
(0: none), the key slice ``BK`` of the ``Aqk``/``L`` pass, the key/value slice of the ``W``/``U`` pass
(narrower slices hold fewer registers), and two switches.

``fp16_inverse``: fp16 operands (fp32 accumulation, :func:`~openk3.ops.kda.triton.kernel_math.bounded_dot`)
in the block-substitution products of ``T = (I + L)^{-1}`` and in ``W = T·Diag(β)K̃``, and ``T`` saved in
fp16, for bf16/fp16 inputs with the in-kernel L2 norm (β is documented post-sigmoid, in ``[0, 1]``). There
every operand is bounded, so none overflows:

* unit keys and ``β ≤ 1`` give ``|L_ij| ≤ 1``;
* ``|T_ij| ≤ β_i ≤ 1`` for ``i > j`` (``T_ii = 1``; FlashKDA's rationale for its fp16 inverse, kda_kernels
  docs/references.md#flashkda): ``T_ij β_j`` is the value the chunk's delta rule writes at step ``i`` after a unit write at
  step ``j``, and every step ``Diag(α)(I − β k kᵀ)`` has norm ≤ 1;
* ``|β k̃| ≤ 1``. ``U``'s factor ``V`` is unbounded, so ``U`` stays tf32.

Bounded is not the same as accurate: the 16×16 diagonal blocks are inverted by fp32 substitution
(:func:`unit_lower_inverse_blocks`), because the doubling product they replaced cancelled large terms. With
fp16 the errors stay those of tf32 operands (B1 T300 H2 in the interpreter: every output and gradient within
0.0006 of exact fp32 products, ``dA_log``, one sum per head, within 0.0010). It took prepare from 2.32 to 2.14
ms and its backward pass from 0.86 to 0.80 ms at B1 T8192 H96 on the H200 (measured with the
doubling-product inverse, since replaced; with the substitution prepare takes 2.5–2.7 ms).

``cumsum_by_dot``: the gate's cumsum as tensor-core products
(:func:`~openk3.ops.kda.triton.kernel_math.cumsum_rows`); slower here (2.49 vs 2.11 ms, B1 T8192 H96, H200),
faster in grad_intra (:data:`~openk3.ops.kda.triton.chunk_grad_intra.LAUNCH`)."""


@triton.jit
def unit_lower_inverse_blocks(L0, L1, L2, L3, BC: tl.constexpr):
    """``(I + L_s)^{-1}`` of four strictly lower-triangular ``[BC, BC]`` fp32 blocks, stacked into one
    ``[4, BC, BC]`` tile for :func:`~openk3.ops.kda.triton.kernel_math.unit_lower_inverse_stacked` (fp32
    forward substitution): prepare took 2.52 ms this way against 3.08 ms block by block (B1 T8192 H96, H200).

    The doubling product ``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` used before (FlashKDA's) is exact in exact
    arithmetic but its factors reach ``C(14, 7) ≈ 3·10³`` and cancel to entries ≤ 1: with nearly parallel
    keys in a block (cosine ≳ 0.9, β ≳ 0.8, slow decay) its tf32/fp16 result was off by O(1) (the saved
    ``T`` by 8.0 in one interpreter test). It was faster (prepare 2.16 ms on the H200)."""
    X = tl.join(tl.join(L0, L1), tl.join(L2, L3))  # [BC, BC, 2, 2]: [..., p, q] is block 2q + p
    T = unit_lower_inverse_stacked(tl.permute(tl.reshape(X, [BC, BC, 4]), [2, 0, 1]), 4, BC)
    Y = tl.reshape(tl.permute(T, [1, 2, 0]), [BC, BC, 2, 2])
    A, B = tl.split(Y)
    D0, D1 = tl.split(A)
    D2, D3 = tl.split(B)
    return D0, D1, D2, D3


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr, FP16: tl.constexpr):
    """``T = (I + L)^{-1}`` of a strictly lower-triangular ``[BT, BT]`` fp32 tile (``BT = 4·BC``): the four
    diagonal blocks' inverses ``D_s = (I + L_ss)^{-1}`` at once (:func:`unit_lower_inverse_blocks`), then
    :func:`block_substitution`."""
    tl.static_assert(BT == 4 * BC, "four anchor blocks per chunk")
    L0, L1, L2, L3 = split4_rows(L, BT, BT)
    L00, _, _, _ = split4_cols(L0, BC, BT)
    _, L11, _, _ = split4_cols(L1, BC, BT)
    _, _, L22, _ = split4_cols(L2, BC, BT)
    _, _, _, L33 = split4_cols(L3, BC, BT)
    D0, D1, D2, D3 = unit_lower_inverse_blocks(L00, L11, L22, L33, BC)
    return block_substitution(L, D0, D1, D2, D3, BT, BC, DOT, FP16)


@triton.jit
def block_substitution(L, D0, D1, D2, D3, BT: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr,
                       FP16: tl.constexpr):  # fmt: skip
    """``T = (I + L)^{-1}`` of a strictly lower-triangular ``[BT, BT]`` fp32 tile (``BT = 4·BC``) by block
    forward substitution over its ``BC``-row blocks, given the diagonal blocks' inverses
    ``D_s = (I + L_ss)^{-1}`` (``[BC, BC]`` fp32; ``L``'s diagonal blocks are not read).

    Row block ``s`` of ``T`` is ``T_s = D_s (E_s − Σ_{u<s} L_su T_u)`` (``E_s`` the identity's rows), i.e.
    ``D_s`` on the diagonal block plus ``−D_s Σ_{u<s} L_su T_u``: nine ``16×16×64`` tensor-core products
    (fp16 operands when ``FP16``; every factor is bounded by 1 and every sum has at most 48 terms).
    Row ``i`` of every factor reads only rows ``≤ i`` of ``L``, and of the ``D_s`` (causal).
    """
    tl.static_assert(BT == 4 * BC, "four anchor blocks per chunk")
    _, L1, L2, L3 = split4_rows(L, BT, BT)
    L10, _, _, _ = split4_cols(L1, BC, BT)
    L20, L21, _, _ = split4_cols(L2, BC, BT)
    L30, L31, L32, _ = split4_cols(L3, BC, BT)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    T0 = cat4_cols(D0, zero, zero, zero, BC, BC)
    R1 = bounded_dot(L10, T0, DOT, FP16)
    T1 = cat4_cols(zero, D1, zero, zero, BC, BC) - bounded_dot(D1, R1, DOT, FP16)
    R2 = bounded_dot(L21, T1, DOT, FP16) + bounded_dot(L20, T0, DOT, FP16)
    T2 = cat4_cols(zero, zero, D2, zero, BC, BC) - bounded_dot(D2, R2, DOT, FP16)
    R3 = bounded_dot(L30, T0, DOT, FP16) + bounded_dot(L31, T1, DOT, FP16)
    R3 += bounded_dot(L32, T2, DOT, FP16)
    T3 = cat4_cols(zero, zero, zero, D3, BC, BC) - bounded_dot(D3, R3, DOT, FP16)
    return cat4_rows(T0, T1, T2, T3, BC, BT)


@triton.jit
def anchor_block_products(acc_A, acc_L, q_s, k_s, G_s, a_s, b_k, b_G,
                          s: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Add one key slice's share of row block ``s`` of the raw ``Aqk`` and ``L`` (``acc_A``, ``acc_L``
    ``[BC, BT]``): rows ``q_s·2^{Γ_s−a_s}``, ``k_s·2^{Γ_s−a_s}`` (``[BC, BK]``, ≤ 1 factors) against columns
    ``k·2^{a_s−Γ}`` of the blocks ``≤ s`` (``b_k``, ``b_G`` ``[BT, BK]``; later blocks masked to 0 before the
    exponential, ≤ ``2^{115}`` inside block ``s``)."""
    blk = tl.arange(0, BT) // BC
    b_rf = tl.exp2(G_s - a_s[None, :])
    b_col = tl.trans(b_k * tl.exp2(tl.where((blk <= s)[:, None], a_s[None, :] - b_G, float("-inf"))))
    acc_A += dot(q_s * b_rf, b_col, DOT, FINITE=True)  # NaN also reaches o through Q̃, W (round_tf32_finite)
    acc_L += dot(k_s * b_rf, b_col, DOT, FINITE=True)
    return acc_A, acc_L


def check_launch() -> None:
    """Raise ``ValueError`` unless :data:`LAUNCH` has its keys, each of its kind
    (:func:`~openk3.ops.kda.triton.kernel_math.check_launch_entries`)."""
    check_launch_entries(
        "chunk_prepare",
        LAUNCH,
        dict(num_warps="warps", num_stages="stages", maxnreg="count", key_block="block", wy_block="block",
             fp16_inverse="bool", cumsum_by_dot="bool"),
    )  # fmt: skip


@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias,
    w, u, qg, kg, Aqk, Akk, gend, q_rstd, k_rstd,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, HEADS_FIRST: tl.constexpr,
    DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BK2: tl.constexpr, BV2: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PASS1: tl.constexpr, FP16: tl.constexpr,
    SCAN_BY_DOT: tl.constexpr, BETA_SIGMOID: tl.constexpr, STORE_U: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P chunks, H)``. Writes ``w, u, qg, kg`` ``[tokens, H, K|V]``, ``Aqk`` and ``Akk``
    (= T) ``[tokens, H, BT]``, ``gend`` = D ``[P, H, K]`` and the l2norm ``1/‖·‖`` ``[tokens, H]``; without
    ``PASS1`` it reads ``Akk``, ``q_rstd``, ``k_rstd`` instead and writes only ``w, u, qg, kg, gend``; without
    ``STORE_U`` it neither forms nor writes ``u``."""
    i_c, i_h = chunk_program(H, HEADS_FIRST)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    o_t = tl.arange(0, BT)

    if PASS1:
        # ---- pass 1, by key slices: raw Aqk and L accumulated over channels, and the row norms.
        # Row block s is anchored at a_s = Γ before it (anchor_block_products): one [BC, BK] × [BK, BT]
        # product per block and matrix; the four row blocks are glued back after the slices.
        acc_A0 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_A1 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_A2 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_A3 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_L0 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_L1 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_L2 = tl.zeros([BC, BT], dtype=tl.float32)
        acc_L3 = tl.zeros([BC, BT], dtype=tl.float32)
        ss_q = tl.zeros([BT], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        a_0 = tl.zeros([BK], dtype=tl.float32)
        for i_k in range(0, K // BK):
            k0 = i_k * BK
            b_G, _ = gate_cumsum_slice(
                g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, H, K, BT, BK, HAS_BIAS, SCAN_BY_DOT
            )
            b_q = load_rows(q, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32)
            b_k = load_rows(k, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32)
            ss_q += tl.sum(b_q * b_q, axis=1)
            ss_k += tl.sum(b_k * b_k, axis=1)
            G0, G1, G2, G3 = split4_rows(b_G, BT, BK)
            q0, q1, q2, q3 = split4_rows(b_q, BT, BK)
            k0_, k1_, k2_, k3_ = split4_rows(b_k, BT, BK)
            a_1 = row_at(G0, BC - 1, BC)
            a_2 = row_at(G1, BC - 1, BC)
            a_3 = row_at(G2, BC - 1, BC)
            acc_A0, acc_L0 = anchor_block_products(acc_A0, acc_L0, q0, k0_, G0, a_0, b_k, b_G, 0, BT, BC, DOT)
            acc_A1, acc_L1 = anchor_block_products(acc_A1, acc_L1, q1, k1_, G1, a_1, b_k, b_G, 1, BT, BC, DOT)
            acc_A2, acc_L2 = anchor_block_products(acc_A2, acc_L2, q2, k2_, G2, a_2, b_k, b_G, 2, BT, BC, DOT)
            acc_A3, acc_L3 = anchor_block_products(acc_A3, acc_L3, q3, k3_, G3, a_3, b_k, b_G, 3, BT, BC, DOT)
        acc_A = cat4_rows(acc_A0, acc_A1, acc_A2, acc_A3, BC, BT)
        acc_L = cat4_rows(acc_L0, acc_L1, acc_L2, acc_L3, BC, BT)

        # ---- norms and β: Aqk_ij = scale·rq_i·rk_j·acc_ij (i ≥ j), L_ij = β_i·rk_i·rk_j·acc_ij (i > j)
        if USE_L2NORM:
            b_rq = tl.rsqrt(ss_q + 1e-6)
            b_rk = tl.rsqrt(ss_k + 1e-6)
        else:
            b_rq = tl.full([BT], 1.0, tl.float32)
            b_rk = tl.full([BT], 1.0, tl.float32)
        store_row_vec(q_rstd, b_rq, t0, n_valid, i_h, H, BT)
        store_row_vec(k_rstd, b_rk, t0, n_valid, i_h, H, BT)
        b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
        b_A = tl.where(o_t[:, None] >= o_t[None, :], acc_A * (b_rq * scale)[:, None] * b_rk[None, :], 0.0)
        store_rows(Aqk, b_A, t0, n_valid, i_h, 0, H, BT, BT, BT)
        b_L = tl.where(o_t[:, None] > o_t[None, :], acc_L * (b_beta * b_rk)[:, None] * b_rk[None, :], 0.0)
        b_T = unit_lower_inverse(b_L, BT, BC, DOT, FP16)
        store_rows(Akk, b_T, t0, n_valid, i_h, 0, H, BT, BT, BT)
    else:  # the backward: T and the norms saved by the forward
        b_T = load_rows(Akk, t0, n_valid, i_h, 0, H, BT, BT, BT).to(tl.float32)  # fp16 T: tf32-exact
        b_rq = load_row_vec(q_rstd, t0, n_valid, i_h, H, BT)
        b_rk = load_row_vec(k_rstd, t0, n_valid, i_h, H, BT)
        b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)

    # ---- pass 2, by key / value slices: Γ from the chunk start (all factors ≤ 1), W, U, Q̃, K̂, D
    b_rq = b_rq * scale
    if FP16 and PASS1:  # T as the backward reads it back (fp16, exact in tf32): both passes compute one U
        b_Tu = b_T.to(tl.float16).to(tl.float32)
    elif FP16:  # loaded from fp16 already
        b_Tu = b_T
    else:
        b_Tu = tf32_operand(b_T, DOT)  # rounded once for U's products
    for i_k in range(0, K // BK2):
        k0 = i_k * BK2
        b_G, b_GC = gate_cumsum_slice(
            g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, H, K, BT, BK2, HAS_BIAS, SCAN_BY_DOT
        )
        b_eG = tl.exp2(b_G)
        b_q = load_rows(q, t0, n_valid, i_h, k0, H, K, BT, BK2).to(tl.float32)
        store_rows(qg, b_q * b_rq[:, None] * b_eG, t0, n_valid, i_h, k0, H, K, BT, BK2)
        b_k = load_rows(k, t0, n_valid, i_h, k0, H, K, BT, BK2).to(tl.float32) * b_rk[:, None]
        store_rows(kg, b_k * tl.exp2(b_GC[None, :] - b_G), t0, n_valid, i_h, k0, H, K, BT, BK2)
        b_w = bounded_dot(b_T, b_k * b_eG * b_beta[:, None], DOT, FP16)
        store_rows(w, b_w, t0, n_valid, i_h, k0, H, K, BT, BK2)
        tl.store(gend + (i_c.to(tl.int64) * H + i_h) * K + k0 + tl.arange(0, BK2), tl.exp2(b_GC))
    if STORE_U:
        for i_v in range(0, V // BV2):
            b_v = load_rows(v, t0, n_valid, i_h, i_v * BV2, H, V, BT, BV2).to(tl.float32)
            b_u = tl.dot(b_Tu, tf32_operand(b_v * b_beta[:, None], DOT), input_precision=DOT)
            store_rows(u, b_u, t0, n_valid, i_h, i_v * BV2, H, V, BT, BV2)


class Prepared(NamedTuple):
    """Outputs of :func:`chunk_prepare`; token tensors are ``[tokens, H, ·]``, per-chunk ``[P, H, K]``."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    gend: torch.Tensor
    q_rstd: torch.Tensor
    k_rstd: torch.Tensor


def fp16_inverse(dtype: torch.dtype, use_l2norm: bool) -> bool:
    """Whether ``T`` is computed and saved in fp16 (:data:`LAUNCH` ``["fp16_inverse"]``, bf16/fp16 inputs, the
    in-kernel L2 norm)."""
    return LAUNCH["fp16_inverse"] and use_l2norm and dtype != torch.float32


def prepared_layout(q: torch.Tensor, v: torch.Tensor, index: ChunkIndex, *, use_l2norm: bool) -> Prepared:
    """``(shape, dtype)`` of each :class:`Prepared` tensor for ``q`` ``[tokens, H, K]`` and ``v``
    ``[tokens, H, V]`` in chunks ``index``, as :func:`chunk_prepare` writes them."""
    TT, H, K = q.shape
    dt, f32 = q.dtype, torch.float32
    return Prepared(
        w=((TT, H, K), dt),
        u=((TT, H, v.shape[-1]), dt),
        qg=((TT, H, K), dt),
        kg=((TT, H, K), dt),
        Aqk=((TT, H, CHUNK), dt),
        Akk=((TT, H, CHUNK), torch.float16 if fp16_inverse(dt, use_l2norm) else f32),
        gend=((index.num_chunks, H, K), f32),
        q_rstd=((TT, H), f32),
        k_rstd=((TT, H), f32),
    )


def empty_prepared(
    q: torch.Tensor,
    v: torch.Tensor,
    index: ChunkIndex,
    *,
    use_l2norm: bool,
    saved: Prepared | None = None,
    store_u: bool = True,
) -> Prepared:
    """Uninitialised :class:`Prepared` tensors (:func:`prepared_layout`); ``saved``'s tensors (the forward's
    ``Aqk``, ``Akk`` and norms) are used as they are; without ``store_u``, ``u`` is None unless ``saved``
    has one."""
    layout = prepared_layout(q, v, index, use_l2norm=use_l2norm)
    kept = saved._asdict() if saved is not None else {}
    tensors = {}
    for name, (shape, dtype) in layout._asdict().items():
        if kept.get(name) is not None:
            tensors[name] = kept[name]
        elif name == "u" and not store_u:
            tensors[name] = None
        else:
            tensors[name] = q.new_empty(shape, dtype=dtype)
    return Prepared(**tensors)


def chunk_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    index: ChunkIndex,
    *,
    scale: float,
    lower_bound: float,
    use_l2norm: bool,
    beta_sigmoid: bool = False,
    saved: Prepared | None = None,
    out: Prepared | None = None,
    store_u: bool = True,
) -> Prepared:
    """Launch :func:`chunk_prepare_kernel`.

    Args:
        q, k, g: ``[tokens, H, K]`` (g is the raw gate). v: ``[tokens, H, V]``. beta: ``[tokens, H]``.
        A_log: ``[H]``; dt_bias: ``[H*K]`` or None. index: the chunk tables.
        scale, lower_bound, use_l2norm: as in :func:`~openk3.ops.kda.chunk.chunk_kda`.
        beta_sigmoid: ``beta`` holds logits and the kernels use ``σ(beta)``
            (``use_beta_sigmoid_in_kernel``).
        saved: the forward's result; its ``Aqk``, ``Akk`` and norms are reused and only ``W``, ``U``, ``Q̃``,
            ``K̂``, ``D`` are recomputed (the backward's cheaper second pass).
        out: the tensors to write (from :func:`empty_prepared`, with ``saved``'s own where given), or None to
            allocate them.
        store_u: form and write ``U``; without it ``out.u`` may be None and is left as it is (a backward whose
            state pass reads the residuals the forward kept needs no ``U``).

    Raises:
        ValueError: a tensor of ``out`` of another shape or dtype, or not contiguous
            (:func:`~openk3.ops.kda.triton.kernel_math.check_outs`).

    Returns:
        :class:`Prepared`: ``w, qg, kg`` ``[tokens, H, K]`` and ``u`` ``[tokens, H, V]`` in the storage dtype
        (q's dtype, fp32 for fp32 inputs), ``Aqk`` in the storage dtype and ``Akk`` = T in fp32 (fp16 with
        ``LAUNCH["fp16_inverse"]``), both
        ``[tokens, H, 64]``, ``gend`` fp32 ``[P, H, K]``, the l2norm reciprocal norms fp32 ``[tokens, H]``
        (ones without the norm); ``u`` None with ``store_u`` off and no ``out``.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    P = index.num_chunks
    fp16 = fp16_inverse(q.dtype, use_l2norm)
    if out is None:
        out = empty_prepared(q, v, index, use_l2norm=use_l2norm, saved=saved, store_u=store_u)
    else:
        layout = prepared_layout(q, v, index, use_l2norm=use_l2norm)
        check_outs("chunk_prepare out", out, layout, q.device, optional=() if store_u else ("u",))
    if P == 0:
        return out
    # the first pass (no saved) keeps the (chunks, H) grid: slower heads first (kernel_math.LAUNCH)
    heads_first = kernel_math.LAUNCH["heads_first"] and saved is not None
    chunk_prepare_kernel[chunk_grid(P, H, heads_first=heads_first)](
        q, k, v, g, beta, A_log, dt_bias,
        out.w, out.u, out.qg, out.kg, out.Aqk, out.Akk, out.gend, out.q_rstd, out.k_rstd,
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, HEADS_FIRST=heads_first, DOT=dot_precision(q.dtype), K=K, V=V, BT=CHUNK, BC=SUB_CHUNK,
        BK=min(K, LAUNCH["key_block"]), BK2=min(K, LAUNCH["wy_block"]), BV2=min(V, LAUNCH["wy_block"]),
        USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None, PASS1=saved is None,
        FP16=fp16, SCAN_BY_DOT=LAUNCH["cumsum_by_dot"], BETA_SIGMOID=beta_sigmoid, STORE_U=store_u,
        **launch_options(LAUNCH),
    )  # fmt: skip
    return out
