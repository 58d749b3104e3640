"""The chunked KDA on the GPU: :func:`chunk_kda_triton`, the entry point, and :class:`ChunkKDAFunction`, the
autograd function of the training path.

One path per use:

* **Inference forward** (no gradient needed): the 16-token tile forward
  (:func:`~openk3.ops.kda.triton.tile_forward.tile_forward`: token-parallel prepare, then the recurrence, which
  writes ``o``), or, when its recurrence has at most one program per multiprocessor, the same on pairs of tiles
  (:func:`~openk3.ops.kda.triton.tile_pairs.pair_forward`).
* **Training forward** (docs/references.md#flashkda): the tile prepare, also writing each tile's
  ``(I + L)^{-1}`` and the L2-norm reciprocals; :func:`~openk3.ops.kda.triton.chunk_from_tiles.chunk_from_tiles`,
  which builds the 64-token chunks' ``Aqk`` and ``T`` from them; the tile recurrence. Saved: the inputs,
  ``Aqk``, ``T`` and the norms (264 bytes per token and head at bf16 and D = 128; fla saves ``Aqk``/``Akk``,
  docs/references.md#kda-chunked-form), and with ``KDAOptions.keep_residuals`` the recurrence's residuals ``E``.
* **Training backward** (docs/references.md#kda-chunked-backward), six launches: the backward's prepare
  (``W``, ``U``, ``Q̃``, ``K̂``, ``D`` from the saved ``T``), the forward-direction state pass keeping ``h``
  and ``E`` and the reverse state pass (at once, on two streams on CUDA: the reverse pass reads neither),
  the WY backward's two kernels, the intra-chunk backward. A single long sequence whose state passes have at
  most one program per multiprocessor is prepared segment by segment from its end on a side stream, the
  reverse pass following segment by segment (:mod:`~openk3.ops.kda.triton.pipeline`; the same bits as uncut).

The gradients cover q, k, v, the raw gate, β, ``A_log``, ``dt_bias`` and the initial state.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K``/``V`` key/value dims, ``N`` sequences.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from openk3.ops.kda.triton.chunk_from_tiles import chunk_from_tiles
from openk3.ops.kda.triton.chunk_grad_intra import chunk_grad_intra
from openk3.ops.kda.triton.chunk_grad_wy import chunk_grad_wy
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex, fixed_length_index, varlen_index
from openk3.ops.kda.triton.chunk_prepare import Prepared, Saved, chunk_prepare, empty_prepared
from openk3.ops.kda.triton.chunk_state import chunk_state_fwd, state_programs
from openk3.ops.kda.triton.chunk_state_bwd import chunk_state_bwd
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, DEFAULT_OPTIONS, KDAOptions, LaunchConfig
from openk3.ops.kda.triton.dispatch import needs_grad
from openk3.ops.kda.triton.pipeline import carried_states, pipelined, segment_of, segments, side_stream
from openk3.ops.kda.triton.tile_forward import (
    TILE,
    empty_tile_backward,
    tile_forward,
    tile_prepare,
    tile_recurrence,
)
from openk3.ops.kda.triton.tile_pairs import PAIR, pair_forward, use_pairs


def recurrence_programs(V: int, H: int, N: int, launch: LaunchConfig) -> int:
    """How many programs the tile recurrence runs over ``N`` sequences (one per value block, sequence, head)."""
    return state_programs(
        V, H, N, replace(launch.chunk_state, value_block=launch.tile_recurrence.value_block)
    )


def backward_state_passes(
    pre: Prepared,
    h0: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    index: ChunkIndex,
    residuals: torch.Tensor | None = None,
    launch: LaunchConfig = DEFAULT_GEOMETRY,
) -> tuple[torch.Tensor, ...]:
    """The backward's two state passes: the forward-direction pass keeping ``h`` and ``E``
    (:func:`~openk3.ops.kda.triton.chunk_state.chunk_state_fwd`; with ``residuals``, the ``E`` the forward
    kept, it writes ``h`` only) and the reverse pass
    (:func:`~openk3.ops.kda.triton.chunk_state_bwd.chunk_state_bwd`).

    The reverse pass reads ``Q̃``, ``K̂``, ``W``, ``D``, ``Aqk`` and ``dO``, not ``h`` or ``E``, so on CUDA the
    forward-direction pass runs on a side stream (:func:`~openk3.ops.kda.triton.pipeline.side_stream`) while
    the reverse pass runs on the current one, which then waits for it (same bits either way). ``h`` and ``E``
    are allocated on the current stream before the side pass writes them, so the caching allocator reuses
    their memory there as usual (no ``record_stream``); the work runs on ``do``'s device.

    Returns:
        ``(h fp32 [P, H, K, V], v_new [tokens, H, V], dh fp32 [P, H, K, V], dv_new [tokens, H, V], dh0 fp32
        [N, H, K, V])``.
    """
    TT, H, K = pre.w.shape
    h = pre.w.new_empty(index.num_chunks, H, K, do.shape[-1], dtype=torch.float32)
    v_new = pre.w.new_empty(TT, H, do.shape[-1]) if residuals is None else residuals

    def forward_pass() -> None:
        chunk_state_fwd(
            pre, h0, index, V=do.shape[-1], h_out=(h, v_new), residuals=residuals, launch=launch.chunk_state
        )

    if not do.is_cuda:
        forward_pass()
        return (h, v_new, *chunk_state_bwd(pre, do, dht, index, launch=launch.chunk_state))
    with torch.cuda.device(do.device):
        main = torch.cuda.current_stream()
        side = side_stream(do.device)
        side.wait_stream(main)  # the side pass reads what the current stream wrote, and writes h, E
        with torch.cuda.stream(side):
            forward_pass()
        reverse = chunk_state_bwd(pre, do, dht, index, launch=launch.chunk_state)
        main.wait_stream(side)
    return (h, v_new, *reverse)


def backward_passes(
    q, k, v, g, beta, A_log, dt_bias, h0, saved: Saved, do, dht, index: ChunkIndex, opts: dict,
    residuals: torch.Tensor | None = None, launch: LaunchConfig = DEFAULT_GEOMETRY,
) -> tuple[Prepared, torch.Tensor, ...]:  # fmt: skip
    """The backward's prepare (from ``saved``'s ``T`` and norms) and its two state passes
    (:func:`backward_state_passes`). A long single sequence
    (:func:`~openk3.ops.kda.triton.pipeline.segments`) is prepared segment by segment from its end on a side
    stream, the reverse pass following segment by segment on a high-priority one, and the forward-direction
    pass runs on the side stream once all is prepared (same bits). With ``residuals`` (``E`` ``[tokens, H,
    V]`` in the storage dtype, kept by the forward) the prepare skips ``U``.

    Returns:
        ``(pre, h, v_new, dh, dv_new, dh0)`` (``v_new`` is ``residuals`` when given).
    """
    store_u = residuals is None
    prep = dict(opts, store_u=store_u, launch=launch.chunk_prepare)
    programs = state_programs(do.shape[-1], q.shape[1], index.num_seqs, launch.chunk_state)
    segs = segments(index, CHUNK, do.device, programs, launch.pipeline)
    if segs is None:
        pre = chunk_prepare(q, k, v, g, beta, A_log, dt_bias, index, saved, **prep)
        return (pre, *backward_state_passes(pre, h0, do, dht, index, residuals, launch))
    pre = empty_prepared(q, v, index, saved, store_u=store_u)
    TT, H, K = q.shape
    V = do.shape[-1]
    h, dh = (pre.w.new_empty(index.num_chunks, H, K, V, dtype=torch.float32) for _ in range(2))
    v_new = pre.w.new_empty(TT, H, V) if residuals is None else residuals
    dv_new = pre.w.new_empty(TT, H, V)
    grads = carried_states(dht, len(segs), True, (1, H, K, V), do.device)  # from the end: dht, ..., dh0
    last = len(segs) - 1

    def produce(j: int) -> None:
        s = segs[last - j]
        cut = (t[s.start : s.stop] for t in (q, k, v, g, beta))
        chunk_prepare(*cut, A_log, dt_bias, s.index, segment_of(saved, s), out=segment_of(pre, s), **prep)

    def forward_pass() -> None:
        chunk_state_fwd(pre, h0, index, V=V, h_out=(h, v_new), residuals=residuals, launch=launch.chunk_state)

    def consume(j: int) -> None:
        s = segs[last - j]
        out = (dh[s.chunk_start : s.chunk_stop], dv_new[s.start : s.stop], grads[j + 1])
        chunk_state_bwd(segment_of(pre, s), do[s.start : s.stop], grads[j], s.index, out=out,
                        launch=launch.chunk_state)  # fmt: skip

    pipelined(do.device, len(segs), produce, consume, side_tail=forward_pass)
    return pre, h, v_new, dh, dv_new, grads[-1]


class ChunkKDAFunction(torch.autograd.Function):
    """The training path. Inputs are flat ``[tokens, H, ·]`` and contiguous; see :func:`chunk_kda_triton`.
    ``index``: the chunks of 64 the backward works on; ``tiles``: the same sequences in tiles of 16."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, index, tiles, scale, lower_bound, use_l2norm,
                output_final_state, beta_sigmoid, options=DEFAULT_OPTIONS, launch=DEFAULT_GEOMETRY):  # fmt: skip
        opts = dict(scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm, beta_sigmoid=beta_sigmoid)
        back = empty_tile_backward(q, use_l2norm=use_l2norm)
        pre = tile_prepare(
            q, k, g, beta, A_log, dt_bias, tiles, **opts, for_backward=back,
            fp32_gated_keys=options.fp32_gated_keys, launch=launch.tile_prepare,
        )  # fmt: skip
        e = pre.M.new_empty(v.shape) if options.keep_residuals else None
        Aqk, Akk = chunk_from_tiles(
            pre, back, beta, index, tiles, use_l2norm=use_l2norm, beta_sigmoid=beta_sigmoid,
            launch=launch.chunk_from_tiles,
        )  # fmt: skip
        o, ht = tile_recurrence(
            pre, v, h0, tiles, output_final_state=output_final_state, e_out=e, launch=launch.tile_recurrence,
            state_launch=launch.chunk_state,
        )  # fmt: skip
        kept = (Aqk, Akk, back.q_rstd, back.k_rstd) + (() if e is None else (e,))
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, *kept)
        ctx.index, ctx.opts, ctx.launch = index, opts, launch
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *kept = ctx.saved_tensors
        index, opts, launch = ctx.index, ctx.opts, ctx.launch
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        residuals = kept[4] if len(kept) > 4 else None  # E, when the forward kept it (keep_residuals)
        pre, h, v_new, dh, dv_new, dh0 = backward_passes(
            q, k, v, g, beta, A_log, dt_bias, h0, Saved(*kept[:4]), do, dht, index, opts, residuals, launch
        )
        wy = chunk_grad_wy(
            q, k, v, g, beta, A_log, dt_bias, pre, h, dh, v_new, dv_new, do, index, **opts,
            launch=launch.chunk_grad_wy,
        )  # fmt: skip
        dq, dk, dg, dbeta, dA_log, ddt = chunk_grad_intra(
            q, k, g, beta, A_log, dt_bias, pre, wy, index, **opts, launch=launch.chunk_grad_intra
        )
        return (
            dq, dk, wy.dv, dg, dbeta, dA_log.to(A_log.dtype),
            None if dt_bias is None else ddt.to(dt_bias.dtype),
            None if h0 is None else dh0,
            *(None,) * 9,
        )  # fmt: skip


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    seq_lens: tuple[int, ...] | None,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
    use_beta_sigmoid_in_kernel: bool = False,
    options: KDAOptions | None = None,
    launch: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~openk3.ops.kda.chunk.chunk_kda` with the K3 gate in the kernel (arguments checked there).

    Args:
        q, k, g: ``[B, T, H, K]`` (g raw). v: ``[B, T, H, V]``. beta: ``[B, T, H]`` post-sigmoid, or logits
            with ``use_beta_sigmoid_in_kernel`` (the kernels apply ``σ`` in fp32; its gradient is w.r.t.
            the logits).
        scale: multiplies q. initial_state: fp32 ``[N, H, K, V]`` or None.
        seq_lens, cu_seqlens: the documents of a packed row (``B = 1``), or None for ``B`` rows.
        A_log: ``[H' ≥ H]`` (first H used); dt_bias ``[H*K]`` or None; lower_bound in ``[−5, 0)``.
        options: the memory/precision trades (:class:`~openk3.ops.kda.triton.config.KDAOptions`; None: all
            off). launch: the kernels' launch geometry (None: the defaults; benchmark sweeps pass others).

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state fp32 [N, H, K, V] or None)``; differentiable. A call that
        needs no gradient (grad mode off, or no input requiring grad) runs the inference forward (tiles, or
        pairs of tiles when :func:`~openk3.ops.kda.triton.tile_pairs.use_pairs`); one that needs a gradient
        runs :class:`ChunkKDAFunction`.

    Raises:
        ValueError: ``options`` not a ``KDAOptions`` or ``launch`` not a ``LaunchConfig``.
    """
    options = KDAOptions() if options is None else options
    launch = LaunchConfig() if launch is None else launch
    if not isinstance(options, KDAOptions):
        raise ValueError(f"options must be a KDAOptions; got {type(options).__name__}")
    if not isinstance(launch, LaunchConfig):
        raise ValueError(f"launch must be a LaunchConfig; got {type(launch).__name__}")
    B, T, H, K = q.shape
    V = v.shape[-1]

    def chunk_index(size: int) -> ChunkIndex:
        if seq_lens is None:
            return fixed_length_index(B, T, q.device, size)
        return varlen_index(cu_seqlens, seq_lens, size)

    flat = [t.reshape(B * T, H, -1).contiguous() for t in (q, k, v, g)]
    args = (
        *flat, beta.reshape(B * T, H).contiguous(), A_log[:H].contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
        None if initial_state is None else initial_state.contiguous(),
    )  # fmt: skip
    if not needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        N = B if seq_lens is None else len(seq_lens)
        pairs = use_pairs(recurrence_programs(V, H, N, launch), q.device)
        o, ht = (pair_forward if pairs else tile_forward)(
            *args, chunk_index(PAIR if pairs else TILE), scale=scale, lower_bound=lower_bound,
            use_l2norm=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
            beta_sigmoid=use_beta_sigmoid_in_kernel, options=options, launch=launch,
        )  # fmt: skip
    else:
        o, ht = ChunkKDAFunction.apply(
            *args, chunk_index(CHUNK), chunk_index(TILE), scale, lower_bound, use_qk_l2norm_in_kernel,
            output_final_state, use_beta_sigmoid_in_kernel, options, launch,
        )  # fmt: skip
    return o.view(B, T, H, V), ht
