"""The KDA forward on 16-token tiles, for calls that keep nothing for a backward (FlashKDA's split,
kda_kernels reference §2.2): a token-parallel prepare and a sequential recurrence that forms the delta-rule
residuals itself, so nothing of size ``[tokens, H, K]`` beyond three gated copies of q and k is written.

Per tile of ``BT = 16`` tokens and head, with Γ the inclusive cumsum of the log2 gate over the tile (Γ_C its
last valid row; ``|Γ| ≤ 16·|lb|·log2 e = 115.4`` for ``lb = −5``, inside fp32's and bf16's range)::

    Q̃ = scale·Q ⊙ 2^{Γ}      K̃ = K ⊙ 2^{Γ}      K̂ = K ⊙ 2^{Γ_C − Γ}      D = 2^{Γ_C}   (L2-normalised Q, K)
    M_ij = Σ_d Q̃_id K_jd 2^{−Γ_jd}  (i ≥ j)          L_ij = β_i Σ_d K̃_id K_jd 2^{−Γ_jd}  (i > j)
    P  = (I + L)^{-1} Diag(β)                          (fp32 substitution)

and the recurrence, from the state ``S`` before the tile (§1.5 with ``W = P K̃``, ``U = P V``)::

    E = P (V − K̃ S)        O = Q̃ S + M E        S ← Diag(D) S + K̂ᵀ E

``M`` and ``L`` are single products: their factor ``2^{Γ_i − Γ_j}`` is ≤ 1 where kept (``i ≥ j``) and at most
``2^{115}`` where masked, so no anchor is needed (the 64-token chunks of
:mod:`~openk3.ops.kda.triton.chunk_prepare` need four). The state, ``E`` and ``O`` are as in
:mod:`~openk3.ops.kda.triton.chunk_state` (fp32 state, matmul operands in the storage dtype). ``P`` is saved in
fp16 under the condition of ``chunk_prepare.LAUNCH["fp16_inverse"]`` (that switch on, bf16/fp16 inputs, the
in-kernel L2 norm: unit keys and ``β ≤ 1`` bound it by 1), else in fp32; ``E = P X`` is a tf32 product with
both operands rounded (:func:`~openk3.ops.kda.triton.kernel_math.dot`; an fp16 ``P`` is exact in tf32), tf32x3
for fp32 inputs.

Used by :func:`~openk3.ops.kda.triton.chunk_function.chunk_kda_triton` when no gradient is needed and
``LAUNCH["enabled"]``. Legend: ``BT`` tile rows, ``K``/``V`` key/value dims, ``BV`` value block, ``H`` heads,
``N`` sequences, ``P16`` tiles of all sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import LAUNCH as PREPARE_LAUNCH
from openk3.ops.kda.triton.chunk_state import value_block
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    chunk_rows,
    dot,
    dot_precision,
    gate_cumsum_slice,
    launch_options,
    load_row_vec,
    load_rows,
    state_program,
    store_rows,
    tf32_operand,
    unit_lower_inverse_stacked,
)

TILE = 16
"""Tokens per tile (FlashKDA's chunk; the bound ``16·|lb|·log2 e ≤ 115.4`` needs ``lb ≥ −5``)."""
LAUNCH = {
    "enabled": False,
    "num_warps": 4,
    "num_stages": 1,
    "recurrence_warps": 4,
    "recurrence_stages": 1,
    "value_block": 0,
}
"""``enabled``: use this path for calls without a gradient (off until timed against the 64-token chunks on a
GPU: ``benchmarks/kda.py --tile-forward``; ``--sweep`` times the other entries). Warps and pipeline stages of
the prepare and of the recurrence (its loads do not depend on the state, so stages can prefetch them), and the
recurrence's value block (0: as the chunk state pass, :func:`~openk3.ops.kda.triton.chunk_state.value_block`
with its ``min_programs``; > 0: that width)."""


@triton.jit
def tile_prepare_kernel(
    q, k, g, beta, A_log, dt_bias,
    qg, kt, kh, M, Pb, gend,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Grid ``(P16, H)``. Writes ``qg`` = Q̃, ``kt`` = K̃, ``kh`` = K̂ ``[tokens, H, K]``, ``M`` and ``Pb`` = P
    ``[tokens, H, BT]``, ``gend`` = D ``[P16, H, K]``."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_G, b_GC = gate_cumsum_slice(
        g, t0, n_valid, i_h, A_h, dt_bias, 0, lower_bound_log2, H, K, BT, K, HAS_BIAS, False
    )
    b_q = load_rows(q, t0, n_valid, i_h, 0, H, K, BT, K).to(tl.float32)
    b_k = load_rows(k, t0, n_valid, i_h, 0, H, K, BT, K).to(tl.float32)
    if USE_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    b_beta = load_row_vec(beta, t0, n_valid, i_h, H, BT)
    b_eG = tl.exp2(b_G)
    b_kinv = b_k * tl.exp2(-b_G)  # ≤ 2^115
    b_qg = b_q * scale * b_eG
    b_kt = b_k * b_eG
    o = tl.arange(0, BT)
    b_M = tl.where(o[:, None] >= o[None, :], dot(b_qg, tl.trans(b_kinv), DOT), 0.0)
    b_L = tl.where(o[:, None] > o[None, :], dot(b_kt, tl.trans(b_kinv), DOT) * b_beta[:, None], 0.0)
    b_T = tl.reshape(unit_lower_inverse_stacked(tl.reshape(b_L, [1, BT, BT]), 1, BT), [BT, BT])
    b_GCe = tl.exp2(b_GC)
    store_rows(qg, b_qg, t0, n_valid, i_h, 0, H, K, BT, K)
    store_rows(kt, b_kt, t0, n_valid, i_h, 0, H, K, BT, K)
    store_rows(kh, b_kinv * b_GCe[None, :], t0, n_valid, i_h, 0, H, K, BT, K)
    store_rows(M, b_M, t0, n_valid, i_h, 0, H, BT, BT, BT)
    store_rows(Pb, b_T * b_beta[None, :], t0, n_valid, i_h, 0, H, BT, BT, BT)
    tl.store(gend + (i_c.to(tl.int64) * H + i_h) * K + tl.arange(0, K), b_GCe)


@triton.jit
def tile_recurrence_kernel(
    qg, kt, kh, M, Pb, gend, v, h0, o, ht,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``: one value block of one sequence and head, its tiles in order. ``h0``/``ht`` fp32
    ``[N, H, K, V]``; ``o`` ``[tokens, H, V]``."""
    i_h, bos, eos, c0, v0, o_k, _, p_state = state_program(cu_seqlens, chunk_offsets, H, K, V, BV)
    dt = qg.dtype.element_ty
    if USE_H0:
        b_S = tl.load(h0 + p_state).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        n_valid = tl.minimum(eos - t0, BT).to(tl.int32)
        b_Sd = b_S.to(dt)
        b_x = load_rows(v, t0, n_valid, i_h, v0, H, V, BT, BV).to(tl.float32) - dot(
            load_rows(kt, t0, n_valid, i_h, 0, H, K, BT, K), b_Sd, DOT
        )
        b_P = load_rows(Pb, t0, n_valid, i_h, 0, H, BT, BT, BT)
        if Pb.dtype.element_ty == tl.float16:  # exact in tf32: no rounding
            b_P = b_P.to(tl.float32)
        else:
            b_P = tf32_operand(b_P, DOT)
        b_ed = tl.dot(b_P, tf32_operand(b_x, DOT), input_precision=DOT).to(dt)
        b_o = dot(load_rows(qg, t0, n_valid, i_h, 0, H, K, BT, K), b_Sd, DOT)
        b_o += dot(load_rows(M, t0, n_valid, i_h, 0, H, BT, BT, BT), b_ed, DOT)
        store_rows(o, b_o, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_kh = load_rows(kh, t0, n_valid, i_h, 0, H, K, BT, K)
        b_D = tl.load(gend + ((c0 + i_t) * H + i_h) * K + o_k)
        b_S = b_S * b_D[:, None] + dot(tl.trans(b_kh), b_ed, DOT)
    if STORE_FINAL:
        tl.store(ht + p_state, b_S)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward of the chunked KDA on 16-token tiles (no autograd).

    Args:
        q, k, g: ``[tokens, H, K]`` (g raw). v: ``[tokens, H, V]``. beta: ``[tokens, H]`` in ``[0, 1]``.
        A_log: ``[H]``; dt_bias: ``[H*K]`` or None. initial_state: fp32 ``[N, H, K, V]`` or None.
        index: tiles of :data:`TILE` tokens (``chunk_index`` with ``size=TILE``), at least one token (the
            public op refuses empty inputs).
        scale, lower_bound (in ``[−5, 0)``), use_l2norm: as in :func:`~openk3.ops.kda.chunk.chunk_kda`.
        output_final_state: also return the fp32 ``[N, H, K, V]`` state after each sequence.

    Returns:
        ``(o [tokens, H, V] in v.dtype, final_state or None)``.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    N, P = index.num_seqs, index.num_chunks
    dt = q.dtype
    o = v.new_empty(TT, H, V)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    qg, kt, kh = (q.new_empty(TT, H, K, dtype=dt) for _ in range(3))
    M = q.new_empty(TT, H, TILE, dtype=dt)
    # |P_ij| ≤ 1 under chunk_prepare's fp16 condition (module docstring)
    fp16 = PREPARE_LAUNCH["fp16_inverse"] and use_l2norm and dt != torch.float32
    Pb = q.new_empty(TT, H, TILE, dtype=torch.float16 if fp16 else torch.float32)
    gend = q.new_empty(P, H, K, dtype=torch.float32)
    DOT = dot_precision(dt)
    tile_prepare_kernel[(P, H)](
        q, k, g, beta, A_log, dt_bias,
        qg, kt, kh, M, Pb, gend,
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, DOT=DOT, K=K, BT=TILE, USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None,
        **launch_options(LAUNCH),
    )  # fmt: skip
    BV = value_block(V, N * H, LAUNCH["value_block"])
    tile_recurrence_kernel[(triton.cdiv(V, BV), N * H)](
        qg, kt, kh, M, Pb, gend, v, initial_state, o, ht,
        index.cu_seqlens, index.chunk_offsets,
        H=H, DOT=DOT, K=K, V=V, BT=TILE, BV=BV,
        USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        **launch_options(
            dict(LAUNCH, num_warps=LAUNCH["recurrence_warps"], num_stages=LAUNCH["recurrence_stages"])
        ),
    )  # fmt: skip
    return o, ht
