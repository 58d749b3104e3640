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
(:func:`block_substitution`).

With 16-bit gated keys the products take the stored 16-bit ``Q̃``, ``K̃`` as they are and the decayed columns
``K̂ ⊙ c`` rounded to that dtype once (``K̂`` alone is exact in it); with fp32 ones (fp32 inputs, or
``KDAOptions.fp32_gated_keys``), tf32 operands rounded to nearest. The backward only needs the chunks' ``Aqk``
and ``T`` to within the tolerances its gradients are tested to.

Legend: ``BT`` chunk rows, ``BC`` tile rows, ``BK`` key slice, ``K`` key dim, ``H`` heads, ``P`` chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_index import CHUNK, ChunkIndex
from openk3.ops.kda.triton.chunk_prepare import fp16_inverse
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, KernelLaunch
from openk3.ops.kda.triton.kernel_math import (
    bounded_dot,
    cat4_cols,
    cat4_rows,
    check_out,
    chunk_grid,
    chunk_of,
    chunk_program,
    chunk_rows,
    dot,
    dot_precision,
    load_beta,
    load_rows,
    split4_cols,
    split4_rows,
    store_rows,
)
from openk3.ops.kda.triton.tile_forward import TILE, TileBackward, TilePrepared


@triton.jit
def block_substitution(L, D0, D1, D2, D3, BT: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr,
                       FP16: tl.constexpr):  # fmt: skip
    """``T = (I + L)^{-1}`` of a strictly lower-triangular ``[BT, BT]`` fp32 tile (``BT = 4·BC``) by block
    forward substitution over its ``BC``-row blocks, given the diagonal blocks' inverses
    ``D_s = (I + L_ss)^{-1}`` (``[BC, BC]`` fp32; ``L``'s diagonal blocks are not read).

    Row block ``s`` of ``T`` is ``T_s = D_s (E_s − Σ_{u<s} L_su T_u)`` (``E_s`` the identity's rows), i.e.
    ``D_s`` on the diagonal block plus ``−D_s Σ_{u<s} L_su T_u``: nine ``16×16×64`` tensor-core products
    (fp16 operands when ``FP16``; every factor is bounded by 1 and every sum has at most 48 terms).
    Row ``i`` of every factor reads only rows ``≤ i`` of ``L``, and of the ``D_s`` (causal).
    """
    tl.static_assert(BT == 4 * BC, "four anchor blocks per chunk")
    _, L1, L2, L3 = split4_rows(L, BT, BT)
    L10, _, _, _ = split4_cols(L1, BC, BT)
    L20, L21, _, _ = split4_cols(L2, BC, BT)
    L30, L31, L32, _ = split4_cols(L3, BC, BT)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    T0 = cat4_cols(D0, zero, zero, zero, BC, BC)
    R1 = bounded_dot(L10, T0, DOT, FP16)
    T1 = cat4_cols(zero, D1, zero, zero, BC, BC) - bounded_dot(D1, R1, DOT, FP16)
    R2 = bounded_dot(L21, T1, DOT, FP16) + bounded_dot(L20, T0, DOT, FP16)
    T2 = cat4_cols(zero, zero, D2, zero, BC, BC) - bounded_dot(D2, R2, DOT, FP16)
    R3 = bounded_dot(L30, T0, DOT, FP16) + bounded_dot(L31, T1, DOT, FP16)
    R3 += bounded_dot(L32, T2, DOT, FP16)
    T3 = cat4_cols(zero, zero, zero, D3, BC, BC) - bounded_dot(D3, R3, DOT, FP16)
    return cat4_rows(T0, T1, T2, T3, BC, BT)


@triton.jit
def chunk_from_tiles_kernel(
    qg, kt, kh, M, Td, gend, beta, Aqk, Akk,
    cu_seqlens, chunk_table, tile_offsets,
    H: tl.constexpr, DOT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    FP16: tl.constexpr, BETA_SIGMOID: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Grid ``chunk_grid(P, H)``. Reads the tile prepare's ``qg``, ``kt``, ``kh`` ``[tokens, H, K]``,
    ``M``, ``Td`` ``[tokens, H, BC]``, ``gend`` ``[P16, H, K]``; writes ``Aqk`` and ``Akk`` = T
    ``[tokens, H, BT]``. With ``HALF`` (16-bit gated keys) the products take 16-bit operands in ``qg``'s
    dtype."""
    dt = qg.dtype.element_ty
    i_c, i_h = chunk_program(H)
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
    launch: KernelLaunch = DEFAULT_GEOMETRY.chunk_from_tiles,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`chunk_from_tiles_kernel`.

    Args:
        pre, back: :func:`~openk3.ops.kda.triton.tile_forward.tile_prepare`'s result and its ``for_backward``
            tensors, over the tiles ``tiles`` (``chunk_index`` with ``size=TILE``) of the same sequences as
            ``index`` (chunks of 64).
        beta: ``[tokens, H]`` as the prepare got it (logits with ``beta_sigmoid``).
        use_l2norm: as the prepare got it (with the input dtype, it decides ``T``'s dtype).
        launch: warps, stages and the key slice.

    Returns:
        ``(Aqk, Akk)`` ``[tokens, H, 64]``: ``Aqk`` in the input dtype (``M``'s), ``Akk`` = T in fp16 under
        :func:`~openk3.ops.kda.triton.chunk_prepare.fp16_inverse`'s condition, else fp32, as
        the backward reads them (:class:`~openk3.ops.kda.triton.chunk_prepare.Saved`).

    Raises:
        ValueError: ``back.Td`` not of the dtype that condition gives (a ``TileBackward`` from another call).
    """
    TT, H, K = pre.qg.shape
    dt = pre.M.dtype
    fp16 = fp16_inverse(dt, use_l2norm)
    check_out("chunk_from_tiles back.Td", back.Td, (TT, H, TILE), torch.float16 if fp16 else torch.float32,
              pre.qg.device)  # fmt: skip
    half = pre.qg.dtype in (torch.bfloat16, torch.float16)
    Aqk = pre.M.new_empty(TT, H, CHUNK)
    Akk = pre.M.new_empty(TT, H, CHUNK, dtype=back.Td.dtype)
    if index.num_chunks == 0:
        return Aqk, Akk
    chunk_from_tiles_kernel[chunk_grid(index.num_chunks, H)](
        pre.qg, pre.kt, pre.kh, pre.M, back.Td, pre.gend, beta, Aqk, Akk,
        index.cu_seqlens, index.chunk_table, tiles.chunk_offsets,
        H=H, DOT=dot_precision(dt), K=K, BT=CHUNK, BC=TILE, BK=min(K, launch.key_block), FP16=fp16,
        BETA_SIGMOID=beta_sigmoid, HALF=half, **launch.options(),
    )  # fmt: skip
    return Aqk, Akk
