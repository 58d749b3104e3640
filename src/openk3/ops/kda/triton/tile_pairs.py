"""The KDA forward on pairs of 16-token tiles: the tile forward of :mod:`~openk3.ops.kda.triton.tile_forward`
with its recurrence stepping 32 tokens at a time, for calls without a gradient.

The recurrence's tile step is bound by the latency of its chain through the state (docs/references.md#flashkda: one program per value
block and head, each step three dependent products). Two tiles per step halve the steps for less than twice
the step's latency. What the 32-token step needs is written by a prepare that works on pairs of tiles, so
that the recurrence is
:func:`~openk3.ops.kda.triton.tile_forward.tile_recurrence_kernel` unchanged with ``BT = 32``.

Per pair of tiles ``a``, ``b`` (Γ each tile's gate cumsum from its own start, ``Q̃``, ``K̃``, ``K̂``, ``M``,
``P``, ``D`` each tile's as in :mod:`~openk3.ops.kda.triton.tile_forward`), the state ``S`` before ``a``,
``X = V − K̃ S``::

    S_a = D_a S + K̂_aᵀ E_a,   E_a = P_a X_a
    E_b = P_b (V_b − K̃_b S_a) = P_b (X'_b − C E_a),   X'_b = V_b − (K̃_b ⊙ D_a) S,   C = K̃_b K̂_aᵀ
    O_b = Q̃_b S_a + M_b E_b = (Q̃_b ⊙ D_a) S + F E_a + M_b E_b,   F = Q̃_b K̂_aᵀ
    S_b = D_a D_b S + [K̂_a ⊙ D_b; K̂_b]ᵀ [E_a; E_b]

which is the tile step ``E = P₂ (V − K̃₂ S)``, ``O = Q̃₂ S + M₂ E``, ``S ← Diag(D₂) S + K̂₂ᵀ E`` over 32 rows
with::

    K̃₂ = [K̃_a; K̃_b ⊙ D_a]   Q̃₂ = [Q̃_a; Q̃_b ⊙ D_a]   K̂₂ = [K̂_a ⊙ D_b; K̂_b]   D₂ = D_a D_b
    P₂ = [[P_a, 0], [−P_b C P_a, P_b]]      M₂ = [[M_a, 0], [F, M_b]]

``K̃₂``, ``Q̃₂`` are the keys and queries decayed from the pair's start and ``K̂₂`` the keys decayed to its
end: every factor is ``2^{Γ_i − Γ_j} ≤ 1`` with ``i`` after ``j``, so they are bounded by the inputs (a
factor past fp32's range is a contribution below 2^-126 of the input's size, flushed to 0). ``C`` and ``F``
are formed from each tile's own anchors (``K̂_a`` decayed to ``a``'s end, ``Q̃_b``, ``K̃_b`` from ``b``'s
start), as the 64-token chunks' blocks are (docs/references.md#kda-gate-factors), never from a product of ``2^{−Γ}`` over 32 tokens
(up to ``2^{230}``). ``P₂`` is ``(I + L₂)^{-1} Diag(β)`` of the 32 rows (block substitution), stored in
fp16 under the same condition as the tile's ``P`` (unit keys, ``β ≤ 1``: entries bounded by 1).

The prepare is one warp per pair and head (grid ``chunk_grid(P32, H)``): tile ``a`` as the tile prepare
does it, then tile ``b``, whose key slices also form ``C`` and ``F`` from ``K̂_a`` as stored, write ``Q̃_b``
and ``K̃_b`` times ``D_a``, and rewrite ``K̂_a`` times ``D_b`` (so ``K̂_a`` is rounded to the storage dtype
twice).

:func:`~openk3.ops.kda.triton.chunk_function.chunk_kda_triton` takes this path for a call without a gradient
when :func:`use_pairs`: the recurrence has at most one program per multiprocessor, where it is bound by its
step's latency. With more programs the 32-token step's registers (212 against 136 at ``BV = 32``) fit fewer
programs per multiprocessor and the tile forward is faster. With bf16 inputs and nearly parallel keys its
error against fp64 is a little larger than the tile forward's, since its second tile's residual is the one
tf32 product ``P_b X'_b − P_b C P_a X_a`` where the tile step takes ``V_b − K̃_b S_a`` in fp32 first.

Legend: ``BT`` tile rows, ``BK`` key slice, ``K`` key dim, ``H`` heads, ``P32`` pairs of all sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import ChunkIndex
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, DEFAULT_OPTIONS, KDAOptions, LaunchConfig
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    check_outs,
    chunk_grid,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    load_rows,
    store_rows,
    tf32_operand,
)
from openk3.ops.kda.triton.pipeline import overlaps
from openk3.ops.kda.triton.tile_forward import (
    TILE,
    TilePrepared,
    empty_tile_prepared,
    gated_slice,
    row_rstd,
    tile_factors,
    tile_prepared_layout,
    tile_recurrence,
)

PAIR = 2 * TILE
"""Tokens per recurrence step of the pair forward."""


def use_pairs(programs: int, device: torch.device) -> bool:
    """Whether a call without a gradient whose recurrence runs ``programs`` programs
    (:func:`~openk3.ops.kda.triton.chunk_state.state_programs` with the recurrence's value block) runs on
    pairs of tiles: at most one program per multiprocessor of a CUDA ``device``
    (:func:`~openk3.ops.kda.triton.pipeline.overlaps`; never on CPU)."""
    return overlaps(device, programs)


@triton.jit
def pair_prepare_kernel(
    q, k, g, beta, A_log, dt_bias,
    qg, kt, kh, M, Pb, gend,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P32, H)``. Writes ``qg`` = Q̃₂, ``kt`` = K̃₂, ``kh`` = K̂₂ ``[tokens, H, K]``,
    ``M`` = M₂ and ``Pb`` = P₂ ``[tokens, H, 2·BT]``, ``gend`` = D₂ ``[P32, H, K]`` (module docstring)."""
    i_c, i_h = chunk_program(H)
    t_a, n_pair = chunk_rows(cu_seqlens, chunk_table, i_c, 2 * BT)
    n_a = tl.minimum(n_pair, BT)
    n_b = tl.maximum(n_pair - BT, 0)  # 0: a pair of one tile (its decay D_b is 1)
    t_b = t_a + BT
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    p_gend = gend + (i_c.to(tl.int64) * H + i_h) * K + tl.arange(0, BK)
    zero = tl.zeros([BT, BT], dtype=tl.float32)

    # tile a, as the tile prepare; K̂_a and D_a are rewritten times D_b by tile b's pass
    b_rq, b_rk = row_rstd(q, k, t_a, n_a, i_h, H, K, BT, BK, USE_L2NORM)
    b_rq = b_rq * scale
    acc_M = zero
    acc_L = zero
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        b_qg, b_kt, b_kinv, b_GCe = gated_slice(
            q, k, g, t_a, n_a, i_h, A_h, dt_bias, k0, lower_bound_log2, b_rq, b_rk, H, K, BT, BK, HAS_BIAS
        )
        b_kinvT = tf32_operand(tl.trans(b_kinv), DOT, True)
        acc_M = tl.dot(tf32_operand(b_qg, DOT, True), b_kinvT, acc_M, input_precision=DOT)
        acc_L = tl.dot(tf32_operand(b_kt, DOT, True), b_kinvT, acc_L, input_precision=DOT)
        store_rows(qg, b_qg, t_a, n_a, i_h, k0, H, K, BT, BK)
        store_rows(kt, b_kt, t_a, n_a, i_h, k0, H, K, BT, BK)
        store_rows(kh, b_kinv * b_GCe[None, :], t_a, n_a, i_h, k0, H, K, BT, BK)
        tl.store(p_gend + k0, b_GCe)
    b_Ma, b_Ta, b_beta = tile_factors(acc_M, acc_L, beta, t_a, n_a, i_h, H, BT, BETA_SIGMOID)
    store_rows(M, b_Ma, t_a, n_a, i_h, 0, H, 2 * BT, BT, BT)
    store_rows(M, zero, t_a, n_a, i_h, BT, H, 2 * BT, BT, BT)
    store_rows(Pb, b_Ta * b_beta[None, :], t_a, n_a, i_h, 0, H, 2 * BT, BT, BT)
    store_rows(Pb, zero, t_a, n_a, i_h, BT, H, 2 * BT, BT, BT)
    tl.debug_barrier()  # tile b's pass reads K̂_a, D_a and P_a back

    # tile b, with the cross products C = K̃_b K̂_aᵀ, F = Q̃_b K̂_aᵀ on K̂_a as stored
    b_rq, b_rk = row_rstd(q, k, t_b, n_b, i_h, H, K, BT, BK, USE_L2NORM)
    b_rq = b_rq * scale
    acc_M = zero
    acc_L = zero
    acc_F = zero
    acc_C = zero
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        b_qg, b_kt, b_kinv, b_GCe = gated_slice(
            q, k, g, t_b, n_b, i_h, A_h, dt_bias, k0, lower_bound_log2, b_rq, b_rk, H, K, BT, BK, HAS_BIAS
        )
        # the stores first, so that only the rounded operands stay live for the four products
        b_Da = tl.load(p_gend + k0)
        store_rows(qg, b_qg * b_Da[None, :], t_b, n_b, i_h, k0, H, K, BT, BK)
        store_rows(kt, b_kt * b_Da[None, :], t_b, n_b, i_h, k0, H, K, BT, BK)
        store_rows(kh, b_kinv * b_GCe[None, :], t_b, n_b, i_h, k0, H, K, BT, BK)
        tl.store(p_gend + k0, b_Da * b_GCe)
        b_qg = tf32_operand(b_qg, DOT, True)
        b_kt = tf32_operand(b_kt, DOT, True)
        b_kinvT = tf32_operand(tl.trans(b_kinv), DOT, True)
        acc_M = tl.dot(b_qg, b_kinvT, acc_M, input_precision=DOT)
        acc_L = tl.dot(b_kt, b_kinvT, acc_L, input_precision=DOT)
        b_kha = load_rows(kh, t_a, n_a, i_h, k0, H, K, BT, BK).to(tl.float32)
        store_rows(kh, b_kha * b_GCe[None, :], t_a, n_a, i_h, k0, H, K, BT, BK)
        b_khaT = tf32_operand(tl.trans(b_kha), DOT, True)
        acc_F = tl.dot(b_qg, b_khaT, acc_F, input_precision=DOT)
        acc_C = tl.dot(b_kt, b_khaT, acc_C, input_precision=DOT)
    b_Mb, b_Tb, b_beta = tile_factors(acc_M, acc_L, beta, t_b, n_b, i_h, H, BT, BETA_SIGMOID)
    b_Pb = b_Tb * b_beta[None, :]
    b_Pa = load_rows(Pb, t_a, n_a, i_h, 0, H, 2 * BT, BT, BT).to(tl.float32)  # as stored (its dtype)
    b_Pba = -dot(dot(b_Pb, acc_C, DOT), b_Pa, DOT)
    store_rows(M, acc_F, t_b, n_b, i_h, 0, H, 2 * BT, BT, BT)
    store_rows(M, b_Mb, t_b, n_b, i_h, BT, H, 2 * BT, BT, BT)
    store_rows(Pb, b_Pba, t_b, n_b, i_h, 0, H, 2 * BT, BT, BT)
    store_rows(Pb, b_Pb, t_b, n_b, i_h, BT, H, 2 * BT, BT, BT)


def pair_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
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
    out: TilePrepared | None = None,
    fp32_gated_keys: bool = False,
    launch: LaunchConfig = DEFAULT_GEOMETRY,
) -> TilePrepared:
    """Launch :func:`pair_prepare_kernel` (arguments as in :func:`pair_forward`; ``out``: the tensors to
    write, ``empty_tile_prepared(q, index, use_l2norm=…, step=PAIR)``, or None to allocate them). The key
    slice and warps are the tile prepare's (``launch.tile_prepare``).

    Returns:
        :class:`~openk3.ops.kda.triton.tile_forward.TilePrepared` of 32-token steps.

    Raises:
        ValueError: a tensor of ``out`` of another shape or dtype, or not contiguous.
    """
    TT, H, K = q.shape
    BK = min(K, launch.tile_prepare.key_block)
    layout = tile_prepared_layout(q, index, use_l2norm=use_l2norm, step=PAIR, fp32_gated_keys=fp32_gated_keys)
    if out is None:
        out = empty_tile_prepared(q, index, use_l2norm=use_l2norm, step=PAIR, fp32_gated_keys=fp32_gated_keys)
    else:
        check_outs("pair_prepare out", out, layout, q.device)
    pair_prepare_kernel[chunk_grid(index.num_chunks, H)](
        q, k, g, beta, A_log, dt_bias, *out,
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, DOT=dot_precision(q.dtype), K=K, BT=TILE, BK=BK,
        USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None, BETA_SIGMOID=beta_sigmoid,
        **launch.tile_prepare.options(),
    )  # fmt: skip
    return out


def pair_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    index: ChunkIndex,
    *,
    scale: float,
    lower_bound: float,
    use_l2norm: bool,
    output_final_state: bool,
    beta_sigmoid: bool = False,
    options: KDAOptions = DEFAULT_OPTIONS,
    launch: LaunchConfig = DEFAULT_GEOMETRY,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward of the chunked KDA on pairs of 16-token tiles (no autograd): :func:`pair_prepare` then
    :func:`~openk3.ops.kda.triton.tile_forward.tile_recurrence` stepping 32 tokens. Arguments and result as
    in :func:`~openk3.ops.kda.triton.tile_forward.tile_forward`, except ``index``: steps of :data:`PAIR`
    tokens (``chunk_index`` with ``size=PAIR``)."""
    pre = pair_prepare(
        q, k, g, beta, A_log, dt_bias, index, scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm,
        beta_sigmoid=beta_sigmoid, fp32_gated_keys=options.fp32_gated_keys, launch=launch,
    )  # fmt: skip
    return tile_recurrence(
        pre, v, initial_state, index, output_final_state=output_final_state, launch=launch.tile_recurrence,
        state_launch=launch.chunk_state,
    )  # fmt: skip
