"""Per-chunk preparation of the chunked KDA (the token-parallel half of the forward, §1.5).

One program per (chunk of ``BT = 64`` tokens, head). It applies the K3 gate and the optional L2 norm in the
kernel, and produces everything the sequential state pass needs, so that pass is three matmuls per chunk:

    Γ  = cumsum of the log2 gate over the chunk          Γ_C its last row
    Aqk_ij = scale Σ_d q_id k_jd 2^{Γ_id − Γ_jd}  (i ≥ j)      L_ij = β_i Σ_d k_id k_jd 2^{Γ_id − Γ_jd}  (i > j)
    T  = (I + L)^{-1}                                     (written to ``Akk``, fp32)
    W  = T Diag(β) (K ⊙ 2^{Γ})     U = T Diag(β) V
    Q̃  = scale·Q ⊙ 2^{Γ}          K̂ = K ⊙ 2^{Γ_C − Γ}       D = 2^{Γ_C}

``Aqk`` and ``L`` are built from 16-row sub-chunks (fla's ``BC``). Off-diagonal blocks (row sub-chunk ``s``,
column sub-chunk ``u < s``) factor ``2^{Γ_i − Γ_j} = 2^{Γ_i − a_s}·2^{a_s − Γ_j}`` with the anchor ``a_s`` =
Γ just before sub-chunk ``s``: both factors are ≤ 1. Diagonal blocks use the same causal anchor, so the
column factor ``2^{a_s − Γ_j}`` is at most ``2^{16·|lb|·log2 e}`` = ``2^{115.4}`` for ``lb = −5``, inside fp32
(FlashKDA's bound, §2.2): this is why the Triton path needs ``lower_bound ≥ −5`` (§1.7). Every row ``i``
reads only rows ``≤ i`` of its chunk, so outputs are bitwise causal. The 16×16 diagonal inverses use forward
substitution; the blocks below them follow from ``T_su = −T_ss Σ_{u ≤ w < s} L_sw T_wu``.

Legend: ``BT`` chunk rows, ``BC`` sub-chunk rows, ``K``/``V`` key/value dims, ``H`` heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    k3_gate_log2,
    l2norm_rstd,
    load_row_vec,
    load_rows,
    store_row_vec,
    store_rows,
    unit_lower_inverse16,
    unit_lower_inverse16_doubling,
)

SUB_CHUNK = 16
"""Rows per sub-chunk ``BC``: the 16-token tensor-core tiles of the intra-chunk matrices."""
LAUNCH = {"num_warps": 8, "doubling_inverse": False}
"""Launch configuration: warps, and the 16×16 inverses by the doubling product instead of forward
substitution; ``benchmarks/kda.py --sweep`` times the alternatives."""


@triton.jit
def _sub_chunk(
    q,
    k,
    g,
    beta,
    t_s,
    n_s,
    i_h,
    A_h,
    bias,
    lb2,
    H: tl.constexpr,
    K: tl.constexpr,
    BC: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    """One 16-row sub-chunk: normalised q, k ``[BC, K]``, in-block gate cumsum ``[BC, K]`` (log2), its
    total ``[K]`` and β ``[BC]``; rows past ``n_s`` are zero (identity tokens)."""
    o_r = tl.arange(0, BC)
    b_q = load_rows(q, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32)
    b_k = load_rows(k, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32)
    b_q = b_q * l2norm_rstd(b_q, USE_L2NORM)[:, None]
    b_k = b_k * l2norm_rstd(b_k, USE_L2NORM)[:, None]
    b_x = load_rows(g, t_s, n_s, i_h, 0, H, K, BC, K).to(tl.float32)
    b_g = tl.where((o_r < n_s)[:, None], k3_gate_log2(b_x, A_h, bias, lb2), 0.0)
    b_local = tl.cumsum(b_g, axis=0)
    b_beta = load_row_vec(beta, t_s, n_s, i_h, H, BC)
    return b_q, b_k, b_local, tl.sum(b_g, axis=0), b_beta


@triton.jit
def _diagonal(b_q, b_k, b_local, b_beta, scale, BC: tl.constexpr):
    """Diagonal block with the anchor just before the sub-chunk: ``(Aqk, L, qa, ka, kd)``."""
    o_i = tl.arange(0, BC)
    b_rf = tl.exp2(b_local)
    b_cf = tl.exp2(-b_local)
    b_qa = b_q * b_rf
    b_ka = b_k * b_rf
    b_kd = b_k * b_cf
    b_A = tl.dot(b_qa, tl.trans(b_kd)) * scale
    b_A = tl.where(o_i[:, None] >= o_i[None, :], b_A, 0.0)
    b_L = tl.dot(b_ka, tl.trans(b_kd))
    b_L = tl.where(o_i[:, None] > o_i[None, :], b_L, 0.0) * b_beta[:, None]
    return b_A, b_L, b_qa, b_ka, b_kd


@triton.jit
def _off_diagonal(b_qa, b_ka, b_col, b_beta, scale):
    """Block (s, u < s): rows ``qa``/``ka`` of sub-chunk s, columns ``b_col`` = k_u·2^{a_s − Γ_u}."""
    b_A = tl.dot(b_qa, tl.trans(b_col)) * scale
    b_L = tl.dot(b_ka, tl.trans(b_col)) * b_beta[:, None]
    return b_A, b_L


@triton.jit
def _store_block(
    ptr,
    blk,
    t0,
    n_valid,
    i_h,
    s: tl.constexpr,
    u: tl.constexpr,
    H: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    store_rows(ptr, blk, t0 + s * BC, n_valid - s * BC, i_h, u * BC, H, BT, BC, BC)


@triton.jit
def _merge_dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias,
    w, u, qg, kg, Aqk, Akk, gend, q_rstd, k_rstd,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_RSTD: tl.constexpr, DOUBLING: tl.constexpr,
):  # fmt: skip
    """Grid ``(P chunks, H)``. Writes ``w, u, qg, kg`` ``[tokens, H, K|V]``, ``Aqk`` and ``Akk`` (= T)
    ``[tokens, H, BT]``, ``gend`` = D ``[P, H, K]`` and, with ``STORE_RSTD``, the l2norm ``1/‖·‖``."""
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

    # ---- Aqk and L by 16-row sub-chunks (anchor a_s = Γ before sub-chunk s; a_0 = 0)
    q0, k0, l0, tot0, be0 = _sub_chunk(
        q, k, g, beta, t0, n_valid, i_h, A_h, bias, lower_bound_log2, H, K, BC, USE_L2NORM
    )
    A00, L00, qa0, ka0, kd0 = _diagonal(q0, k0, l0, be0, scale, BC)
    ke0 = kd0 * tl.exp2(tot0)[None, :]  # k_0·2^{a_1 − Γ_0} ≤ 1

    q1, k1, l1, tot1, be1 = _sub_chunk(
        q, k, g, beta, t0 + BC, n_valid - BC, i_h, A_h, bias, lower_bound_log2, H, K, BC, USE_L2NORM
    )
    A11, L11, qa1, ka1, kd1 = _diagonal(q1, k1, l1, be1, scale, BC)
    A10, L10 = _off_diagonal(qa1, ka1, ke0, be1, scale)
    ke1 = kd1 * tl.exp2(tot1)[None, :]

    q2, k2, l2, tot2, be2 = _sub_chunk(
        q, k, g, beta, t0 + 2 * BC, n_valid - 2 * BC, i_h, A_h, bias, lower_bound_log2, H, K, BC, USE_L2NORM
    )
    A22, L22, qa2, ka2, kd2 = _diagonal(q2, k2, l2, be2, scale, BC)
    A21, L21 = _off_diagonal(qa2, ka2, ke1, be2, scale)
    A20, L20 = _off_diagonal(qa2, ka2, ke0 * tl.exp2(tot1)[None, :], be2, scale)
    ke2 = kd2 * tl.exp2(tot2)[None, :]

    q3, k3, l3, tot3, be3 = _sub_chunk(
        q, k, g, beta, t0 + 3 * BC, n_valid - 3 * BC, i_h, A_h, bias, lower_bound_log2, H, K, BC, USE_L2NORM
    )
    A33, L33, qa3, ka3, kd3 = _diagonal(q3, k3, l3, be3, scale, BC)
    A32, L32 = _off_diagonal(qa3, ka3, ke2, be3, scale)
    A31, L31 = _off_diagonal(qa3, ka3, ke1 * tl.exp2(tot2)[None, :], be3, scale)
    A30, L30 = _off_diagonal(qa3, ka3, ke0 * tl.exp2(tot1 + tot2)[None, :], be3, scale)

    # ---- T = (I + L)^{-1}: diagonal blocks by substitution, then the blocks below them
    if DOUBLING:
        T00 = unit_lower_inverse16_doubling(L00, BC)
        T11 = unit_lower_inverse16_doubling(L11, BC)
        T22 = unit_lower_inverse16_doubling(L22, BC)
        T33 = unit_lower_inverse16_doubling(L33, BC)
    else:
        T00 = unit_lower_inverse16(L00, BC)
        T11 = unit_lower_inverse16(L11, BC)
        T22 = unit_lower_inverse16(L22, BC)
        T33 = unit_lower_inverse16(L33, BC)
    T10 = -_merge_dot(T11, _merge_dot(L10, T00))
    T21 = -_merge_dot(T22, _merge_dot(L21, T11))
    T20 = -_merge_dot(T22, _merge_dot(L20, T00) + _merge_dot(L21, T10))
    T32 = -_merge_dot(T33, _merge_dot(L32, T22))
    T31 = -_merge_dot(T33, _merge_dot(L31, T11) + _merge_dot(L32, T21))
    T30 = -_merge_dot(T33, _merge_dot(L30, T00) + _merge_dot(L31, T10) + _merge_dot(L32, T20))

    zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_block(Aqk, A00, t0, n_valid, i_h, 0, 0, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 0, 1, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 0, 2, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 0, 3, H, BT, BC)
    _store_block(Aqk, A10, t0, n_valid, i_h, 1, 0, H, BT, BC)
    _store_block(Aqk, A11, t0, n_valid, i_h, 1, 1, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 1, 2, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 1, 3, H, BT, BC)
    _store_block(Aqk, A20, t0, n_valid, i_h, 2, 0, H, BT, BC)
    _store_block(Aqk, A21, t0, n_valid, i_h, 2, 1, H, BT, BC)
    _store_block(Aqk, A22, t0, n_valid, i_h, 2, 2, H, BT, BC)
    _store_block(Aqk, zero, t0, n_valid, i_h, 2, 3, H, BT, BC)
    _store_block(Aqk, A30, t0, n_valid, i_h, 3, 0, H, BT, BC)
    _store_block(Aqk, A31, t0, n_valid, i_h, 3, 1, H, BT, BC)
    _store_block(Aqk, A32, t0, n_valid, i_h, 3, 2, H, BT, BC)
    _store_block(Aqk, A33, t0, n_valid, i_h, 3, 3, H, BT, BC)
    _store_block(Akk, T00, t0, n_valid, i_h, 0, 0, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 0, 1, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 0, 2, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 0, 3, H, BT, BC)
    _store_block(Akk, T10, t0, n_valid, i_h, 1, 0, H, BT, BC)
    _store_block(Akk, T11, t0, n_valid, i_h, 1, 1, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 1, 2, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 1, 3, H, BT, BC)
    _store_block(Akk, T20, t0, n_valid, i_h, 2, 0, H, BT, BC)
    _store_block(Akk, T21, t0, n_valid, i_h, 2, 1, H, BT, BC)
    _store_block(Akk, T22, t0, n_valid, i_h, 2, 2, H, BT, BC)
    _store_block(Akk, zero, t0, n_valid, i_h, 2, 3, H, BT, BC)
    _store_block(Akk, T30, t0, n_valid, i_h, 3, 0, H, BT, BC)
    _store_block(Akk, T31, t0, n_valid, i_h, 3, 1, H, BT, BC)
    _store_block(Akk, T32, t0, n_valid, i_h, 3, 2, H, BT, BC)
    _store_block(Akk, T33, t0, n_valid, i_h, 3, 3, H, BT, BC)
    # the whole-chunk T is read back below by other threads of this program
    tl.debug_barrier()

    # ---- whole-chunk tiles: Γ from the chunk start (all factors ≤ 1), W, U, Q̃, K̂, D
    o_t = tl.arange(0, BT)
    b_T = load_rows(Akk, t0, n_valid, i_h, 0, H, BT, BT, BT).to(tl.float32)
    b_x = load_rows(g, t0, n_valid, i_h, 0, H, K, BT, K).to(tl.float32)
    b_g = tl.where((o_t < n_valid)[:, None], k3_gate_log2(b_x, A_h, bias, lower_bound_log2), 0.0)
    b_G = tl.cumsum(b_g, axis=0)
    b_GC = tl.sum(b_g, axis=0)
    b_eG = tl.exp2(b_G)
    b_beta = load_row_vec(beta, t0, n_valid, i_h, H, BT)

    b_q = load_rows(q, t0, n_valid, i_h, 0, H, K, BT, K).to(tl.float32)
    b_rq = l2norm_rstd(b_q, USE_L2NORM)
    store_rows(qg, b_q * b_rq[:, None] * b_eG * scale, t0, n_valid, i_h, 0, H, K, BT, K)
    b_k = load_rows(k, t0, n_valid, i_h, 0, H, K, BT, K).to(tl.float32)
    b_rk = l2norm_rstd(b_k, USE_L2NORM)
    b_k = b_k * b_rk[:, None]
    if STORE_RSTD:
        store_row_vec(q_rstd, b_rq, t0, n_valid, i_h, H, BT)
        store_row_vec(k_rstd, b_rk, t0, n_valid, i_h, H, BT)
    store_rows(kg, b_k * tl.exp2(b_GC[None, :] - b_G), t0, n_valid, i_h, 0, H, K, BT, K)
    b_w = tl.dot(b_T, b_k * b_eG * b_beta[:, None])
    store_rows(w, b_w, t0, n_valid, i_h, 0, H, K, BT, K)
    b_v = load_rows(v, t0, n_valid, i_h, 0, H, V, BT, V).to(tl.float32)
    b_u = tl.dot(b_T, b_v * b_beta[:, None])
    store_rows(u, b_u, t0, n_valid, i_h, 0, H, V, BT, V)
    tl.store(gend + (i_c.to(tl.int64) * H + i_h) * K + o_k, tl.exp2(b_GC))


class Prepared(NamedTuple):
    """Outputs of :func:`chunk_prepare`; token tensors are ``[tokens, H, ·]``, per-chunk ``[P, H, K]``."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    gend: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None


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
    store_rstd: bool,
) -> Prepared:
    """Launch :func:`chunk_prepare_kernel`.

    Args:
        q, k, g: ``[tokens, H, K]`` (g is the raw gate). v: ``[tokens, H, V]``. beta: ``[tokens, H]``.
        A_log: ``[H]``; dt_bias: ``[H*K]`` or None. index: the chunk tables.
        scale, lower_bound, use_l2norm: as in :func:`~openk3.ops.kda.chunk.chunk_kda`.
        store_rstd: also return the l2norm reciprocal norms (the backward needs them).

    Returns:
        :class:`Prepared`: ``w, qg, kg`` ``[tokens, H, K]`` and ``u`` ``[tokens, H, V]`` in the storage dtype
        (q's dtype, fp32 for fp32 inputs), ``Aqk`` in the storage dtype and ``Akk`` = T in fp32, both
        ``[tokens, H, 64]``, ``gend`` fp32 ``[P, H, K]``.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    P = index.num_chunks
    out = Prepared(
        w=q.new_empty(TT, H, K, dtype=dt),
        u=q.new_empty(TT, H, V, dtype=dt),
        qg=q.new_empty(TT, H, K, dtype=dt),
        kg=q.new_empty(TT, H, K, dtype=dt),
        Aqk=q.new_empty(TT, H, CHUNK, dtype=dt),
        Akk=q.new_empty(TT, H, CHUNK, dtype=torch.float32),
        gend=q.new_empty(P, H, K, dtype=torch.float32),
        q_rstd=q.new_empty(TT, H, dtype=torch.float32) if store_rstd else None,
        k_rstd=q.new_empty(TT, H, dtype=torch.float32) if store_rstd else None,
    )
    if P == 0:
        return out
    chunk_prepare_kernel[(P, H)](
        q, k, v, g, beta, A_log, dt_bias,
        out.w, out.u, out.qg, out.kg, out.Aqk, out.Akk, out.gend, out.q_rstd, out.k_rstd,
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, K=K, V=V, BT=CHUNK, BC=SUB_CHUNK,
        USE_L2NORM=use_l2norm, HAS_BIAS=dt_bias is not None, STORE_RSTD=store_rstd,
        DOUBLING=LAUNCH["doubling_inverse"], num_warps=LAUNCH["num_warps"], num_stages=1,
    )  # fmt: skip
    return out
