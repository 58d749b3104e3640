"""Triton kernel of ``openk3::latent_pool_attention`` (:mod:`openk3.ops.mla.paged`): the cached part of
absorbed MLA decode attention, reading latent rows from the block pool through the block table.

Grid ``(B, ⌈T·H / BLOCK_M⌉, P)``. A program holds ``BLOCK_M`` query rows ``m = t·H + h`` of one row ``b``
(``q̃ [BLOCK_M, C]`` and ``q_pe [BLOCK_M, r]`` loaded once) and walks its split's cached tokens in tiles of
``BLOCK_S``: per tile it loads the tokens' latent rows ``[BLOCK_S, C + r]`` once for all of its query rows
(the gathered path read a padded copy), scores them with two ``tl.dot``, and keeps an online softmax in fp32
(running max ``m_i`` and sum ``l_i`` in base 2, ``acc [BLOCK_M, C]``). The split ends at the row's length, so
no padding is read. It writes the normalised partial output and its natural-log log-sum-exp; a split past the
row's end writes ``o = 0``, ``lse = −inf``.

Only imported on CUDA (or under ``TRITON_INTERPRET=1`` in the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_S = 32
"""Cached tokens per tile."""
LOG2E = 1.4426950408889634


def kernel_takes(q_lat: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor) -> bool:
    """Whether the kernel handles these inputs: ``C`` and ``r`` powers of two ≥ 16 (whole-dim tiles for
    ``tl.dot``), a floating pool, and not fp64 (the torch path keeps fp64 exact)."""
    C, r = q_lat.shape[-1], q_pe.shape[-1]
    pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (C, r))
    return (
        pow2
        and q_lat.dtype != torch.float64
        and pages.dtype.is_floating_point
        and pages.dtype != torch.float64
    )


@triton.jit
def _latent_pool_attention_kernel(
    q_ptr, qpe_ptr, pages_ptr, table_ptr, len_ptr, o_ptr, lse_ptr,
    B, M, N, layer, L, bs, split_len, scale_log2,
    C: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mt = tl.program_id(1)
    sp = tl.program_id(2)
    W = C + R
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_rows = (b * M + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * C + offs_c[None, :], mask=m_ok[:, None], other=0.0)
    qpe = tl.load(qpe_ptr + q_rows[:, None] * R + offs_r[None, :], mask=m_ok[:, None], other=0.0)
    length = tl.load(len_ptr + b).to(tl.int64)
    lo = sp.to(tl.int64) * split_len  # the loop's bounds in one integer type
    hi = tl.minimum(lo + split_len, length)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, C], tl.float32)
    for start in range(lo, hi, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        blk = tl.load(table_ptr + b * N + s // bs, mask=s_ok, other=0)
        row = ((blk * L + layer) * bs + s % bs).to(tl.int64)
        lat = tl.load(pages_ptr + row[:, None] * W + offs_c[None, :], mask=s_ok[:, None], other=0.0)
        kpe = tl.load(pages_ptr + row[:, None] * W + C + offs_r[None, :], mask=s_ok[:, None], other=0.0)
        lat = lat.to(q.dtype)
        kpe = kpe.to(q.dtype)
        if IEEE:
            sc = tl.dot(q, tl.trans(lat), input_precision="ieee")
            sc += tl.dot(qpe, tl.trans(kpe), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(lat))
            sc += tl.dot(qpe, tl.trans(kpe))
        sc = tl.where(s_ok[None, :], sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, lat.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    out_rows = ((sp * B + b) * M + offs_m).to(tl.int64)
    tl.store(o_ptr + out_rows[:, None] * C + offs_c[None, :], o, mask=m_ok[:, None])
    tl.store(lse_ptr + out_rows, lse, mask=m_ok)


def latent_pool_attention_triton(
    q_lat: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
    layer: int, num_layers: int, block_size: int, scale: float, splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the kernel; arguments and results as ``openk3::latent_pool_attention`` (fp32 results)."""
    B, T, H, C = q_lat.shape
    r = q_pe.shape[-1]
    M = T * H
    N = table.shape[1]
    split_len = math.ceil(N * block_size / splits / BLOCK_S) * BLOCK_S
    block_m = max(16, min(64, 8192 // C, triton.next_power_of_2(M)))  # acc [BLOCK_M, C] fp32 in registers
    o = torch.empty(splits, B, T, H, C, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(splits, B, T, H, dtype=torch.float32, device=q_lat.device)
    grid = (B, triton.cdiv(M, block_m), splits)
    _latent_pool_attention_kernel[grid](
        q_lat.contiguous(), q_pe.contiguous(), pages, table.contiguous(), lengths.contiguous(), o, lse,
        B, M, N, layer, num_layers, block_size, split_len, scale * LOG2E,
        C=C, R=r, BLOCK_M=block_m, BLOCK_S=BLOCK_S, IEEE=q_lat.dtype == torch.float32,
    )  # fmt: skip
    return o, lse
