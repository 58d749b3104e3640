"""The KDA forward on 16-token tiles (FlashKDA's split, docs/references.md#flashkda): a token-parallel prepare
and a sequential recurrence that forms the delta-rule residuals itself, so nothing of size ``[tokens, H, K]``
beyond three gated copies of q and k is written. With a backward to come, the prepare also writes each tile's
``(I + L)^{-1}`` and the norms (``for_backward``), from which
:mod:`~openk3.ops.kda.triton.chunk_from_tiles` builds what the 64-token backward saves.

Per tile of ``BT = 16`` tokens and head, with Γ the inclusive cumsum of the log2 gate over the tile (Γ_C its
last valid row; ``|Γ| ≤ 16·|lb|·log2 e = 115.4`` for ``lb = −5``, inside fp32's and bf16's range)::

    Q̃ = scale·Q ⊙ 2^{Γ}      K̃ = K ⊙ 2^{Γ}      K̂ = K ⊙ 2^{Γ_C − Γ}      D = 2^{Γ_C}   (L2-normalised Q, K)
    M_ij = Σ_d Q̃_id K_jd 2^{−Γ_jd}  (i ≥ j)          L_ij = β_i Σ_d K̃_id K_jd 2^{−Γ_jd}  (i > j)
    P  = (I + L)^{-1} Diag(β)                          (fp32 substitution)

and the recurrence, from the state ``S`` before the tile (docs/references.md#kda-chunked-form with ``W = P K̃``, ``U = P V``)::

    E = P (V − K̃ S)        O = Q̃ S + M E        S ← Diag(D) S + K̂ᵀ E

``M`` and ``L`` are single products: their factor ``2^{Γ_i − Γ_j}`` is ≤ 1 where kept (``i ≥ j``) and at most
``2^{115}`` where masked, so no anchor is needed (the 64-token chunks of
:mod:`~openk3.ops.kda.triton.chunk_prepare` need four). The state, ``E`` and ``O`` are as in
:mod:`~openk3.ops.kda.triton.chunk_state` (fp32 state, matmul operands in the storage dtype). ``P`` is saved in
fp16 under :func:`~openk3.ops.kda.triton.chunk_prepare.fp16_inverse`'s condition (bf16/fp16 inputs, the
in-kernel L2 norm: unit keys and ``β ≤ 1`` bound it by 1), else in fp32; ``E = P X`` is a tf32 product with
both operands rounded (:func:`~openk3.ops.kda.triton.kernel_math.dot`; an fp16 ``P`` is exact in tf32), tf32x3
for fp32 inputs.

The prepare is one warp per tile and head: it walks the key in slices of ``key_block`` channels, the row
norms first, then the gate, the gated copies and ``M``, ``L`` accumulated slice by slice, so every row
reduction of the 16×16 substitution stays inside the warp.

Every call without a gradient runs this forward (:func:`tile_forward`; with at most one recurrence program per
multiprocessor, on pairs of tiles, :mod:`~openk3.ops.kda.triton.tile_pairs`), and so does the training forward
(:mod:`~openk3.ops.kda.triton.chunk_function`). Legend: ``BT`` tile rows, ``BK`` key slice, ``K``/``V``
key/value dims, ``BV`` value block, ``H`` heads, ``N`` sequences, ``P16`` tiles of all sequences.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import fp16_inverse
from openk3.ops.kda.triton.chunk_state import value_block
from openk3.ops.kda.triton.config import (
    DEFAULT_GEOMETRY,
    DEFAULT_OPTIONS,
    KDAOptions,
    KernelLaunch,
    LaunchConfig,
    StateLaunch,
)
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    check_index,
    check_out,
    check_outs,
    chunk_grid,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    empty_outs,
    gate_cumsum_slice,
    load_beta,
    load_rows,
    state_program,
    store_row_vec,
    store_rows,
    tf32_operand,
    unit_lower_inverse_stacked,
)

TILE = 16
"""Tokens per tile (FlashKDA's chunk; the bound ``16·|lb|·log2 e ≤ 115.4`` needs ``lb ≥ −5``)."""


@triton.jit
def tile_prepare_kernel(
    q, k, g, beta, A_log, dt_bias,
    qg, kt, kh, M, Pb, gend, Td, q_rstd, k_rstd,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, FOR_BACKWARD: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P16, H)``. Writes ``qg`` = Q̃, ``kt`` = K̃, ``kh`` = K̂ ``[tokens, H, K]``, ``M`` and
    ``Pb`` = P ``[tokens, H, BT]``, ``gend`` = D ``[P16, H, K]``; with ``FOR_BACKWARD`` also ``Td`` =
    ``(I + L)^{-1}`` ``[tokens, H, BT]`` (P's dtype) and the l2norm ``1/‖·‖`` ``[tokens, H]`` (fp32; ones
    without the norm)."""
    i_c, i_h = chunk_program(H)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    # the row norms first (a per-row factor of every later product), then the gated copies and the two
    # intra-tile products accumulated over key slices of BK channels (the gate is per channel)
    b_rq, b_rk = row_rstd(q, k, t0, n_valid, i_h, H, K, BT, BK, USE_L2NORM)
    if FOR_BACKWARD:  # as chunk_prepare writes them
        store_row_vec(q_rstd, b_rq, t0, n_valid, i_h, H, BT)
        store_row_vec(k_rstd, b_rk, t0, n_valid, i_h, H, BT)
    b_rq = b_rq * scale
    acc_M = tl.zeros([BT, BT], dtype=tl.float32)
    acc_L = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        b_qg, b_kt, b_kinv, b_GCe = gated_slice(
            q, k, g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, b_rq, b_rk, H, K, BT, BK, HAS_BIAS
        )
        # rounded once for both products; a NaN also reaches o through Q̃, K̃, K̂ (round_tf32_finite)
        b_kinvT = tf32_operand(tl.trans(b_kinv), DOT, True)
        acc_M = tl.dot(tf32_operand(b_qg, DOT, True), b_kinvT, acc_M, input_precision=DOT)
        acc_L = tl.dot(tf32_operand(b_kt, DOT, True), b_kinvT, acc_L, input_precision=DOT)
        store_rows(qg, b_qg, t0, n_valid, i_h, k0, H, K, BT, BK)
        store_rows(kt, b_kt, t0, n_valid, i_h, k0, H, K, BT, BK)
        store_rows(kh, b_kinv * b_GCe[None, :], t0, n_valid, i_h, k0, H, K, BT, BK)
        tl.store(gend + (i_c.to(tl.int64) * H + i_h) * K + k0 + tl.arange(0, BK), b_GCe)
    b_M, b_T, b_beta = tile_factors(acc_M, acc_L, beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    store_rows(M, b_M, t0, n_valid, i_h, 0, H, BT, BT, BT)
    store_rows(Pb, b_T * b_beta[None, :], t0, n_valid, i_h, 0, H, BT, BT, BT)
    if FOR_BACKWARD:
        store_rows(Td, b_T, t0, n_valid, i_h, 0, H, BT, BT, BT)


@triton.jit
def row_rstd(q, k, t0, n_valid, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
             USE_L2NORM: tl.constexpr):  # fmt: skip
    """The L2-norm factors ``1/‖q‖``, ``1/‖k‖`` ``[BT]`` (fp32, ``rsqrt(Σ x² + 1e-6)`` as fla's in-kernel
    norm) of a tile's rows, summed over key slices of ``BK``; ones without ``USE_L2NORM``."""
    if USE_L2NORM:
        ss_q = tl.zeros([BT], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(0, K // BK):
            b_q = load_rows(q, t0, n_valid, i_h, i_k * BK, H, K, BT, BK).to(tl.float32)
            b_k = load_rows(k, t0, n_valid, i_h, i_k * BK, H, K, BT, BK).to(tl.float32)
            ss_q += tl.sum(b_q * b_q, axis=1)
            ss_k += tl.sum(b_k * b_k, axis=1)
        b_rq = tl.rsqrt(ss_q + 1e-6)
        b_rk = tl.rsqrt(ss_k + 1e-6)
    else:
        b_rq = tl.full([BT], 1.0, tl.float32)
        b_rk = tl.full([BT], 1.0, tl.float32)
    return b_rq, b_rk


@triton.jit
def gated_slice(q, k, g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, b_rq, b_rk,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """Channels ``k0..k0+BK`` of a tile (Γ its gate's cumsum from the tile's start): ``Q̃ = q·rq·2^Γ``
    (``b_rq`` carries the scale), ``K̃ = k·rk·2^Γ``, ``k·rk·2^{−Γ}`` (≤ 2^115) ``[BT, BK]`` fp32 and
    ``D = 2^{Γ_C}`` ``[BK]`` (Γ_C at the last valid row)."""
    b_G, b_GC = gate_cumsum_slice(
        g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, H, K, BT, BK, HAS_BIAS, False
    )
    b_q = load_rows(q, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rq[:, None]
    b_k = load_rows(k, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32) * b_rk[:, None]
    b_eG = tl.exp2(b_G)
    b_kinv = b_k * tl.exp2(-b_G)  # ≤ 2^115
    return b_q * b_eG, b_k * b_eG, b_kinv, tl.exp2(b_GC)


@triton.jit
def tile_factors(acc_M, acc_L, beta, t0, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr):  # fmt: skip
    """From a tile's summed products ``Q̃ K^{-Γ}ᵀ`` and ``K̃ K^{-Γ}ᵀ`` ``[BT, BT]``: ``M`` (lower triangle
    with the diagonal), ``T = (I + L)^{-1}`` with ``L = Diag(β)·`` the strict lower triangle (fp32
    substitution, :func:`~openk3.ops.kda.triton.kernel_math.unit_lower_inverse_stacked`) and β ``[BT]``
    (rows past ``n_valid`` 0)."""
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    o = tl.arange(0, BT)
    b_M = tl.where(o[:, None] >= o[None, :], acc_M, 0.0)
    b_L = tl.where(o[:, None] > o[None, :], acc_L * b_beta[:, None], 0.0)
    b_T = tl.reshape(unit_lower_inverse_stacked(tl.reshape(b_L, [1, BT, BT]), 1, BT), [BT, BT])
    return b_M, b_T, b_beta


@triton.jit
def tile_recurrence_kernel(
    qg, kt, kh, M, Pb, gend, v, h0, o, ht, e,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_E: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``: one value block of one sequence and head, its tiles in order. ``h0``/``ht`` fp32
    ``[N, H, K, V]``; ``o`` ``[tokens, H, V]``; with ``STORE_E`` also the residuals ``E`` into ``e``
    ``[tokens, H, V]``, rounded to ``e``'s dtype (``M``'s, the storage dtype; with ``fp32_gated_keys`` the
    recurrence's own products take them in fp32).

    The small loads of a tile (``V``, ``P``, ``M``, ``D``) are issued before its first product, so their
    latencies overlap the products instead of adding up along the state's dependency chain."""
    i_h, bos, eos, c0, v0, o_k, _, p_state = state_program(cu_seqlens, chunk_offsets, H, K, V, BV)
    dt = qg.dtype.element_ty
    if USE_H0:
        b_S = tl.load(h0 + p_state).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        n_valid = tl.minimum(eos - t0, BT).to(tl.int32)
        # the small loads first, the tensor-core operands (pipelined by num_stages) where they are used
        b_v = load_rows(v, t0, n_valid, i_h, v0, H, V, BT, BV).to(tl.float32)
        b_P = load_rows(Pb, t0, n_valid, i_h, 0, H, BT, BT, BT)
        b_M = load_rows(M, t0, n_valid, i_h, 0, H, BT, BT, BT)
        b_D = tl.load(gend + ((c0 + i_t) * H + i_h) * K + o_k)
        b_Sd = b_S.to(dt)
        b_x = b_v - dot(load_rows(kt, t0, n_valid, i_h, 0, H, K, BT, K), b_Sd, DOT)
        if Pb.dtype.element_ty == tl.float16:  # exact in tf32: no rounding
            b_P = b_P.to(tl.float32)
        else:
            b_P = tf32_operand(b_P, DOT)
        b_ed = tl.dot(b_P, tf32_operand(b_x, DOT), input_precision=DOT).to(dt)
        if STORE_E:
            store_rows(e, b_ed, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_o = dot(load_rows(qg, t0, n_valid, i_h, 0, H, K, BT, K), b_Sd, DOT)
        b_o += dot(b_M.to(dt), b_ed, DOT)
        store_rows(o, b_o, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_kh = load_rows(kh, t0, n_valid, i_h, 0, H, K, BT, K)
        b_S = b_S * b_D[:, None] + dot(tl.trans(b_kh), b_ed, DOT)
    if STORE_FINAL:
        tl.store(ht + p_state, b_S)


class TilePrepared(NamedTuple):
    """Outputs of :func:`tile_prepare`: ``qg, kt, kh`` ``[tokens, H, K]`` in the storage dtype (fp32 with
    ``KDAOptions.fp32_gated_keys``), ``M`` ``[tokens, H, TILE]`` in the storage dtype, ``P``
    ``[tokens, H, TILE]`` fp16 or fp32, ``gend`` fp32 ``[P16, H, K]``; for the pair forward
    (:mod:`~openk3.ops.kda.triton.tile_pairs`) the same of 32-token steps (``M``, ``P`` ``[tokens, H, 32]``,
    ``gend`` ``[P32, H, K]``)."""

    qg: torch.Tensor
    kt: torch.Tensor
    kh: torch.Tensor
    M: torch.Tensor
    P: torch.Tensor
    gend: torch.Tensor


def tile_prepared_layout(
    q: torch.Tensor, index: ChunkIndex, *, use_l2norm: bool, step: int = TILE, fp32_gated_keys: bool = False
) -> TilePrepared:
    """``(shape, dtype)`` of each :class:`TilePrepared` tensor for ``q`` ``[tokens, H, K]`` in steps of
    ``step`` tokens ``index`` (tiles of :data:`TILE`, or pairs of them): ``P`` in fp16 under
    :func:`~openk3.ops.kda.triton.chunk_prepare.fp16_inverse`'s condition (then ``|P_ij| ≤ 1``), else fp32;
    the gated keys in fp32 with ``fp32_gated_keys`` (:class:`~openk3.ops.kda.triton.config.KDAOptions`)."""
    TT, H, K = q.shape
    dt = q.dtype
    keys = ((TT, H, K), torch.float32 if fp32_gated_keys else dt)
    return TilePrepared(
        qg=keys,
        kt=keys,
        kh=keys,
        M=((TT, H, step), dt),
        P=((TT, H, step), torch.float16 if fp16_inverse(dt, use_l2norm) else torch.float32),
        gend=((index.num_chunks, H, K), torch.float32),
    )


class TileBackward(NamedTuple):
    """What :func:`tile_prepare` also writes for a backward (``for_backward``), from which
    :func:`~openk3.ops.kda.triton.chunk_from_tiles.chunk_from_tiles` builds the 64-token chunks' ``T``: ``Td``
    ``[tokens, H, TILE]``, each tile's ``(I + L)^{-1}`` (P's dtype), and the l2norm reciprocal norms
    ``q_rstd``, ``k_rstd`` fp32 ``[tokens, H]`` (ones without the norm), as
    :func:`~openk3.ops.kda.triton.chunk_prepare.chunk_prepare` writes them."""

    Td: torch.Tensor
    q_rstd: torch.Tensor
    k_rstd: torch.Tensor


def tile_backward_layout(q: torch.Tensor, *, use_l2norm: bool) -> TileBackward:
    """``(shape, dtype)`` of each :class:`TileBackward` tensor for ``q`` ``[tokens, H, K]``."""
    TT, H, _ = q.shape
    norms = ((TT, H), torch.float32)
    return TileBackward(
        Td=((TT, H, TILE), torch.float16 if fp16_inverse(q.dtype, use_l2norm) else torch.float32),
        q_rstd=norms,
        k_rstd=norms,
    )


def empty_tile_backward(q: torch.Tensor, *, use_l2norm: bool) -> TileBackward:
    """Uninitialised :class:`TileBackward` tensors (:func:`tile_backward_layout`)."""
    return empty_outs(q, tile_backward_layout(q, use_l2norm=use_l2norm))


def empty_tile_prepared(
    q: torch.Tensor, index: ChunkIndex, *, use_l2norm: bool, step: int = TILE, fp32_gated_keys: bool = False
) -> TilePrepared:
    """Uninitialised :class:`TilePrepared` tensors (:func:`tile_prepared_layout`)."""
    return empty_outs(
        q, tile_prepared_layout(q, index, use_l2norm=use_l2norm, step=step, fp32_gated_keys=fp32_gated_keys)
    )


def tile_prepare(
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
    for_backward: TileBackward | None = None,
    fp32_gated_keys: bool = False,
    launch: KernelLaunch = DEFAULT_GEOMETRY.tile_prepare,
) -> TilePrepared:
    """Launch :func:`tile_prepare_kernel` (arguments as in :func:`tile_forward`; ``out``: the tensors to
    write, from :func:`empty_tile_prepared`, or None to allocate them; ``for_backward``: also write the
    tiles' inverses and the norms there, from :func:`empty_tile_backward`; ``launch``: warps, stages and the
    key slice).

    Returns:
        :class:`TilePrepared` (``out`` when given).

    Raises:
        ValueError: a tensor of ``out`` or ``for_backward`` of another shape or dtype, or not contiguous.
    """
    TT, H, K = q.shape
    dt = q.dtype
    BK = min(K, launch.key_block)
    layout = tile_prepared_layout(q, index, use_l2norm=use_l2norm, fp32_gated_keys=fp32_gated_keys)
    if out is None:
        out = empty_outs(q, layout)
    else:
        check_outs("tile_prepare out", out, layout, q.device)
    if for_backward is not None:
        check_outs(
            "tile_prepare for_backward",
            for_backward,
            tile_backward_layout(q, use_l2norm=use_l2norm),
            q.device,
        )
    tile_prepare_kernel[chunk_grid(index.num_chunks, H)](
        q, k, g, beta, A_log, dt_bias,
        *out, *(for_backward or (None, None, None)),
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, DOT=dot_precision(dt), K=K, BT=TILE, BK=BK, USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None,
        BETA_SIGMOID=beta_sigmoid, FOR_BACKWARD=for_backward is not None, **launch.options(),
    )  # fmt: skip
    return out


def tile_recurrence(
    pre: TilePrepared,
    v: torch.Tensor,
    initial_state: torch.Tensor | None,
    index: ChunkIndex,
    *,
    output_final_state: bool,
    o_out: torch.Tensor | None = None,
    ht_out: torch.Tensor | None = None,
    e_out: torch.Tensor | None = None,
    launch: KernelLaunch = DEFAULT_GEOMETRY.tile_recurrence,
    state_launch: StateLaunch = DEFAULT_GEOMETRY.chunk_state,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch :func:`tile_recurrence_kernel` on :func:`tile_prepare`'s tensors, or
    :func:`~openk3.ops.kda.triton.tile_pairs.pair_prepare`'s (32 tokens a step: ``pre.M``'s last dim;
    arguments and result as in :func:`tile_forward`; ``o_out``, ``ht_out``: the tensors to write ``o`` and the
    final state to, or None to allocate them; ``e_out``: also write the delta-rule residuals ``E`` there,
    ``[tokens, H, V]`` in the inputs' storage dtype (``M``'s), the backward's ``v_new``; ``ValueError`` if any
    has another shape or dtype, or is not contiguous, or if ``index`` covers other tokens or tiles than
    ``pre``; ``launch``: warps, stages and the value block, 0 chosen as the state passes' by ``state_launch``,
    :func:`~openk3.ops.kda.triton.chunk_state.value_block`)."""
    TT, H, K = pre.qg.shape
    V = v.shape[-1]
    N = index.num_seqs
    check_index("tile_recurrence", TT, pre.gend.shape[0], index)
    for name, t, shape, dtype in (
        ("o_out", o_out, (TT, H, V), v.dtype),
        ("ht_out", ht_out, (N, H, K, V), torch.float32),
        ("e_out", e_out, (TT, H, V), pre.M.dtype),
    ):
        if t is not None:
            check_out(name, t, shape, dtype, v.device)
    o = v.new_empty(TT, H, V) if o_out is None else o_out
    ht = None
    if output_final_state:
        ht = v.new_empty(N, H, K, V, dtype=torch.float32) if ht_out is None else ht_out
    BV = value_block(V, N * H, replace(state_launch, value_block=launch.value_block))
    tile_recurrence_kernel[(triton.cdiv(V, BV), N * H)](
        *pre, v, initial_state, o, ht, e_out,
        index.cu_seqlens, index.chunk_offsets,
        # precision from the inputs' storage dtype (M's), not qg's: fp32 gated keys still take tf32 products
        H=H, DOT=dot_precision(pre.M.dtype), K=K, V=V, BT=pre.M.shape[-1], BV=BV,
        USE_H0=initial_state is not None, STORE_FINAL=output_final_state, STORE_E=e_out is not None,
        **launch.options(),
    )  # fmt: skip
    return o, ht


def tile_forward(
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
    """Forward of the chunked KDA on 16-token tiles (no autograd): :func:`tile_prepare` then
    :func:`tile_recurrence`.

    Args:
        q, k, g: ``[tokens, H, K]`` (g raw). v: ``[tokens, H, V]``. beta: ``[tokens, H]`` in ``[0, 1]``
            (logits with ``beta_sigmoid``).
        A_log: ``[H]``; dt_bias: ``[H*K]`` or None. initial_state: fp32 ``[N, H, K, V]`` or None.
        index: tiles of :data:`TILE` tokens (``chunk_index`` with ``size=TILE``), at least one token (the
            public op refuses empty inputs).
        scale, lower_bound (in ``[−5, 0)``), use_l2norm: as in :func:`~openk3.ops.kda.chunk.chunk_kda`.
        output_final_state: also return the fp32 ``[N, H, K, V]`` state after each sequence.
        beta_sigmoid: ``beta`` holds logits and the kernel uses ``σ(beta)``
            (``use_beta_sigmoid_in_kernel``).
        options: its ``fp32_gated_keys`` is read. launch: the kernels' geometry.

    Returns:
        ``(o [tokens, H, V] in v.dtype, final_state or None)``.
    """
    pre = tile_prepare(
        q, k, g, beta, A_log, dt_bias, index, scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm,
        beta_sigmoid=beta_sigmoid, fp32_gated_keys=options.fp32_gated_keys, launch=launch.tile_prepare,
    )  # fmt: skip
    return tile_recurrence(
        pre, v, initial_state, index, output_final_state=output_final_state, launch=launch.tile_recurrence,
        state_launch=launch.chunk_state,
    )  # fmt: skip
