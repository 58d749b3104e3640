"""Triton device functions shared by the KDA kernels: the in-kernel gate and its cumsum over a key slice,
the chunk rows of a program, the dot precision, and tile loads/stores by token rows; on the host, the grid of
the token-parallel kernels and the checks of tensors a launcher is given to write.

Units: the chunk kernels keep log-decays in **log2** units (natural-log gate × log2(e)) so every decay is
one ``exp2`` (docs/references.md#kda-chunked-form, "log-base convention"); gradients stay w.r.t. the natural-log gate,
because ``d/dΓ e^{Γ} = 2^{Γ·log2 e}``.

The chunk kernels work on a 64-row chunk as four 16-row anchor blocks; ``split4_rows``/``cat4_rows`` (and the
column versions) cut a register tile into its blocks and glue them back (reshape, permute and
``tl.split``/``tl.join``: data movement only, values bitwise unchanged).

Legend: ``R`` rows of a tile (tokens), ``K`` key dim, ``C`` columns of a tile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from openk3.ops.kda.triton.chunk_index import ChunkIndex

LOG2E = 1.4426950408889634
"""log2(e): natural-log decay × LOG2E = log2 decay."""


def dot_precision(dtype) -> str:
    """``tl.dot`` input precision of the chunk kernels for inputs of ``dtype``: ``"tf32"`` for half-precision
    inputs (their fp32 intermediates carry bf16/fp16 information, fla's choice, docs/references.md#kda-chunked-form) and ``"tf32x3"`` (three
    tensor-core passes, ~fp32 accuracy) for fp32 inputs, whose users expect fp32 results."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def chunk_grid(num_chunks: int, H: int, *rest: int) -> tuple[int, ...]:
    """Launch grid of a token-parallel kernel over ``num_chunks`` chunks (or tiles) and ``H`` heads, with
    further grid axes ``rest`` (as axes 2, …): ``(num_chunks·H, 1, *rest)``, the head fastest, so that the
    programs resident at one time read and write whole ``[rows, H, K]`` blocks of the token-major tensors
    instead of one head's rows ``H·K`` apart. The kernel reads it back with :func:`chunk_program`."""
    return (num_chunks * H, 1, *rest) if rest else (num_chunks * H,)


def check_out(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    """Raise ``ValueError`` unless ``t``, a tensor a launcher was given to write (an ``out=`` argument), is
    contiguous with exactly ``shape`` and ``dtype`` on ``device``: the kernels index it as a dense row-major
    array, so anything else would be written wrong or out of bounds."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != torch.device(device):
        want, got = f"{dtype} of shape {list(shape)} on {device}", f"{t.dtype} {list(t.shape)} on {t.device}"
        raise ValueError(f"{name} must be {want}; got {got}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")


def check_index(name: str, tokens: int, chunks: int, index: ChunkIndex) -> None:
    """Raise ``ValueError`` unless ``index`` covers ``tokens`` tokens in ``chunks`` chunks, as the prepared
    tensors a pass reads do (their rows, and the rows of their per-chunk decays ``gend``): a 16-token tile
    index given for 64-token chunks, or the reverse, would otherwise leave outputs unwritten or read past the
    decays."""
    if index.num_tokens != tokens or index.num_chunks != chunks:
        raise ValueError(
            f"{name}: the index has {index.num_tokens} tokens in {index.num_chunks} chunks, the prepared "
            f"tensors {tokens} tokens and {chunks} chunks (an index of another chunk size?)"
        )


def empty_outs(like: torch.Tensor, layout: tuple) -> tuple:
    """Uninitialised tensors on ``like``'s device for each ``(shape, dtype)`` field of the NamedTuple
    ``layout``, as the same NamedTuple type (the layout a launcher allocates; :func:`check_outs` checks given
    ones against it)."""
    return type(layout)(*(like.new_empty(shape, dtype=dtype) for shape, dtype in layout))


def check_outs(name: str, given: tuple, layout: tuple, device, optional: tuple[str, ...] = ()) -> None:
    """:func:`check_out` for each field of the NamedTuple ``given`` against the ``(shape, dtype)`` pair in the
    same field of ``layout`` (the layout its launcher allocates), on ``device``; the fields named in
    ``optional`` may be None."""
    for field, t, (shape, dtype) in zip(given._fields, given, layout, strict=True):
        if t is None and field in optional:
            continue
        if t is None:
            raise ValueError(f"{name}.{field} must be a tensor")
        check_out(f"{name}.{field}", t, shape, dtype, device)


@triton.jit
def round_tf32(x):
    """``x`` (fp32) rounded to tf32's 10-bit stored significand, to nearest (ties away from zero), as fp32;
    ±inf stay, NaN stays NaN (the bit trick alone would carry some NaN payloads, such as the GPU's canonical
    ``0x7FFFFFFF``, into ±0 or inf), values within half a tf32 ulp of the fp32 maximum round to inf.

    Hopper's tensor cores read a tf32 operand from an fp32 register by dropping its low 13 bits, i.e. they
    **truncate** toward zero. Truncation is biased, so errors of many products add up instead of cancelling
    (``dA_log``, one sum over a head's tokens and channels, is where it shows)."""
    return tl.where(x == x, round_tf32_finite(x), x)


@triton.jit
def round_tf32_finite(x):
    """:func:`round_tf32` without its NaN select: finite values and ±inf round alike, but a NaN whose
    significand carries (the GPU's canonical ``0x7FFFFFFF``) becomes ±0 or inf. Only for operands whose NaN
    reaches every output by another path as well: the prepares' products of gated ``q``/``k`` (a NaN in
    ``q``, ``k``, ``g`` or ``β`` also lands in the stored ``Q̃``, ``K̃``, ``K̂``, ``W``, which the state pass
    multiplies). The select keeps ``x`` and its rounding live together in registers, which costs spills
    (docs/LOG.md)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def tf32_operand(x, DOT: tl.constexpr, FINITE: tl.constexpr = False):
    """``x`` as :func:`dot` hands it to the tensor cores: rounded to tf32 when ``DOT`` is ``"tf32"`` and ``x``
    is fp32, else unchanged. Lets a loop round a loop-invariant operand once and pass it to ``tl.dot``.
    ``FINITE``: by :func:`round_tf32_finite` (read its condition first)."""
    if DOT == "tf32" and x.dtype == tl.float32:
        if FINITE:
            return round_tf32_finite(x)
        else:
            return round_tf32(x)
    else:
        return x


@triton.jit
def dot(a, b, DOT: tl.constexpr, acc=None, FINITE: tl.constexpr = False):
    """``a @ b (+ acc)`` at input precision ``DOT`` (:func:`dot_precision`); for ``"tf32"`` fp32 operands are
    first rounded to nearest (:func:`round_tf32`, or :func:`round_tf32_finite` when ``FINITE``) instead of
    truncated by the tensor cores. 16-bit operands are exact in the products and go as they are."""
    return tl.dot(tf32_operand(a, DOT, FINITE), tf32_operand(b, DOT, FINITE), acc, input_precision=DOT)


@triton.jit
def split_bf16(x):
    """``x`` (fp32) as two bf16 pieces ``hi + lo``: ``hi`` its bf16 rounding and ``lo`` that of the rest, so
    ``hi + lo`` carries ``x`` to ``2^-17`` relative (about 16 significant bits); ``a @ hi + a @ lo`` is a
    product with ``x`` at two bf16 tensor-core passes (fla's ``bf16x3`` keeps a third, kda_kernels reference
    docs/references.md#kda-chunked-backward)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def bounded_dot(a, b, DOT: tl.constexpr, FP16: tl.constexpr):
    """``a @ b`` accumulated in fp32, for operands known to lie well inside fp16's range (``|x| ≪ 65504``):
    fp16 operands when ``FP16``, else fp32 operands at precision ``DOT``.

    fp16 keeps tf32's 11-bit significand for ``|x| ≥ 2^-14``; smaller values lose relative precision in fp16's
    subnormals and values below ``2^-25`` flush, an absolute error of at most ``3·10^-8``. So for operands
    bounded by about 1 the products carry what ``"tf32"`` ones do, at twice the tensor-core rate and half the
    operand registers and shared memory."""
    if FP16:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return dot(a, b, DOT)


INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)
"""Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module is imported, as
``triton.jit`` itself decides): there :func:`sigmoid` takes ``tl.sigmoid``, since the interpreter runs no
inline PTX."""


@triton.jit
def sigmoid(z):
    """``σ(z) = 1 / (1 + 2^{−z·log2 e})`` of fp32 ``z`` with the GPU's approximate ``exp2`` and reciprocal
    (``ex2.approx.ftz.f32``, ``rcp.approx.ftz.f32``). ``tl.sigmoid`` takes the same ``ex2.approx`` and the
    approximate ``div.full`` (both within 2 ulp), with range fix-ups that only matter for subnormals and cost
    instructions in the prepares' loops. Subnormal intermediates flush to 0, so ``σ(z)``
    is 0 below ``z ≈ −87`` (``tl.sigmoid``: a subnormal). In the interpreter (:data:`INTERPRETED`),
    ``tl.sigmoid``. The chunk kernels' gate (:func:`k3_gate_log2`) and its backward in grad_intra use it; the
    decode kernel keeps ``tl.sigmoid`` (one row per token, and the two agree within those ulps)."""
    if INTERPRETED:
        return tl.sigmoid(z)
    else:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;",
            "=r,r",
            [z * -1.4426950408889634],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def k3_gate_log2(x, A_h, bias, lower_bound_log2):
    """K3 lower-bounded gate in log2 units: ``lb·log2(e)·σ(e^{A_log}·(x + dt_bias))`` (docs/references.md#kda-gates).

    ``x`` ``[R, K]`` raw gate (fp32), ``A_h`` scalar ``e^{A_log_h}``, ``bias`` ``[K]`` (zeros without
    ``dt_bias``), ``lower_bound_log2`` = ``lb·log2(e)``. Returns ``[R, K]`` fp32 in ``(lb·log2 e, 0)``.
    """
    z = A_h * (x + bias[None, :])
    return lower_bound_log2 * sigmoid(z)


@triton.jit
def chunk_of(chunk_table, i_c):
    """``(sequence, chunk within the sequence)`` (int64 scalars) of chunk ``i_c`` of a
    :class:`~openk3.ops.kda.triton.chunk_index.ChunkIndex` (``chunk_table`` ``[P, 2]``)."""
    return tl.load(chunk_table + 2 * i_c).to(tl.int64), tl.load(chunk_table + 2 * i_c + 1).to(tl.int64)


@triton.jit
def chunk_rows(cu_seqlens, chunk_table, i_c, BT: tl.constexpr):
    """First token (int64) and number of valid rows (int32, ≤ ``BT``) of chunk ``i_c`` of a
    :class:`~openk3.ops.kda.triton.chunk_index.ChunkIndex` (``chunk_table`` ``[P, 2]``, ``cu_seqlens``)."""
    i_n, i_t = chunk_of(chunk_table, i_c)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    return t0, tl.minimum(eos - t0, BT).to(tl.int32)


@triton.jit
def unit_lower_inverse_stacked(X, NB: tl.constexpr, BC: tl.constexpr):
    """``(I + X_b)^{-1}`` of ``NB`` strictly lower-triangular ``[BC, BC]`` fp32 blocks stacked as ``X``
    ``[NB, BC, BC]``, by fp32 forward substitution on the CUDA cores: row ``i`` is ``e_i − Σ_{j<i} X_ij T_j``
    (fla's ``solve_tril`` does the same for its 16×16 blocks, docs/references.md#kda-chunked-form). The ``BC − 1``
    dependent steps (each a cross-thread row extraction and reduction) are paid once for all the blocks. With
    ``|X_ij| ≤ 1`` and ``|T_ij| ≤ 1`` every row carries fp32 rounding only. Row ``i`` reads rows ``≤ i``."""
    o_c = tl.arange(0, BC)
    T = tl.zeros([NB, BC, BC], dtype=tl.float32) + (o_c[:, None] == o_c[None, :]).to(tl.float32)[None, :, :]
    for i in tl.static_range(1, BC):
        row_i = (o_c == i)[None, :, None]
        l_i = tl.sum(tl.where(row_i, X, 0.0), axis=1)  # [NB, BC]: row i of each block (zero from column i)
        t_i = tl.where(o_c == i, 1.0, 0.0)[None, :] - tl.sum(l_i[:, :, None] * T, axis=1)
        T = tl.where(row_i, t_i[:, None, :], T)
    return T


@triton.jit
def chunk_program(H: tl.constexpr):
    """``(chunk, head)`` of this program in a :func:`chunk_grid` launch."""
    pid = tl.program_id(0)
    return pid // H, pid % H


@triton.jit
def state_program(cu_seqlens, chunk_offsets, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BV: tl.constexpr):  # fmt: skip
    """Where a state-pass program works (grid ``(V/BV, N·H)``: value block, then sequence × head): its head,
    its sequence's first and end token (int64), the index of its first chunk, its first value column, the key
    and value indices of its ``[K, BV]`` state slice and their offsets in an ``[N, H, K, V]`` state tensor."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_state = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    return i_h, bos, eos, c0, i_v * BV, o_k, o_v, p_state


@triton.jit
def load_rows(
    ptr, t_start, n_rows, i_h, col0, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    """Load ``[R, C]`` from a ``[tokens, H, W]`` tensor: rows ``t_start + r`` (``r < n_rows``), columns
    ``col0 + c`` of head ``i_h``; rows past ``n_rows`` read as 0. The row offset is one 64-bit scalar; the
    per-element offsets stay 32-bit."""
    o_r = tl.arange(0, R)
    o_c = tl.arange(0, C)
    base = ptr + (t_start.to(tl.int64) * H + i_h) * W + col0
    return tl.load(base + o_r[:, None] * (H * W) + o_c[None, :], mask=(o_r < n_rows)[:, None], other=0.0)


@triton.jit
def store_rows(
    ptr, value, t_start, n_rows, i_h, col0, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    """Store ``value`` ``[R, C]`` into rows ``t_start + r < t_start + n_rows`` of a ``[tokens, H, W]``
    tensor at columns ``col0 + c`` (cast to the tensor's dtype)."""
    o_r = tl.arange(0, R)
    o_c = tl.arange(0, C)
    base = ptr + (t_start.to(tl.int64) * H + i_h) * W + col0
    tl.store(
        base + o_r[:, None] * (H * W) + o_c[None, :],
        value.to(ptr.dtype.element_ty),
        mask=(o_r < n_rows)[:, None],
    )


@triton.jit
def load_row_vec(ptr, t_start, n_rows, i_h, H: tl.constexpr, R: tl.constexpr):
    """Load ``[R]`` from a ``[tokens, H]`` tensor (rows past ``n_rows`` read as 0), as fp32."""
    o_r = tl.arange(0, R)
    base = ptr + t_start.to(tl.int64) * H + i_h
    return tl.load(base + o_r * H, mask=o_r < n_rows, other=0.0).to(tl.float32)


@triton.jit
def load_beta(beta, t_start, n_rows, i_h, H: tl.constexpr, R: tl.constexpr, SIGMOID: tl.constexpr):
    """Load β ``[R]`` from a ``[tokens, H]`` tensor as fp32 (rows past ``n_rows`` 0): the stored values, or
    with ``SIGMOID`` their sigmoid (``beta`` then holds logits, fla's ``use_beta_sigmoid_in_kernel``)."""
    b = load_row_vec(beta, t_start, n_rows, i_h, H, R)
    if SIGMOID:
        b = tl.where(tl.arange(0, R) < n_rows, tl.sigmoid(b), 0.0)
    return b


@triton.jit
def store_row_vec(ptr, value, t_start, n_rows, i_h, H: tl.constexpr, R: tl.constexpr):
    """Store ``[R]`` into rows ``t_start + r < t_start + n_rows`` of a ``[tokens, H]`` tensor."""
    o_r = tl.arange(0, R)
    base = ptr + t_start.to(tl.int64) * H + i_h
    tl.store(base + o_r * H, value.to(ptr.dtype.element_ty), mask=o_r < n_rows)


@triton.jit
def cumsum_rows(x, R: tl.constexpr, REVERSE: tl.constexpr, BY_DOT: tl.constexpr):
    """Inclusive cumsum of ``x`` ``[R, C]`` fp32 over its rows (``REVERSE``: from the last row).

    With ``BY_DOT`` it is three tensor-core products with the 0/1 triangle instead of ``tl.cumsum``'s scan:
    ``x`` is split into bf16 pieces ``hi + mid + lo`` (each the bf16 rounding of what is left, so the pieces
    carry ``x`` to ``2^-27`` relative), the triangle is exact in bf16 and the products accumulate in fp32, so
    the result is an fp32 cumsum up to summation order. A zero of the triangle times a finite ``x`` is an
    exact zero, so row ``i`` depends on rows ``≤ i`` only (``≥ i`` when ``REVERSE``)."""
    if BY_DOT:
        o = tl.arange(0, R)
        if REVERSE:
            tri = tl.where(o[:, None] <= o[None, :], 1.0, 0.0).to(tl.bfloat16)
        else:
            tri = tl.where(o[:, None] >= o[None, :], 1.0, 0.0).to(tl.bfloat16)
        hi = x.to(tl.bfloat16)
        mid, lo = split_bf16(x - hi.to(tl.float32))
        return tl.dot(tri, lo) + tl.dot(tri, mid) + tl.dot(tri, hi)
    else:
        return tl.cumsum(x, axis=0, reverse=REVERSE)


@triton.jit
def gate_cumsum_slice(g, t0, n_valid, i_h, A_h, dt_bias, k0, lb2,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BY_DOT: tl.constexpr):  # fmt: skip
    """Channels ``k0..k0+BK`` of the chunk's gate: Γ ``[BT, BK]`` (inclusive cumsum, log2 units, by
    :func:`cumsum_rows`) and its last valid row Γ_C ``[BK]``; rows past ``n_valid`` add nothing (identity
    tokens)."""
    o_t = tl.arange(0, BT)
    if HAS_BIAS:
        bias = tl.load(dt_bias + i_h * K + k0 + tl.arange(0, BK)).to(tl.float32)
    else:
        bias = tl.zeros([BK], dtype=tl.float32)
    b_x = load_rows(g, t0, n_valid, i_h, k0, H, K, BT, BK).to(tl.float32)
    b_g = tl.where((o_t < n_valid)[:, None], k3_gate_log2(b_x, A_h, bias, lb2), 0.0)
    return cumsum_rows(b_g, BT, False, BY_DOT), tl.sum(b_g, axis=0)


@triton.jit
def split2_rows(x, R: tl.constexpr, C: tl.constexpr):
    """Rows ``[0, R/2)`` and ``[R/2, R)`` of ``x`` ``[R, C]``."""
    return tl.split(tl.permute(tl.reshape(x, [2, R // 2, C]), [1, 2, 0]))


@triton.jit
def split2_cols(x, R: tl.constexpr, C: tl.constexpr):
    """Columns ``[0, C/2)`` and ``[C/2, C)`` of ``x`` ``[R, C]``."""
    return tl.split(tl.permute(tl.reshape(x, [R, 2, C // 2]), [0, 2, 1]))


@triton.jit
def cat2_rows(a, b, R: tl.constexpr, C: tl.constexpr):
    """``[a; b]`` ``[2R, C]`` from two ``[R, C]`` tiles."""
    return tl.reshape(tl.permute(tl.join(a, b), [2, 0, 1]), [2 * R, C])


@triton.jit
def cat2_cols(a, b, R: tl.constexpr, C: tl.constexpr):
    """``[a, b]`` ``[R, 2C]`` from two ``[R, C]`` tiles."""
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [R, 2 * C])


@triton.jit
def split4_rows(x, R: tl.constexpr, C: tl.constexpr):
    """The four ``[R/4, C]`` row blocks of ``x`` ``[R, C]``, top first."""
    top, bottom = split2_rows(x, R, C)
    x0, x1 = split2_rows(top, R // 2, C)
    x2, x3 = split2_rows(bottom, R // 2, C)
    return x0, x1, x2, x3


@triton.jit
def split4_cols(x, R: tl.constexpr, C: tl.constexpr):
    """The four ``[R, C/4]`` column blocks of ``x`` ``[R, C]``, left first."""
    left, right = split2_cols(x, R, C)
    x0, x1 = split2_cols(left, R, C // 2)
    x2, x3 = split2_cols(right, R, C // 2)
    return x0, x1, x2, x3


@triton.jit
def cat4_rows(x0, x1, x2, x3, R: tl.constexpr, C: tl.constexpr):
    """``[x0; x1; x2; x3]`` ``[4R, C]`` from four ``[R, C]`` tiles."""
    return cat2_rows(cat2_rows(x0, x1, R, C), cat2_rows(x2, x3, R, C), 2 * R, C)


@triton.jit
def cat4_cols(x0, x1, x2, x3, R: tl.constexpr, C: tl.constexpr):
    """``[x0, x1, x2, x3]`` ``[R, 4C]`` from four ``[R, C]`` tiles."""
    return cat2_cols(cat2_cols(x0, x1, R, C), cat2_cols(x2, x3, R, C), R, 2 * C)


@triton.jit
def row_at(x, row, R: tl.constexpr):
    """Row ``row`` of ``x`` ``[R, C]`` as a ``[C]`` vector (a masked sum over rows: exact)."""
    return tl.sum(tl.where((tl.arange(0, R) == row)[:, None], x, 0.0), axis=0)
