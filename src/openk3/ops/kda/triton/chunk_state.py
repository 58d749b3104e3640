"""The backward's forward-direction state pass (docs/references.md#kda-chunked-form): one program per (value
block, sequence, head) walks its 64-token chunks in order with the state slice ``S [K, BV]`` in fp32
registers, and keeps what the gradient kernels read: the state at every chunk start ``h`` and the chunk's
delta-rule residuals ``E``. Per chunk, from :mod:`~openk3.ops.kda.triton.chunk_prepare`'s tensors::

    h  = S                              (stored in fp32)
    E  = U − W S                        ("v_new"; read instead when the forward kept it, LOAD_E)
    S ← Diag(D) S + K̂ᵀ E

The matmul operands are in the storage dtype (bf16 for bf16 inputs, as in fla's ``chunk_gated_delta_rule_
fwd_h``); accumulation and the carried state are fp32. ``h`` is stored in fp32: the products that read it
round it to the storage dtype as this pass's own product does (the same bits), and the gate's chunk-end
gradient ``Σ_v h ⊙ dh`` (:mod:`~openk3.ops.kda.triton.chunk_grad_wy`) takes it whole, since a bf16 ``h``
there put ``dA_log`` past fla's error on short sequences (docs/LOG.md). With ``E`` given (the residuals the training forward
kept, ``KDAOptions.keep_residuals``) no product through ``S`` is on the chain.

This module also holds the state passes' shared launch choices (value block, stages), which the reverse pass
(:mod:`~openk3.ops.kda.triton.chunk_state_bwd`) and the tile recurrence use too.

Legend: ``N`` sequences, ``H`` heads, ``K``/``V`` key/value dims, ``BV`` value block, ``BT`` chunk rows,
``P`` chunks of all sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import Prepared
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
from openk3.ops.kda.triton.pipeline import overlaps


@triton.jit
def chunk_state_fwd_kernel(
    w, u, kg, gend, h0, h, v_new,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, LOAD_E: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``. ``h0`` fp32 ``[N, H, K, V]``; ``h`` ``[P, H, K, V]``; ``v_new``
    ``[tokens, H, V]`` (read instead of written with ``LOAD_E``)."""
    i_h, bos, eos, c0, v0, o_k, o_v, p_state = state_program(cu_seqlens, chunk_offsets, H, K, V, BV)
    n_chunks = tl.cdiv(eos - bos, BT)
    dt = w.dtype.element_ty
    if USE_H0:
        b_S = tl.load(h0 + p_state).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, n_chunks):
        t0 = bos + i_t * BT
        n_valid = tl.minimum(eos - t0, BT).to(tl.int32)
        b_Sd = b_S.to(dt)
        p_h = ((c0 + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(h + p_h, b_S.to(h.dtype.element_ty))
        if LOAD_E:
            b_ed = load_rows(v_new, t0, n_valid, i_h, v0, H, V, BT, BV)
        else:
            b_w = load_rows(w, t0, n_valid, i_h, 0, H, K, BT, K)
            b_e = load_rows(u, t0, n_valid, i_h, v0, H, V, BT, BV).to(tl.float32) - dot(b_w, b_Sd, DOT)
            b_ed = b_e.to(dt)
            store_rows(v_new, b_ed, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_kg = load_rows(kg, t0, n_valid, i_h, 0, H, K, BT, K)
        b_D = tl.load(gend + ((c0 + i_t) * H + i_h) * K + o_k)
        b_S = b_S * b_D[:, None] + dot(tl.trans(b_kg), b_ed, DOT)


def value_block(V: int, programs_per_block: int, launch: StateLaunch = DEFAULT_GEOMETRY.chunk_state) -> int:
    """Value-block width of a state pass: ``launch.value_block`` if set, else 64, or 32 when fewer than
    ``launch.min_programs`` programs would run (long single sequences with few heads); never above ``V``."""
    if launch.value_block:
        return min(launch.value_block, V)
    bv = 64 if programs_per_block * max(V // 64, 1) >= launch.min_programs else 32
    return min(bv, V)


def state_launch_options(programs: int, device: torch.device, launch: StateLaunch) -> dict:
    """Launch keywords of a state pass of ``programs`` programs on ``device``: ``launch``'s, with
    ``few_program_stages`` (when set) as the stages where the pass has at most one program per multiprocessor
    (:func:`~openk3.ops.kda.triton.pipeline.overlaps`): bound by its chain's latency alone, it gains from
    fetching the next chunk's operands while this one's products run."""
    options = launch.options()
    if launch.few_program_stages and overlaps(device, programs):
        options["num_stages"] = launch.few_program_stages
    return options


def state_programs(V: int, H: int, N: int, launch: StateLaunch = DEFAULT_GEOMETRY.chunk_state) -> int:
    """How many programs a state pass over ``N`` sequences (``index.num_seqs``) runs: one per (value block of
    :func:`value_block`, sequence, head)."""
    return triton.cdiv(V, value_block(V, N * H, launch)) * N * H


def chunk_state_fwd(
    pre: Prepared,
    initial_state: torch.Tensor | None,
    index: ChunkIndex,
    *,
    V: int,
    h_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    residuals: torch.Tensor | None = None,
    launch: StateLaunch = DEFAULT_GEOMETRY.chunk_state,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward-direction state pass.

    Args:
        pre: the prepared chunk tensors. initial_state: fp32 ``[N, H, K, V]`` or None (zeros).
        index: chunk tables. V: value dim.
        h_out: the ``(h, v_new)`` tensors to write (allocated by the caller, e.g. on the stream that will use
            them when this pass runs on another); None allocates them here.
        residuals: ``E`` ``[tokens, H, V]`` in the storage dtype, as the forward kept it: the pass reads it
            instead of forming ``E = U − W S`` (``pre.u`` may then be None) and returns it as ``v_new``;
            ``h_out[1]``, if given, must be this tensor.
        launch: warps, stages, value block.

    Returns:
        ``(h [P, H, K, V] fp32, v_new [tokens, H, V] in the storage dtype)``.

    Raises:
        ValueError: ``h_out`` or ``residuals`` of another shape or dtype than the pass writes or reads, or not
            contiguous; ``h_out[1]`` not the ``residuals`` tensor; no ``residuals`` while ``pre.u`` is None; an
            ``index`` of other tokens or chunks than ``pre``.
    """
    TT, H, K = pre.w.shape
    N, P = index.num_seqs, index.num_chunks
    dev = pre.w.device
    check_index("chunk_state_fwd", TT, pre.gend.shape[0], index)
    if residuals is None and pre.u is None:
        raise ValueError(
            "chunk_state_fwd: pre.u is None (a prepare with store_u=False): pass the residuals E the forward "
            "kept, or prepare with U"
        )
    for name, t, shape, dtype in (
        ("h_out[0]", None if h_out is None else h_out[0], (P, H, K, V), torch.float32),
        ("h_out[1]", None if h_out is None else h_out[1], (TT, H, V), pre.w.dtype),
        ("residuals", residuals, (TT, H, V), pre.w.dtype),
    ):
        if t is not None:
            check_out(name, t, shape, dtype, dev)
    if residuals is not None and h_out is not None and h_out[1] is not residuals:
        raise ValueError("chunk_state_fwd: with residuals, h_out[1] must be the residuals tensor itself")
    if h_out is not None:
        h, v_new = h_out
    else:
        h = pre.w.new_empty(P, H, K, V, dtype=torch.float32)
        v_new = residuals if residuals is not None else pre.w.new_empty(TT, H, V)
    BV = value_block(V, N * H, launch)
    grid = (triton.cdiv(V, BV), N * H)
    chunk_state_fwd_kernel[grid](
        pre.w, pre.u, pre.kg, pre.gend, initial_state, h, v_new,
        index.cu_seqlens, index.chunk_offsets,
        H=H, DOT=dot_precision(pre.w.dtype), K=K, V=V, BT=CHUNK, BV=BV,
        USE_H0=initial_state is not None, LOAD_E=residuals is not None,
        **state_launch_options(grid[0] * grid[1], dev, launch),
    )  # fmt: skip
    return h, v_new
