"""The sequential state pass of the chunked KDA forward (docs/references.md#kda-chunked-form): one program per (value block, sequence,
head) walks its chunks in order with the state slice ``S [K, BV]`` in fp32 registers.

Per chunk, from :mod:`~openk3.ops.kda.triton.chunk_prepare`'s tensors::

    E   = U − W S                       the delta-rule residuals of the chunk ("v_new")
    O   = Q̃ S + Aqk E                   (STORE_O)
    S  ← Diag(D) S + K̂ᵀ E

The matmul operands are in the storage dtype (bf16 for bf16 inputs, as in fla's ``chunk_gated_delta_rule_
fwd_h``); accumulation and the carried state are fp32. The backward reuses the pass with ``STORE_H``: it then
keeps the state at every chunk start (``h``) and ``E`` instead of computing ``O``. Given ``E`` (``LOAD_E``:
the residuals the training forward kept, ``chunk_function.LAUNCH["keep_residuals"]``) it reads them instead
of forming them and only rebuilds ``h``: ``S ← Diag(D) S + K̂ᵀ E``, no product through ``S`` on the chain.

Legend: ``N`` sequences, ``H`` heads, ``K``/``V`` key/value dims, ``BV`` value block, ``BT`` chunk rows,
``P`` chunks of all sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import Prepared
from openk3.ops.kda.triton.kernel_math import (
    check_index,
    check_launch_entries,
    check_out,
    dot,
    dot_precision,
    launch_options,
    load_rows,
    state_program,
    store_rows,
)
from openk3.ops.kda.triton.pipeline import overlaps


@triton.jit
def chunk_state_fwd_kernel(
    w, u, qg, kg, Aqk, gend, h0, o, ht, h, v_new,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_H: tl.constexpr,
    LOAD_E: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``. ``h0``/``ht`` fp32 ``[N, H, K, V]``; ``h`` ``[P, H, K, V]``; ``o``/``v_new``
    ``[tokens, H, V]`` (``v_new`` read instead of written with ``LOAD_E``)."""
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
        if STORE_H:
            p_h = ((c0 + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(h + p_h, b_Sd.to(h.dtype.element_ty))
        if LOAD_E:
            b_ed = load_rows(v_new, t0, n_valid, i_h, v0, H, V, BT, BV)
        else:
            b_w = load_rows(w, t0, n_valid, i_h, 0, H, K, BT, K)
            b_e = load_rows(u, t0, n_valid, i_h, v0, H, V, BT, BV).to(tl.float32) - dot(b_w, b_Sd, DOT)
            b_ed = b_e.to(dt)
            if STORE_H:
                store_rows(v_new, b_ed, t0, n_valid, i_h, v0, H, V, BT, BV)
        if STORE_O:
            b_qg = load_rows(qg, t0, n_valid, i_h, 0, H, K, BT, K)
            b_A = load_rows(Aqk, t0, n_valid, i_h, 0, H, BT, BT, BT)
            b_o = dot(b_qg, b_Sd, DOT) + dot(b_A, b_ed, DOT)
            store_rows(o, b_o, t0, n_valid, i_h, v0, H, V, BT, BV)
        b_kg = load_rows(kg, t0, n_valid, i_h, 0, H, K, BT, K)
        b_D = tl.load(gend + ((c0 + i_t) * H + i_h) * K + o_k)
        b_S = b_S * b_D[:, None] + dot(tl.trans(b_kg), b_ed, DOT)
    if STORE_FINAL:
        tl.store(ht + p_state, b_S)


LAUNCH = {"num_warps": 4, "num_stages": 1, "few_program_stages": 2, "min_programs": 256, "value_block": 0}
"""Launch configuration of the state passes: warps, pipeline stages, the pipeline stages of a pass with at
most one program per multiprocessor (``few_program_stages``; 0: ``num_stages``), the fewest programs for
which the value block is 64 wide (else 32), or a fixed value block (``value_block`` > 0);
``benchmarks/kda.py --sweep`` times the alternatives.

A pass with one program per multiprocessor is bound by the latency of its chain alone, and two stages (the
next chunk's tensor-core operands fetched while this one's products run) shorten it; with several programs
per multiprocessor the extra shared memory costs more than it hides. On the H200 (``benchmarks/results/
kda_h200.md``) at B1 T32768 H32 (128 programs) one / two / three stages took the forward-direction pass
(h, E) 1.36 / 1.22 / 0.91 ms, the reverse pass 2.16 / 1.35 / 1.15, and the two at once (as the backward
runs them) 2.51 / 1.63 / 2.04; at B1 T8192 H96 (384 programs) 0.59 / 0.73 / 0.78, 0.79 / 1.09 / 0.91 and
1.39 / 1.78 / 1.63."""


def check_launch() -> None:
    """Raise ``ValueError`` unless :data:`LAUNCH` has its keys, each of its kind
    (:func:`~openk3.ops.kda.triton.kernel_math.check_launch_entries`)."""
    check_launch_entries(
        "chunk_state",
        LAUNCH,
        dict(
            num_warps="warps",
            num_stages="stages",
            few_program_stages="count",
            min_programs="count",
            value_block="block_or_0",
        ),
    )


def value_block(V: int, programs_per_block: int, fixed: int | None = None) -> int:
    """Value-block width: ``fixed`` (default ``LAUNCH["value_block"]``) if set, else 64, or 32 when fewer than
    ``LAUNCH["min_programs"]`` programs would run (long single sequences with few heads); never above ``V``."""
    fixed = LAUNCH["value_block"] if fixed is None else fixed
    if fixed:
        return min(fixed, V)
    bv = 64 if programs_per_block * max(V // 64, 1) >= LAUNCH["min_programs"] else 32
    return min(bv, V)


def state_launch_options(programs: int, device: torch.device) -> dict:
    """The launch keywords of a state pass of ``programs`` programs on ``device``: :data:`LAUNCH`'s, with
    ``few_program_stages`` (when set) as the stages where the pass has at most one program per multiprocessor
    (:func:`~openk3.ops.kda.triton.pipeline.overlaps`)."""
    options = launch_options(LAUNCH)
    if LAUNCH["few_program_stages"] and overlaps(device, programs):
        options["num_stages"] = LAUNCH["few_program_stages"]
    return options


def state_programs(V: int, H: int, N: int, fixed: int | None = None) -> int:
    """How many programs a state pass over ``N`` sequences (``index.num_seqs``) runs: one per (value block of
    :func:`value_block`, sequence, head)."""
    return triton.cdiv(V, value_block(V, N * H, fixed)) * N * H


def chunk_state_fwd(
    pre: Prepared,
    initial_state: torch.Tensor | None,
    index: ChunkIndex,
    *,
    V: int,
    out_dtype: torch.dtype,
    output_final_state: bool,
    store_h: bool,
    store_o: bool,
    h_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    o_out: torch.Tensor | None = None,
    ht_out: torch.Tensor | None = None,
    residuals: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the state pass.

    Args:
        pre: the prepared chunk tensors. initial_state: fp32 ``[N, H, K, V]`` or None (zeros).
        index: chunk tables. V: value dim. out_dtype: dtype of ``o``.
        output_final_state: return the fp32 ``[N, H, K, V]`` state after each sequence.
        store_h: return ``h`` ``[P, H, K, V]`` (the state at each chunk start) and ``v_new`` = ``E``
            ``[tokens, H, V]``, both in the storage dtype.
        store_o: return ``o`` (the backward's pass needs none).
        h_out: with ``store_h``, the ``(h, v_new)`` tensors to write (allocated by the caller, e.g. on the
            stream that will use them when this pass runs on another); None allocates them here.
        o_out, ht_out: with ``store_o`` / ``output_final_state``, the ``o`` / final-state tensor to write;
            None allocates it here.
        residuals: ``E`` ``[tokens, H, V]`` in the storage dtype, as a forward kept it: the pass reads it
            instead of forming ``E = U − W S`` (the kernel then loads neither ``W`` nor ``U``, so ``pre.u``
            may be None) and returns it as ``v_new``; ``h_out[1]``, if given, must be this tensor.

    Returns:
        ``(o, final_state, h, v_new)``, each None when not asked for.

    Raises:
        ValueError: ``h_out``, ``o_out``, ``ht_out`` or ``residuals`` of another shape or dtype than the pass
            writes or reads, or not contiguous (:func:`~openk3.ops.kda.triton.kernel_math.check_out`);
            ``h_out[1]`` not the ``residuals`` tensor; no ``residuals`` while ``pre.u`` is None; an ``index``
            of other tokens or chunks than ``pre`` (:func:`~openk3.ops.kda.triton.kernel_math.check_index`).
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
        ("o_out", o_out, (TT, H, V), out_dtype),
        ("ht_out", ht_out, (N, H, K, V), torch.float32),
        ("h_out[0]", None if h_out is None else h_out[0], (P, H, K, V), pre.w.dtype),
        ("h_out[1]", None if h_out is None else h_out[1], (TT, H, V), pre.w.dtype),
        ("residuals", residuals, (TT, H, V), pre.w.dtype),
    ):
        if t is not None:
            check_out(name, t, shape, dtype, dev)
    if residuals is not None and h_out is not None and h_out[1] is not residuals:
        raise ValueError("chunk_state_fwd: with residuals, h_out[1] must be the residuals tensor itself")
    o = (pre.w.new_empty(TT, H, V, dtype=out_dtype) if o_out is None else o_out) if store_o else None
    ht = None
    if output_final_state:
        ht = pre.w.new_empty(N, H, K, V, dtype=torch.float32) if ht_out is None else ht_out
    if h_out is not None:
        h, v_new = h_out
    else:
        h = pre.w.new_empty(P, H, K, V) if store_h else None
        v_new = residuals if residuals is not None else pre.w.new_empty(TT, H, V) if store_h else None
    BV = value_block(V, N * H)
    grid = (triton.cdiv(V, BV), N * H)
    chunk_state_fwd_kernel[grid](
        pre.w, pre.u, pre.qg, pre.kg, pre.Aqk, pre.gend, initial_state, o, ht, h, v_new,
        index.cu_seqlens, index.chunk_offsets,
        H=H, DOT=dot_precision(pre.w.dtype), K=K, V=V, BT=CHUNK, BV=BV,
        USE_H0=initial_state is not None, STORE_O=store_o, STORE_FINAL=output_final_state,
        STORE_H=store_h, LOAD_E=residuals is not None, **state_launch_options(grid[0] * grid[1], dev),
    )  # fmt: skip
    return o, ht, h, v_new
