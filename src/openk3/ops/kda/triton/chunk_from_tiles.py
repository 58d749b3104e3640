"""What the backward saves (``Aqk`` and ``T`` of the 64-token chunks), built from the 16-token tile forward's
prepare, so that a forward with autograd runs the tile forward (docs/references.md#flashkda) instead of the 64-token one (docs/references.md#kda-chunked-form).

The tile prepare (:mod:`~openk3.ops.kda.triton.tile_forward`) writes, per tile of 16 tokens with Γ the log2
gate's cumsum from the tile's start (``Γ_C`` its last row), ``Q̃ = scale·q̂ ⊙ 2^{Γ}``, ``K̃ = k̂ ⊙ 2^{Γ}``,
``K̂ = k̂ ⊙ 2^{Γ_C − Γ}``, the tile's decay ``D = 2^{Γ_C}``, its intra-tile ``M`` (``Aqk``'s diagonal block)
and, with ``for_backward``, its ``(I + L)^{-1}`` (``T``'s diagonal block's inverse). For row ``i`` in tile
``s`` and column ``j`` in an earlier tile ``u`` of the same chunk, the chunk's factor splits at the tiles'
edges (``q̂``, ``k̂`` L2-normalised):

    2^{G_i − G_j} = 2^{Γ_i} · Π_{u<w<s} D_w · 2^{Γ_C(u) − Γ_j}      (G: the cumsum from the chunk's start)

so ``Aqk_su = Q̃_s Diag(c_su) K̂_uᵀ`` and ``L_su = Diag(β_s) K̃_s Diag(c_su) K̂_uᵀ`` with
``c_su = Π_{u<w<s} D_w ≤ 1`` per channel: six ``16×16`` blocks each, as one ``[16, BK] × [BK, 64]``
tensor-core product per row block and key slice, with no exponential (every factor is a stored tile value or
a product of decays ≤ 1). ``T = (I + L)^{-1}`` then follows by block substitution from the tiles' inverses
(:func:`~openk3.ops.kda.triton.chunk_prepare.block_substitution`, as in the 64-token prepare).

The result differs from :func:`~openk3.ops.kda.triton.chunk_prepare.chunk_prepare`'s by the rounding of the
stored ``Q̃``, ``K̃``, ``K̂`` (the input dtype), and by default of the decayed columns ``K̂ ⊙ c`` too
(:data:`LAUNCH` ``["half_operands"]``), where the 64-token prepare multiplies fp32 values; the backward
only needs it to be the chunks' ``Aqk`` and ``T`` to within the tolerances its gradients are tested to.

Legend: ``BT`` chunk rows, ``BC`` tile rows, ``BK`` key slice, ``K`` key dim, ``H`` heads, ``P`` chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton import kernel_math
from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import block_substitution, fp16_inverse
from openk3.ops.kda.triton.kernel_math import (
    cat4_cols,
    cat4_rows,
    check_launch_entries,
    check_out,
    chunk_grid,
    chunk_of,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    launch_options,
    load_beta,
    load_rows,
    split4_rows,
    store_rows,
)
from openk3.ops.kda.triton.tile_forward import TILE, TileBackward, TilePrepared

LAUNCH = {"num_warps": 2, "num_stages": 1, "key_block": 32, "half_operands": True}
"""Launch configuration: warps, stages and the key slice ``BK`` of the products. On the H200
(docs/LOG.md, run 2) 2 warps with 32-channel slices took 0.51–0.55 ms at
B1 T8192 H96 D128 and 0.66–0.70 at B1 T32768 H32, against 0.61–0.64 / 0.83–0.88 with 4 warps and 64-channel
slices, 0.75–0.80 / 1.04–1.11 with 4 warps and 32, and more with 8 warps (0.86–1.36 / 1.33–1.78).

``half_operands`` (bf16/fp16 gated keys, i.e. 16-bit inputs without the tile forward's ``fp32_gated_keys``):
the products take the stored 16-bit ``Q̃``, ``K̃`` as they are and the column tiles ``K̂ ⊙ c`` rounded to that
dtype once (``K̂`` alone is exact in it), instead of tf32 operands, each passed through
:func:`~openk3.ops.kda.triton.kernel_math.round_tf32_finite`. On the H200 (``benchmarks/results/
kda_h200_2026-11-30d_runs.txt``, run 5; the kernel alone, the two settings alternating in one process) it took
0.593–0.594 ms against 0.654–0.657 at B1 T32768 H32 D128 and 0.464–0.479 against 0.502–0.503 at B1 T8192 H96;
``Aqk`` and ``T`` moved by 9.8e-4 and 9.3e-5 relative RMSE (B1 T32768 H32). In the interpreter, against the
64-token prepare's (packed documents, D64 bf16): 2.8e-3 / 6.3e-4 against 2.7e-3 / 5.7e-4 with tf32. ``dA_log``
at B1 T300 H2 D64 bf16 moves both ways: over its 0.02 at none of seeds 100–119 against 2 with tf32, higher at
4 of the 6 seeds over it in ``kda_h200_2026-11-30c_runs.txt``; under slowly decaying gates (B1 T130 H2, K 32
and 64, 24 seeds) over at 6 against 7 with tf32, partly at other seeds (Triton README, Precision). The GPU
tests passed with it on (its 2 flipped-option tests and 50 tests of the default paths, the d file's run 5),
and all 88 with it on by default (``kda_h200_2026-11-30e_runs.txt``, run 5). On by default: forward+backward
was faster with it in each of 12 alternating pairs at the four benchmark shapes, by 0.005–0.15 ms (0.05–1.1%;
that file's run 4)."""


def check_launch() -> None:
    """Raise ``ValueError`` unless :data:`LAUNCH` has its keys, each of its kind
    (:func:`~openk3.ops.kda.triton.kernel_math.check_launch_entries`)."""
    check_launch_entries(
        "chunk_from_tiles",
        LAUNCH,
        dict(num_warps="warps", num_stages="stages", key_block="block", half_operands="bool"),
    )


@triton.jit
def chunk_from_tiles_kernel(
    qg, kt, kh, M, Td, gend, beta, Aqk, Akk,
    cu_seqlens, chunk_table, tile_offsets,
    H: tl.constexpr, HEADS_FIRST: tl.constexpr,
    DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    FP16: tl.constexpr, BETA_SIGMOID: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H)``. Reads the tile prepare's ``qg``, ``kt``, ``kh`` ``[tokens, H, K]``,
    ``M``, ``Td`` ``[tokens, H, BC]``, ``gend`` ``[P16, H, K]``; writes ``Aqk`` and ``Akk`` = T
    ``[tokens, H, BT]``. With ``HALF`` the products take 16-bit operands in ``qg``'s dtype
    (``LAUNCH["half_operands"]``)."""
    dt = qg.dtype.element_ty
    i_c, i_h = chunk_program(H, HEADS_FIRST)
    t0, n_valid = chunk_rows(cu_seqlens, chunk_table, i_c, BT)
    i_n, i_j = chunk_of(chunk_table, i_c)
    tile0 = tl.load(tile_offsets + i_n).to(tl.int64) + i_j * (BT // BC)  # the chunk's first tile
    blk = (tl.arange(0, BT) // BC)[:, None]
    acc_A1 = tl.zeros([BC, BT], dtype=tl.float32)
    acc_A2 = tl.zeros([BC, BT], dtype=tl.float32)
    acc_A3 = tl.zeros([BC, BT], dtype=tl.float32)
    acc_L1 = tl.zeros([BC, BT], dtype=tl.float32)
    acc_L2 = tl.zeros([BC, BT], dtype=tl.float32)
    acc_L3 = tl.zeros([BC, BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        k0 = i_k * BK
        o_k = k0 + tl.arange(0, BK)
        # the decays of tiles 1 and 2, the only ones strictly between two tiles of the chunk
        o_b = tl.full([BK], BC, tl.int32)  # tiles 1 and 2 exist where BC, 2·BC < n_valid
        D1 = tl.load(gend + ((tile0 + 1) * H + i_h) * K + o_k, mask=o_b < n_valid, other=1.0)[None, :]
        D2 = tl.load(gend + ((tile0 + 2) * H + i_h) * K + o_k, mask=2 * o_b < n_valid, other=1.0)[None, :]
        b_kh = load_rows(kh, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32)
        _, q1, q2, q3 = split4_rows(load_rows(qg, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32), BT, BK)
        _, k1, k2, k3 = split4_rows(load_rows(kt, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32), BT, BK)
        # columns of row block s: K̂ of the tiles u < s times c_su (0 from tile s on)
        c1 = tl.trans(tl.where(blk == 0, b_kh, 0.0))
        c2 = tl.trans(tl.where(blk == 0, b_kh * D1, tl.where(blk == 1, b_kh, 0.0)))
        c3 = tl.where(blk == 1, b_kh * D2, tl.where(blk == 2, b_kh, 0.0))
        c3 = tl.trans(tl.where(blk == 0, b_kh * (D1 * D2), c3))
        if HALF:  # the stored 16-bit values back (exact), the decayed columns rounded once; dot passes them
            q1, q2, q3, k1, k2, k3 = q1.to(dt), q2.to(dt), q3.to(dt), k1.to(dt), k2.to(dt), k3.to(dt)
            c1, c2, c3 = c1.to(dt), c2.to(dt), c3.to(dt)
        # fp32 operands are rounded to tf32; a NaN in q, k, g or β also reaches o through Q̃, K̃, K̂
        # (kernel_math.round_tf32_finite)
        acc_A1 = dot(q1, c1, DOT, acc_A1, FINITE=True)
        acc_L1 = dot(k1, c1, DOT, acc_L1, FINITE=True)
        acc_A2 = dot(q2, c2, DOT, acc_A2, FINITE=True)
        acc_L2 = dot(k2, c2, DOT, acc_L2, FINITE=True)
        acc_A3 = dot(q3, c3, DOT, acc_A3, FINITE=True)
        acc_L3 = dot(k3, c3, DOT, acc_L3, FINITE=True)
    zero = tl.zeros([BC, BT], dtype=tl.float32)
    b_M = load_rows(M, t0, n_valid, i_h, 0, H, BC, BT, BC).to(tl.float32)  # [BT, BC]: each tile's own block
    b_diag = cat4_cols(
        tl.where(blk == 0, b_M, 0.0), tl.where(blk == 1, b_M, 0.0), tl.where(blk == 2, b_M, 0.0),
        tl.where(blk == 3, b_M, 0.0), BT, BC,
    )  # fmt: skip
    b_A = cat4_rows(zero, acc_A1, acc_A2, acc_A3, BC, BT) + b_diag
    store_rows(Aqk, b_A, t0, n_valid, i_h, 0, H, BT, BT, BT)
    b_beta = load_beta(beta, t0, n_valid, i_h, H, BT, BETA_SIGMOID)
    b_L = cat4_rows(zero, acc_L1, acc_L2, acc_L3, BC, BT) * b_beta[:, None]
    b_Td = load_rows(Td, t0, n_valid, i_h, 0, H, BC, BT, BC).to(tl.float32)  # fp16 T: tf32-exact
    Dinv0, Dinv1, Dinv2, Dinv3 = split4_rows(b_Td, BT, BC)
    b_T = block_substitution(b_L, Dinv0, Dinv1, Dinv2, Dinv3, BT, BC, DOT, FP16)
    store_rows(Akk, b_T, t0, n_valid, i_h, 0, H, BT, BT, BT)


def chunk_from_tiles(
    pre: TilePrepared,
    back: TileBackward,
    beta: torch.Tensor,
    index: ChunkIndex,
    tiles: ChunkIndex,
    *,
    use_l2norm: bool,
    beta_sigmoid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`chunk_from_tiles_kernel`.

    Args:
        pre, back: :func:`~openk3.ops.kda.triton.tile_forward.tile_prepare`'s result and its ``for_backward``
            tensors, over the tiles ``tiles`` (``chunk_index`` with ``size=TILE``) of the same sequences as
            ``index`` (chunks of 64).
        beta: ``[tokens, H]`` as the prepare got it (logits with ``beta_sigmoid``).
        use_l2norm: as the prepare got it (with the input dtype, it decides ``T``'s dtype).

    Returns:
        ``(Aqk, Akk)`` ``[tokens, H, 64]``: ``Aqk`` in the input dtype (``M``'s), ``Akk`` = T in fp16 under
        :func:`~openk3.ops.kda.triton.chunk_prepare.fp16_inverse`'s condition, else fp32, as
        :func:`~openk3.ops.kda.triton.chunk_prepare.chunk_prepare` writes them.

    Raises:
        ValueError: ``back.Td`` not of the dtype that condition gives (a ``TileBackward`` from another call).
    """
    TT, H, K = pre.qg.shape
    dt = pre.M.dtype
    fp16 = fp16_inverse(dt, use_l2norm)
    check_out("chunk_from_tiles back.Td", back.Td, (TT, H, TILE), torch.float16 if fp16 else torch.float32,
              pre.qg.device)  # fmt: skip
    half = LAUNCH["half_operands"] and pre.qg.dtype in (torch.bfloat16, torch.float16)
    Aqk = pre.M.new_empty(TT, H, CHUNK)
    Akk = pre.M.new_empty(TT, H, CHUNK, dtype=back.Td.dtype)
    if index.num_chunks == 0:
        return Aqk, Akk
    heads_first = kernel_math.LAUNCH["heads_first"]
    chunk_from_tiles_kernel[chunk_grid(index.num_chunks, H, heads_first=heads_first)](
        pre.qg, pre.kt, pre.kh, pre.M, back.Td, pre.gend, beta, Aqk, Akk,
        index.cu_seqlens, index.chunk_table, tiles.chunk_offsets,
        H=H, HEADS_FIRST=heads_first, DOT=dot_precision(dt), K=K, BT=CHUNK, BC=TILE,
        BK=min(K, LAUNCH["key_block"]), FP16=fp16,
        BETA_SIGMOID=beta_sigmoid, HALF=half, **launch_options(LAUNCH),
    )  # fmt: skip
    return Aqk, Akk
