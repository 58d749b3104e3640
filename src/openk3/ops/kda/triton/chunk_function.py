"""The chunked KDA on the GPU as an autograd Function: forward in three launches, backward in five.

Forward (docs/references.md#flashkda, :func:`tile_forward_passes`, by default): the 16-token tile forward
(:mod:`~openk3.ops.kda.triton.tile_forward`: token-parallel prepare, whose ``for_backward`` outputs add each
tile's ``(I + L)^{-1}`` and the l2norm reciprocal norms, then the recurrence, which writes ``o``), and
:func:`~openk3.ops.kda.triton.chunk_from_tiles.chunk_from_tiles`, which builds the 64-token chunks' ``Aqk``
and ``T`` from the prepare's tensors. With ``LAUNCH["forward_on_tiles"]`` off or ``keep_intermediates`` on
(:func:`forward_passes`, docs/references.md#kda-chunked-form): :func:`~openk3.ops.kda.triton.chunk_prepare.chunk_prepare` (gate, L2 norm,
``Aqk``, ``T``, ``W``, ``U``, ``Q̃``, ``K̂``) then :func:`~openk3.ops.kda.triton.chunk_state.chunk_state_fwd`
(the sequential state pass, which also writes ``o``). Saved either way: the inputs, ``Aqk``, ``T`` and the
norms (392 bytes per token and head at bf16, 264 with ``T`` in fp16; fla saves ``Aqk``/``Akk``, docs/references.md#kda-chunked-form), and
with ``LAUNCH["keep_residuals"]`` also the residuals ``E`` the tile recurrence wrote (256 more at V = 128).

Backward (docs/references.md#kda-chunked-backward): the prepare kernel's second pass only (``W``, ``U``, ``Q̃``, ``K̂`` from the saved ``T``),
the state pass keeping the per-chunk states ``h`` and the residuals ``E``, the reverse state pass, then the
per-chunk WY and intra-chunk gradient kernels.
The gradients cover q, k, v, the raw gate, β, ``A_log``, ``dt_bias`` and the initial state.

With :data:`LAUNCH` ``["keep_intermediates"]`` the forward's state pass also writes ``h`` and ``E`` and the
forward keeps them with ``W``, ``Q̃``, ``K̂`` and ``D``, so the backward starts at the reverse state pass.
With ``LAUNCH["keep_residuals"]`` the forward keeps ``E`` alone, and the backward's forward-direction pass
only rebuilds ``h`` from it. Without ``keep_intermediates``, with ``LAUNCH["overlap_state_passes"]`` on CUDA,
the backward runs its two state passes at once (:func:`backward_state_passes`).

A single long sequence whose state passes have at most one program per multiprocessor is cut into segments
(:mod:`~openk3.ops.kda.triton.pipeline`; :func:`forward_passes`, :func:`backward_passes`): each segment's
prepare on a side stream beside the state pass over the segment before, the same bits as uncut.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K``/``V`` key/value dims, ``N`` sequences.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.triton.chunk_from_tiles import check_launch as check_from_tiles_launch
from openk3.ops.kda.triton.chunk_from_tiles import chunk_from_tiles
from openk3.ops.kda.triton.chunk_grad_intra import check_launch as check_grad_intra_launch
from openk3.ops.kda.triton.chunk_grad_intra import chunk_grad_intra
from openk3.ops.kda.triton.chunk_grad_wy import check_launch as check_grad_wy_launch
from openk3.ops.kda.triton.chunk_grad_wy import chunk_grad_wy
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex, fixed_length_index, varlen_index
from openk3.ops.kda.triton.chunk_prepare import Prepared, chunk_prepare, empty_prepared
from openk3.ops.kda.triton.chunk_state import chunk_state_fwd, state_programs
from openk3.ops.kda.triton.chunk_state_bwd import chunk_state_bwd
from openk3.ops.kda.triton.dispatch import needs_grad
from openk3.ops.kda.triton.kernel_math import check_launch_entries
from openk3.ops.kda.triton.pipeline import (
    Segment,
    carried_states,
    forward_segments,
    overlaps,
    pipelined,
    segment_of,
    segments,
    side_stream,
)
from openk3.ops.kda.triton.tile_forward import LAUNCH as TILE_LAUNCH
from openk3.ops.kda.triton.tile_forward import (
    TILE,
    empty_tile_backward,
    tile_forward,
    tile_prepare,
    tile_recurrence,
)
from openk3.ops.kda.triton.tile_forward import check_launch as check_tile_launch
from openk3.ops.kda.triton.tile_pairs import PAIR, pair_forward, use_pairs

LAUNCH = {
    "keep_intermediates": False,
    "overlap_state_passes": True,
    "forward_on_tiles": True,
    "overlap_from_tiles": False,
    "keep_residuals": False,
}
"""``keep_intermediates``: trade memory for the backward's first two launches. The forward keeps what the
backward would recompute (``W``, ``Q̃``, ``K̂`` and ``E`` in the input dtype, ``D``, and ``h``, the state at
each chunk start; not ``U``, which the backward no longer reads): ``(3K + V)·2 + K·V·2/64`` bytes per token
and head more, 1.5 KB at K = V = 128 and bf16. At B1 T8192 H96 D128 bf16 on the H200 (``benchmarks/results/
kda_h200_dl_runs.txt``, run 5) one call held 1.22 GB between forward and backward against 0.21 GB, its peak
was 4.47 GB against 4.67–4.87 (the backward allocates no recomputed tensors), and forward+backward took
11.75 / 11.87 / 17.79 / 15.32 ms at the four benchmark shapes, against 12.73 and 19.29 ms by default at the
first and third (run 2; 12.97 at the first in run 5, where fla took 13.67). Outputs and gradients are
bitwise those of the default (both passes compute one ``U`` from the fp16 ``T``; tested on the GPU and in the
interpreter). Off by default: with many layers the 1 GB per layer and sequence of saved activations, not one
layer's peak, bounds training sizes.

``overlap_state_passes``: see :func:`backward_state_passes`.

``forward_on_tiles`` (unless ``keep_intermediates``): the forward runs the 16-token tile forward
(:mod:`~openk3.ops.kda.triton.tile_forward`, which writes ``o``) and builds what the backward saves from its
prepare (:func:`~openk3.ops.kda.triton.chunk_from_tiles.chunk_from_tiles`), instead of the 64-token prepare
and state pass; :func:`tile_forward_passes`. ``overlap_from_tiles``: with it on CUDA, and a recurrence of at
most one program per multiprocessor, the building runs beside the recurrence, which gets a high-priority
side stream. Off by default: at B1 T32768 H32 D128 on the H200 forward+backward took either about 0.2–0.5 ms
less than one after the other or 1.5–1.7 ms more, from one call to the next (before the recurrence was queued
first: 1 of 4 timings at 14.36 ms and 3 at 16.35–16.42, against 14.72–14.82; with it, and with a pipeline
launch order since dropped: 4 of 5 at 14.78–14.94 and one at 16.85, against 15.11–15.30;
docs/LOG.md, runs 2 and 3).

``keep_residuals`` (read with ``forward_on_tiles`` and without ``keep_intermediates``): trade memory for the
backward's forward-direction state pass. The tile recurrence also writes the delta-rule residuals ``E`` (the
backward's ``v_new``, ``V·2`` bytes per token and head at bf16, 256 at V = 128; the per-token residual is
the same whatever the chunking) and the forward keeps them. The backward then rebuilds the chunk-start states
``h`` from them (:func:`~openk3.ops.kda.triton.chunk_state.chunk_state_fwd` with ``residuals``:
``S ← Diag(D) S + K̂ᵀ E``, no product through ``S`` on its chain) instead of forming ``E = U − W S`` along
the chain, and its prepare skips ``U``. On the H200 (B1 T8192 H96 / varlen 1024×8 / B1 T32768 H32 /
B8 T4096 H32, D128 bf16; one process, each setting timed twice in turn; ``benchmarks/results/
kda_h200_2026-11-30c_runs.txt``, run 12) forward+backward took 10.97–11.00 / 10.94–10.95 / 15.00–15.07 /
13.90–14.03 ms against 11.26–11.28 / 11.25–11.32 / 15.53–15.58 / 14.49–14.51, and one call held 192 / 192 /
256 / 256 MiB more between forward and backward. Off by default, for that memory: the bytes saved per token
and head beside the inputs go from 264 to 520 at bf16 (392 to 648 with ``T`` in fp32; fla 0.6.0 saves 256 of
``Aqk`` and ``Akk``, docs/references.md#kda-chunked-form), and with many layers the saved activations bound training
sizes (as for ``keep_intermediates``).

Every entry must be ``True`` or ``False`` (:func:`check_launch`)."""


def check_launch() -> None:
    """Raise ``ValueError`` unless :data:`LAUNCH` has exactly its keys and each is a bool (a string such as
    ``"False"`` would otherwise read as true; :func:`~openk3.ops.kda.triton.kernel_math.check_launch_entries`);
    :func:`chunk_kda_triton` calls it before any work on the training path."""
    check_launch_entries(
        "chunk_function",
        LAUNCH,
        dict(
            keep_intermediates="bool",
            overlap_state_passes="bool",
            forward_on_tiles="bool",
            overlap_from_tiles="bool",
            keep_residuals="bool",
        ),
    )


def backward_state_passes(
    pre: Prepared,
    h0: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    index: ChunkIndex,
    residuals: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The backward's two state passes: the forward-direction pass keeping ``h`` and ``E``
    (:func:`~openk3.ops.kda.triton.chunk_state.chunk_state_fwd`) and the reverse pass
    (:func:`~openk3.ops.kda.triton.chunk_state_bwd.chunk_state_bwd`).

    The reverse pass reads ``Q̃``, ``K̂``, ``W``, ``D``, ``Aqk`` and ``dO``, not ``h`` or ``E``, so the two are
    independent. With ``LAUNCH["overlap_state_passes"]`` and CUDA tensors the forward-direction pass runs on a
    side stream (:func:`side_stream`) while the reverse pass runs on the current one, which then waits for
    it: each pass has one program per (value block, sequence, head), 128 at B1 T32768 H32 D128, one per
    multiprocessor, so two passes can share the GPU. The results are the same bits either way. ``h`` and
    ``E`` are allocated on the current stream before the side pass writes them, so the caching allocator
    reuses their memory there as usual (no ``record_stream``, which would hold it until the end of a CUDA
    graph capture); the work runs on ``do``'s device whatever the current device is. With ``residuals``
    (``E`` ``[tokens, H, V]`` in the storage dtype, kept by the forward,
    :data:`LAUNCH` ``["keep_residuals"]``) the forward-direction pass reads them and writes ``h`` only.

    Returns:
        ``(h [P, H, K, V], v_new [tokens, H, V], dh [P, H, K, V], dv_new [tokens, H, V], dh0 fp32
        [N, H, K, V])``.
    """
    TT, H, K = pre.w.shape
    h = pre.w.new_empty(index.num_chunks, H, K, do.shape[-1])
    v_new = pre.w.new_empty(TT, H, do.shape[-1]) if residuals is None else residuals

    def forward_pass() -> None:
        chunk_state_fwd(
            pre, h0, index, V=do.shape[-1], out_dtype=do.dtype, output_final_state=False, store_h=True,
            store_o=False, h_out=(h, v_new), residuals=residuals,
        )  # fmt: skip

    if not (LAUNCH["overlap_state_passes"] and do.is_cuda):
        forward_pass()
        return (h, v_new, *chunk_state_bwd(pre, do, dht, index))
    with torch.cuda.device(do.device):
        main = torch.cuda.current_stream()
        side = side_stream(do.device)
        side.wait_stream(main)  # the side pass reads what the current stream wrote, and writes h, E
        with torch.cuda.stream(side):
            forward_pass()
        reverse = chunk_state_bwd(pre, do, dht, index)
        main.wait_stream(side)
    return (h, v_new, *reverse)


def forward_passes(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    h0,
    index: ChunkIndex,
    *,
    keep: bool,
    output_final_state: bool,
    opts: dict,
) -> tuple[Prepared, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The forward's prepare and state pass (``h`` and ``E`` kept with ``keep``). A long single sequence
    (:func:`~openk3.ops.kda.triton.pipeline.segments`) is cut into segments, each one's prepare on a side
    stream beside the state pass over the one before (same bits).

    Returns:
        ``(pre, o, final_state or None, h or None, v_new or None)`` as :func:`chunk_prepare` and
        :func:`chunk_state_fwd` return them.
    """
    H, K, V = q.shape[1], q.shape[2], v.shape[-1]
    fwd = dict(V=V, out_dtype=v.dtype, store_h=keep, store_o=True)
    segs = segments(index, CHUNK, q.device, state_programs(V, H, index.num_seqs))
    if segs is None:
        pre = chunk_prepare(q, k, v, g, beta, A_log, dt_bias, index, **opts)
        return (pre, *chunk_state_fwd(pre, h0, index, output_final_state=output_final_state, **fwd))
    pre = empty_prepared(q, v, index, use_l2norm=opts["use_l2norm"])
    o = v.new_empty(v.shape)
    h = pre.w.new_empty(index.num_chunks, H, K, V) if keep else None
    v_new = pre.w.new_empty(v.shape) if keep else None

    def prepare(s: Segment) -> None:
        cut = (t[s.start : s.stop] for t in (q, k, v, g, beta))
        chunk_prepare(*cut, A_log, dt_bias, s.index, out=segment_of(pre, s), **opts)

    def state_pass(s: Segment, h_in: torch.Tensor | None, h_out: torch.Tensor | None) -> None:
        kept = (h[s.chunk_start : s.chunk_stop], v_new[s.start : s.stop]) if keep else None
        chunk_state_fwd(
            segment_of(pre, s), h_in, s.index, output_final_state=h_out is not None, h_out=kept,
            o_out=o[s.start : s.stop], ht_out=h_out, **fwd,
        )  # fmt: skip

    ht = forward_segments(segs, q.device, h0, output_final_state, (1, H, K, V), prepare, state_pass)
    return pre, o, ht, h, v_new


def tile_forward_passes(
    q, k, v, g, beta, A_log, dt_bias, h0, index: ChunkIndex, tiles: ChunkIndex, *, output_final_state: bool,
    opts: dict, keep_residuals: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:  # fmt: skip
    """The forward on 16-token tiles with what the backward saves: the tile prepare (also writing each
    tile's inverse and the norms), the tile recurrence (``o`` and the final state) and
    :func:`~openk3.ops.kda.triton.chunk_from_tiles.chunk_from_tiles` (the chunks' ``Aqk`` and ``T``). The last
    two read only the prepare's tensors; with ``LAUNCH["overlap_from_tiles"]`` and a recurrence of at most one
    program per multiprocessor (:func:`~openk3.ops.kda.triton.pipeline.overlaps`) the recurrence runs on a
    high-priority side stream while the building runs on the current one (same bits).

    Args:
        index: the chunks of 64 the backward works on; tiles: the same sequences in tiles of 16.
        keep_residuals: the recurrence also writes the residuals ``E``
            (:data:`LAUNCH` ``["keep_residuals"]``).

    Returns:
        ``(o, final_state or None, (Aqk, Akk, q_rstd, k_rstd))``, with ``E`` ``[tokens, H, V]`` (storage
        dtype) appended to the tuple under ``keep_residuals``.
    """
    back = empty_tile_backward(q, use_l2norm=opts["use_l2norm"])
    pre = tile_prepare(q, k, g, beta, A_log, dt_bias, tiles, **opts, for_backward=back)
    e = pre.M.new_empty(v.shape) if keep_residuals else None
    extra = () if e is None else (e,)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_from_tiles(
            pre, back, beta, index, tiles, use_l2norm=opts["use_l2norm"], beta_sigmoid=opts["beta_sigmoid"]
        )

    if not (
        LAUNCH["overlap_from_tiles"]
        and overlaps(
            q.device, state_programs(v.shape[-1], v.shape[1], tiles.num_seqs, TILE_LAUNCH["value_block"])
        )
    ):
        Aqk, Akk = build()
        o, ht = tile_recurrence(pre, v, h0, tiles, output_final_state=output_final_state, e_out=e)
        return o, ht, (Aqk, Akk, back.q_rstd, back.k_rstd, *extra)
    # the recurrence, a chain of dependent steps, on a high-priority stream: its programs are placed first
    # and the building's fill the multiprocessors around them (as the pipeline's state passes). The building
    # waits for an event the side stream records just before the recurrence, so the recurrence is queued
    # first: were the building queued right behind the prepare, its programs could fill the multiprocessors
    # before the recurrence's reached them. o and ht are allocated on the current stream, which waits for
    # the side one before anything else runs on it, so no tensor needs record_stream.
    N, H, K, V = tiles.num_seqs, v.shape[1], q.shape[-1], v.shape[-1]
    o = v.new_empty(v.shape)
    ht = v.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    with torch.cuda.device(q.device):
        main = torch.cuda.current_stream()
        side = side_stream(q.device, high_priority=True)
        side.wait_stream(main)  # the recurrence reads the prepare's tensors
        queued = torch.cuda.Event()
        queued.record(side)
        with torch.cuda.stream(side):
            tile_recurrence(
                pre, v, h0, tiles, output_final_state=output_final_state, o_out=o, ht_out=ht, e_out=e
            )
        main.wait_event(queued)
        Aqk, Akk = build()
        main.wait_stream(side)
    return o, ht, (Aqk, Akk, back.q_rstd, back.k_rstd, *extra)


def backward_passes(
    q, k, v, g, beta, A_log, dt_bias, h0, saved: Prepared, do, dht, index: ChunkIndex, opts: dict,
    residuals: torch.Tensor | None = None,
) -> tuple[Prepared, torch.Tensor, ...]:  # fmt: skip
    """The backward's prepare (second pass only, from ``saved``'s ``Aqk``, ``T`` and norms) and its two state
    passes (:func:`backward_state_passes`). A long single sequence
    (:func:`~openk3.ops.kda.triton.pipeline.segments`) is prepared segment by segment from its end on a side
    stream, the reverse pass following segment by segment on the current stream, and the forward-direction
    pass runs on the side stream once all is prepared, beside the rest of the reverse pass (same bits). With
    ``residuals`` (``E`` ``[tokens, H, V]`` in the storage dtype, kept by the forward) the prepare skips ``U``
    and the forward-direction pass reads ``E`` (:func:`backward_state_passes`).

    Returns:
        ``(pre, h, v_new, dh, dv_new, dh0)`` (``v_new`` is ``residuals`` when given).
    """
    store_u = residuals is None
    segs = segments(index, CHUNK, do.device, state_programs(do.shape[-1], q.shape[1], index.num_seqs))
    if segs is None:
        pre = chunk_prepare(q, k, v, g, beta, A_log, dt_bias, index, saved=saved, store_u=store_u, **opts)
        return (pre, *backward_state_passes(pre, h0, do, dht, index, residuals))
    pre = empty_prepared(q, v, index, use_l2norm=opts["use_l2norm"], saved=saved, store_u=store_u)
    TT, H, K = q.shape
    V = do.shape[-1]
    h, dh = (pre.w.new_empty(index.num_chunks, H, K, V) for _ in range(2))
    v_new = pre.w.new_empty(TT, H, V) if residuals is None else residuals
    dv_new = pre.w.new_empty(TT, H, V)
    grads = carried_states(dht, len(segs), True, (1, H, K, V), do.device)  # from the end: dht, ..., dh0
    last = len(segs) - 1

    def produce(j: int) -> None:
        s = segs[last - j]
        cut = (t[s.start : s.stop] for t in (q, k, v, g, beta))
        chunk_prepare(
            *cut, A_log, dt_bias, s.index, saved=segment_of(saved, s), out=segment_of(pre, s),
            store_u=store_u, **opts,
        )  # fmt: skip

    def forward_pass() -> None:
        chunk_state_fwd(
            pre, h0, index, V=V, out_dtype=do.dtype, output_final_state=False, store_h=True, store_o=False,
            h_out=(h, v_new), residuals=residuals,
        )  # fmt: skip

    def consume(j: int) -> None:
        s = segs[last - j]
        out = (dh[s.chunk_start : s.chunk_stop], dv_new[s.start : s.stop], grads[j + 1])
        chunk_state_bwd(segment_of(pre, s), do[s.start : s.stop], grads[j], s.index, out=out)

    pipelined(do.device, len(segs), produce, consume, side_tail=forward_pass)
    return pre, h, v_new, dh, dv_new, grads[-1]


class ChunkKDAFunction(torch.autograd.Function):
    """Inputs are flat ``[tokens, H, ·]`` and contiguous; see :func:`chunk_kda_triton`. ``index``: the
    chunks of 64 the backward works on; ``tiles``: the same sequences in tiles of 16 for the forward on tiles
    (:func:`tile_forward_passes`), or None for the 64-token forward (:func:`forward_passes`)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, index, tiles, scale, lower_bound, use_l2norm,
                output_final_state, beta_sigmoid):  # fmt: skip
        opts = dict(scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm, beta_sigmoid=beta_sigmoid)
        keep = LAUNCH["keep_intermediates"]
        if tiles is not None:
            o, ht, kept = tile_forward_passes(
                q, k, v, g, beta, A_log, dt_bias, h0, index, tiles, output_final_state=output_final_state,
                opts=opts, keep_residuals=LAUNCH["keep_residuals"],
            )  # fmt: skip
        else:
            pre, o, ht, h, v_new = forward_passes(
                q, k, v, g, beta, A_log, dt_bias, h0, index,
                keep=keep, output_final_state=output_final_state, opts=opts,
            )  # fmt: skip
            # U is not kept: the backward reads E instead (chunk_grad_wy's dL = −dXv Eᵀ)
            kept = (*pre._replace(u=None), h, v_new) if keep else (pre.Aqk, pre.Akk, pre.q_rstd, pre.k_rstd)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, *kept)
        ctx.index, ctx.opts, ctx.keep = index, opts, keep
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *kept = ctx.saved_tensors
        index, opts = ctx.index, ctx.opts
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        if ctx.keep:
            pre, h, v_new = Prepared(*kept[:-2]), kept[-2], kept[-1]
            dh, dv_new, dh0 = chunk_state_bwd(pre, do, dht, index)
        else:
            Aqk, Akk, q_rstd, k_rstd = kept[:4]
            residuals = kept[4] if len(kept) > 4 else None  # E, when the forward kept it (keep_residuals)
            saved = Prepared(None, None, None, None, Aqk, Akk, None, q_rstd, k_rstd)
            pre, h, v_new, dh, dv_new, dh0 = backward_passes(
                q, k, v, g, beta, A_log, dt_bias, h0, saved, do, dht, index, opts, residuals
            )
        wy = chunk_grad_wy(q, k, v, g, beta, A_log, dt_bias, pre, h, dh, v_new, dv_new, do, index, **opts)
        dq, dk, dg, dbeta, dA_log, ddt = chunk_grad_intra(
            q, k, g, beta, A_log, dt_bias, pre, wy, index, **opts
        )
        return (
            dq, dk, wy.dv, dg, dbeta, dA_log.to(A_log.dtype),
            None if dt_bias is None else ddt.to(dt_bias.dtype),
            None if h0 is None else dh0,
            None, None, None, None, None, None, None,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~openk3.ops.kda.chunk.chunk_kda` with the K3 gate in the kernel (arguments checked there).

    Args:
        q, k, g: ``[B, T, H, K]`` (g raw). v: ``[B, T, H, V]``. beta: ``[B, T, H]`` post-sigmoid, or logits
            with ``use_beta_sigmoid_in_kernel`` (the kernels apply ``σ`` in fp32; its gradient is w.r.t.
            the logits).
        scale: multiplies q. initial_state: fp32 ``[N, H, K, V]`` or None.
        seq_lens, cu_seqlens: the documents of a packed row (``B = 1``), or None for ``B`` rows.
        A_log: ``[H' ≥ H]`` (first H used); dt_bias ``[H*K]`` or None; lower_bound in ``[−5, 0)``.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state fp32 [N, H, K, V] or None)``; differentiable. A call that
        needs no gradient (grad mode off, or no input requiring grad) runs
        :func:`~openk3.ops.kda.triton.tile_forward.tile_forward` alone when its ``LAUNCH["enabled"]``
        (:func:`~openk3.ops.kda.triton.tile_pairs.pair_forward` instead when
        :func:`~openk3.ops.kda.triton.tile_pairs.use_pairs`: one program per multiprocessor or fewer); one
        that needs a gradient runs :class:`ChunkKDAFunction`, whose forward is on 16-token tiles too by
        default (:data:`LAUNCH` ``["forward_on_tiles"]``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    # every LAUNCH setting the call's path reads, once, before any work (the backward's in the forward): the
    # tile forward's with chunk_prepare's and chunk_state's first, as its "enabled" picks the path
    check_tile_launch()
    forward_only = TILE_LAUNCH["enabled"] and not needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if not forward_only:
        for check in (check_launch, check_from_tiles_launch, check_grad_wy_launch, check_grad_intra_launch):
            check()

    def chunk_index(size: int) -> ChunkIndex:
        if seq_lens is None:
            return fixed_length_index(B, T, q.device, size)
        return varlen_index(cu_seqlens, seq_lens, size)

    N = B if seq_lens is None else len(seq_lens)
    pairs = forward_only and use_pairs(state_programs(V, H, N, TILE_LAUNCH["value_block"]), q.device)
    index = chunk_index((PAIR if pairs else TILE) if forward_only else CHUNK)
    # with a gradient, the forward on tiles too (LAUNCH["forward_on_tiles"]): both tables
    train_tiles = None
    if not forward_only and LAUNCH["forward_on_tiles"] and not LAUNCH["keep_intermediates"]:
        train_tiles = chunk_index(TILE)
    flat = [t.reshape(B * T, H, -1).contiguous() for t in (q, k, v, g)]
    args = (
        *flat, beta.reshape(B * T, H).contiguous(), A_log[:H].contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
        None if initial_state is None else initial_state.contiguous(),
        index,
    )  # fmt: skip
    if forward_only:
        o, ht = (pair_forward if pairs else tile_forward)(
            *args, scale=scale, lower_bound=lower_bound, use_l2norm=use_qk_l2norm_in_kernel,
            output_final_state=output_final_state, beta_sigmoid=use_beta_sigmoid_in_kernel,
        )  # fmt: skip
    else:
        o, ht = ChunkKDAFunction.apply(
            *args, train_tiles, scale, lower_bound, use_qk_l2norm_in_kernel, output_final_state,
            use_beta_sigmoid_in_kernel,
        )  # fmt: skip
    return o.view(B, T, H, V), ht
