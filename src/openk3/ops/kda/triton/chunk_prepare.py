"""The backward's prepare: per chunk of 64 tokens and head, the tensors its state passes and gradient
kernels read, from the inverse ``T`` and the norms the training forward saved (docs/references.md#kda-chunked-form).

One program per (chunk, head)::

    Γ  = cumsum of the log2 gate over the chunk          Γ_C its last row
    W  = T Diag(β) (K ⊙ 2^{Γ})     U = T Diag(β) V      (T = (I + L)^{-1}, saved by the forward)
    Q̃  = scale·Q ⊙ 2^{Γ}          K̂ = K ⊙ 2^{Γ_C − Γ}       D = 2^{Γ_C}

every factor ≤ 1. ``W``, ``U``, ``Q̃``, ``K̂`` are produced slice by slice (``key_block`` channels) from ``T``
in registers. ``W = T·Diag(β)K̃`` takes fp16 operands where ``T`` is saved in fp16 (:func:`fp16_inverse`:
every operand is then bounded by 1); ``U``'s factor ``V`` is unbounded, so ``U`` takes tf32 operands.

Legend: ``BT`` chunk rows, ``K``/``V`` key/value dims, ``H`` heads, ``P`` chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, KernelLaunch
from openk3.ops.kda.triton.kernel_math import (
    LOG2E,
    bounded_dot,
    check_outs,
    chunk_grid,
    chunk_program,
    chunk_rows,
    dot_precision,
    gate_cumsum_slice,
    load_beta,
    load_row_vec,
    load_rows,
    store_rows,
    tf32_operand,
)

SUB_CHUNK = 16
"""Rows per anchor block ``BC`` of the intra-chunk matrices (fla's ``BC``)."""


def fp16_inverse(dtype: torch.dtype, use_l2norm: bool) -> bool:
    """Whether ``T`` (and each tile's ``P``) is computed and saved in fp16: bf16/fp16 inputs with the in-kernel
    L2 norm. Unit keys and ``β ≤ 1`` give ``|L_ij| ≤ 1``, ``|T_ij| ≤ 1`` (every step ``Diag(α)(I − β k kᵀ)`` of
    the chunk's delta rule has norm ≤ 1; FlashKDA's rationale, docs/references.md#flashkda) and ``|β k̃| ≤ 1``,
    so fp16 operands keep tf32's 11-bit significand without overflow."""
    return use_l2norm and dtype != torch.float32


@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias,
    w, u, qg, kg, Akk, gend, q_rstd, k_rstd,
    cu_seqlens, chunk_table,
    scale, lower_bound_log2,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK2: tl.constexpr, BV2: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP16: tl.constexpr, BETA_SIGMOID: tl.constexpr, STORE_U: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H)``. Reads ``Akk`` (= T) ``[tokens, H, BT]`` and the l2norm ``1/‖·‖``
    ``[tokens, H]``; writes ``w, u, qg, kg`` ``[tokens, H, K|V]`` and ``gend`` = D ``[P, H, K]``; without
    ``STORE_U`` it neither forms nor writes ``u``."""
    i_c, i_h = chunk_program(H)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_T = load_rows(Akk, t0, n_valid, i_h, 0, H, BT, BT, BT).to(tl.float32)  # fp16 T: tf32-exact
    b_rq = load_row_vec(q_rstd, t0, n_valid, i_h, H, BT)
    b_rk = load_row_vec(k_rstd, t0, n_valid, i_h, H, BT)
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    b_rq = b_rq * scale
    if FP16:  # loaded from fp16 already
        b_Tu = b_T
    else:
        b_Tu = tf32_operand(b_T, DOT)  # rounded once for U's products
    for i_k in range(0, K // BK2):
        k0 = i_k * BK2
        b_G, b_GC = gate_cumsum_slice(
            g, t0, n_valid, i_h, A_h, dt_bias, k0, lower_bound_log2, H, K, BT, BK2, HAS_BIAS, False
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
    """What the backward's kernels read per chunk; token tensors ``[tokens, H, ·]``, ``gend`` ``[P, H, K]``.
    ``Aqk``, ``Akk`` (= T) and the norms are the forward's saved tensors; the rest :func:`chunk_prepare`
    writes."""

    w: torch.Tensor
    u: torch.Tensor | None
    qg: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    gend: torch.Tensor
    q_rstd: torch.Tensor
    k_rstd: torch.Tensor


class Saved(NamedTuple):
    """What the training forward saves for the backward besides its inputs: ``Aqk`` ``[tokens, H, 64]`` (the
    input dtype), ``Akk`` = T ``[tokens, H, 64]`` (fp16 under :func:`fp16_inverse`, else fp32) and the l2norm
    reciprocal norms ``q_rstd``, ``k_rstd`` fp32 ``[tokens, H]`` (ones without the norm)."""

    Aqk: torch.Tensor
    Akk: torch.Tensor
    q_rstd: torch.Tensor
    k_rstd: torch.Tensor


def prepared_layout(q: torch.Tensor, v: torch.Tensor, index: ChunkIndex, saved: Saved) -> Prepared:
    """``(shape, dtype)`` of each :class:`Prepared` tensor for ``q`` ``[tokens, H, K]`` and ``v``
    ``[tokens, H, V]`` in chunks ``index``, with ``saved``'s as they are."""
    TT, H, K = q.shape
    return Prepared(
        w=((TT, H, K), q.dtype),
        u=((TT, H, v.shape[-1]), q.dtype),
        qg=((TT, H, K), q.dtype),
        kg=((TT, H, K), q.dtype),
        gend=((index.num_chunks, H, K), torch.float32),
        **{name: (tuple(t.shape), t.dtype) for name, t in saved._asdict().items()},
    )


def empty_prepared(
    q: torch.Tensor, v: torch.Tensor, index: ChunkIndex, saved: Saved, *, store_u: bool
) -> Prepared:
    """Uninitialised tensors for :func:`chunk_prepare` to write (``u`` None without ``store_u``), with
    ``saved``'s own."""
    new = {
        name: q.new_empty(shape, dtype=dtype)
        for name, (shape, dtype) in prepared_layout(q, v, index, saved)._asdict().items()
        if name not in Saved._fields and (store_u or name != "u")
    }
    return Prepared(**({"u": None} | new | saved._asdict()))


def chunk_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    index: ChunkIndex,
    saved: Saved,
    *,
    scale: float,
    lower_bound: float,
    use_l2norm: bool,
    beta_sigmoid: bool = False,
    out: Prepared | None = None,
    store_u: bool = True,
    launch: KernelLaunch = DEFAULT_GEOMETRY.chunk_prepare,
) -> Prepared:
    """Launch :func:`chunk_prepare_kernel`.

    Args:
        q, k, g: ``[tokens, H, K]`` (g is the raw gate). v: ``[tokens, H, V]``. beta: ``[tokens, H]``.
        A_log: ``[H]``; dt_bias: ``[H*K]`` or None. index: the chunk tables. saved: the forward's tensors.
        scale, lower_bound, use_l2norm: as in :func:`~openk3.ops.kda.chunk.chunk_kda`.
        beta_sigmoid: ``beta`` holds logits and the kernels use ``σ(beta)``.
        out: the tensors to write (:func:`empty_prepared`), or None to allocate them.
        store_u: form and write ``U`` (a backward that reads the residuals the forward kept needs none).
        launch: warps, stages and the slice width (``key_block``).

    Raises:
        ValueError: a tensor of ``out`` of another shape or dtype, or not contiguous.

    Returns:
        :class:`Prepared`: ``w, qg, kg`` ``[tokens, H, K]`` and ``u`` ``[tokens, H, V]`` in the storage dtype,
        ``gend`` fp32 ``[P, H, K]``, and ``saved``'s tensors.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    P = index.num_chunks
    if out is None:
        out = empty_prepared(q, v, index, saved, store_u=store_u)
    else:
        layout = prepared_layout(q, v, index, saved)
        check_outs("chunk_prepare out", out, layout, q.device, optional=() if store_u else ("u",))
    if P == 0:
        return out
    chunk_prepare_kernel[chunk_grid(P, H)](
        q, k, v, g, beta, A_log, dt_bias,
        out.w, out.u, out.qg, out.kg, out.Akk, out.gend, out.q_rstd, out.k_rstd,
        index.cu_seqlens, index.chunk_table,
        scale, lower_bound * LOG2E,
        H=H, DOT=dot_precision(q.dtype), K=K, V=V, BT=CHUNK,
        BK2=min(K, launch.key_block), BV2=min(V, launch.key_block),
        HAS_BIAS=dt_bias is not None, FP16=fp16_inverse(q.dtype, use_l2norm), BETA_SIGMOID=beta_sigmoid,
        STORE_U=store_u, **launch.options(),
    )  # fmt: skip
    return out
