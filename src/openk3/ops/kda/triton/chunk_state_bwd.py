"""The reverse state pass of the chunked KDA backward (docs/references.md#kda-chunked-backward step 2): one program per (value block,
sequence, head) walks its chunks from last to first with ``dS [K, BV]`` (the gradient of the state at the
current chunk's end) in fp32 registers.

Per chunk, with the forward's ``O = Q̃ S₀ + Aqk E``, ``E = U − W S₀``, ``S₁ = Diag(D) S₀ + K̂ᵀ E``::

    store dh = dS₁                          (the gradient of the state at the chunk end, fp32)
    dE  = Aqkᵀ dO + K̂ dS₁                   (stored as ``dv_new``)
    dS₀ = Diag(D) dS₁ + Q̃ᵀ dO − Wᵀ dE

and the gradient of the initial state is the last ``dS₀``.

Legend: ``N`` sequences, ``H`` heads, ``K``/``V`` key/value dims, ``BV`` value block, ``BT`` chunk rows,
``P`` chunks of all sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import Prepared
from openk3.ops.kda.triton.chunk_state import state_launch_options, value_block
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, StateLaunch
from openk3.ops.kda.triton.kernel_math import (
    check_index,
    check_out,
    dot,
    dot_precision,
    load_rows,
    state_program,
    store_rows,
)


@triton.jit
def chunk_state_bwd_kernel(
    qg, kg, w, Aqk, gend, do, dht, dh, dv_new, dh0,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``. ``dht``/``dh0`` fp32 ``[N, H, K, V]``; ``dh`` ``[P, H, K, V]``; ``do``,
    ``dv_new`` ``[tokens, H, V]``."""
    i_h, bos, eos, c0, v0, o_k, o_v, p_state = state_program(cu_seqlens, chunk_offsets, H, K, V, BV)
    n_chunks = tl.cdiv(eos - bos, BT)
    dt = w.dtype.element_ty
    if USE_DHT:
        b_dS = tl.load(dht + p_state).to(tl.float32)
    else:
        b_dS = tl.zeros([K, BV], dtype=tl.float32)
    for i_r in range(0, n_chunks):
        i_t = n_chunks - 1 - i_r
        t0 = bos + i_t * BT
        n_valid = tl.minimum(eos - t0, BT).to(tl.int32)
        b_dSd = b_dS.to(dt)
        p_h = ((c0 + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(dh + p_h, b_dS.to(dh.dtype.element_ty))
        b_do = load_rows(do, t0, n_valid, i_h, v0, H, V, BT, BV).to(dt)
        b_A = load_rows(Aqk, t0, n_valid, i_h, 0, H, BT, BT, BT)
        b_kg = load_rows(kg, t0, n_valid, i_h, 0, H, K, BT, K)
        b_de = dot(tl.trans(b_A), b_do, DOT) + dot(b_kg, b_dSd, DOT)
        b_ded = b_de.to(dt)
        store_rows(dv_new, b_ded, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_qg = load_rows(qg, t0, n_valid, i_h, 0, H, K, BT, K)
        b_w = load_rows(w, t0, n_valid, i_h, 0, H, K, BT, K)
        b_D = tl.load(gend + ((c0 + i_t) * H + i_h) * K + o_k)
        b_dS = b_dS * b_D[:, None] + dot(tl.trans(b_qg), b_do, DOT) - dot(tl.trans(b_w), b_ded, DOT)
    tl.store(dh0 + p_state, b_dS)


def chunk_state_bwd(
    pre: Prepared,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    index: ChunkIndex,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    launch: StateLaunch = DEFAULT_GEOMETRY.chunk_state,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the reverse pass.

    Args:
        pre: the prepared chunk tensors. do: ``[tokens, H, V]`` gradient of ``o``. dht: fp32
            ``[N, H, K, V]`` gradient of the final state, or None. index: chunk tables.
        out: the ``(dh, dv_new, dh0)`` tensors to write, or None to allocate them.
        launch: warps, stages, value block (as the forward-direction pass's).

    Raises:
        ValueError: a tensor of ``out`` of another shape or dtype than returned below, or not contiguous; an
            ``index`` of other tokens or chunks than ``pre`` (:func:`~openk3.ops.kda.triton.kernel_math.
            check_index`).

    Returns:
        ``(dh fp32 [P, H, K, V], dv_new [tokens, H, V], dh0 fp32 [N, H, K, V])``; dv_new in the storage
        dtype. ``dh`` is kept whole for the gate's chunk-end gradient ``Σ_v h ⊙ dh``; the products that read it
        round it to the storage dtype, as this pass's own product does.
    """
    TT, H, K = pre.w.shape
    V = do.shape[-1]
    N, P = index.num_seqs, index.num_chunks
    check_index("chunk_state_bwd", TT, pre.gend.shape[0], index)
    if out is not None:
        for name, t, shape, dtype in zip(
            ("dh", "dv_new", "dh0"), out, ((P, H, K, V), (TT, H, V), (N, H, K, V)),
            (torch.float32, pre.w.dtype, torch.float32), strict=True,
        ):  # fmt: skip
            check_out(f"chunk_state_bwd out {name}", t, shape, dtype, pre.w.device)
    if out is None:
        out = (
            pre.w.new_empty(P, H, K, V, dtype=torch.float32),
            pre.w.new_empty(TT, H, V),
            pre.w.new_empty(N, H, K, V, dtype=torch.float32),
        )
    dh, dv_new, dh0 = out
    BV = value_block(V, N * H, launch)
    grid = (triton.cdiv(V, BV), N * H)
    chunk_state_bwd_kernel[grid](
        pre.qg, pre.kg, pre.w, pre.Aqk, pre.gend, do, dht, dh, dv_new, dh0,
        index.cu_seqlens, index.chunk_offsets,
        H=H, DOT=dot_precision(pre.w.dtype), K=K, V=V, BT=CHUNK, BV=BV, USE_DHT=dht is not None,
        **state_launch_options(grid[0] * grid[1], pre.w.device, launch),
    )  # fmt: skip
    return dh, dv_new, dh0
