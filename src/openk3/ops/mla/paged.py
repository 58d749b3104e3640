"""Absorbed MLA decode attention over the paged block pool, read in place through the block tables.

A decode (or speculative verify) step of ``B`` rows, each with ``T`` new tokens after ``n_b`` cached ones,
attends over the latents ``[c | k_pe]`` of the cached tokens, which live in pool pages, and over the new
tokens' own latents (not yet in the pool: the step writes them after it runs). In absorbed form
(``docs/references.md#gated-nope-mla``), with ``q̃ = q_nope W_UK`` the latent query::

    s_j = (q̃ · c_j + q_pe · k_pe_j) · scale          j over the n_b cached tokens, then the new ones (causal)
    o   = Σ_j softmax(s)_j c_j                         [B, T, H, C]; the caller applies W_UV

The cached part is split into ``P`` ranges of tokens (:func:`latent_pool_splits`: flash-decoding, so that one
long row spreads over many multiprocessors), each giving
its softmax-normalised partial output and log-sum-exp; the new tokens give another; the parts merge by their
log-sum-exps::

    lse = log Σ_i e^{lse_i},   o = Σ_i e^{lse_i − lse} o_i

The cached part is the custom op ``openk3::latent_pool_attention`` (so ``torch.compile`` traces through it as
one node): on CUDA a Triton kernel (:mod:`openk3.ops.mla.triton_pool`) loads each cached token's latent row
once for all ``T·H`` query rows straight from its page (no gathered, padded copy; rows end at their own
length), elsewhere (and for shapes the kernel does not take) the same sum in torch over a gathered copy, the
reference the kernel is tested against. Neither synchronises with the host: a CUDA graph can capture it.

Pool layout (``serve/cache_storage.py``): ``pages`` viewed as rows of width ``W = C + r``; the latent of token
``s`` of a row in MLA layer ``l`` is row ``(table[s // bs] · L + l) · bs + s % bs``.

Legend: ``B`` rows, ``T`` new tokens per row, ``H`` heads, ``C`` kv_lora_rank, ``r`` qk_rope, ``N`` blocks per
row in the table, ``bs`` block size, ``L`` MLA layers in a page, ``P`` splits, ``R`` pool rows.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

PROGRAMS = 128
"""Programs the cached part aims for (about one per multiprocessor of an H100/H200): ``B`` rows get
``PROGRAMS // B`` splits each (:func:`latent_pool_splits`)."""
MAX_SPLITS = 64
"""Most splits per row."""


def latent_pool_splits(rows: int) -> int:
    """Splits ``P`` of each row's cached part for a step of ``rows`` rows, ``1 ≤ P ≤ MAX_SPLITS``: a function
    of the batch alone, so a compiled step whose table width ``N`` is symbolic keeps one graph (each split's
    length, ``⌈N·bs / P⌉``, is taken at run time)."""
    return max(1, min(MAX_SPLITS, PROGRAMS // rows))


def paged_latent_attention(
    q_lat_BTHC: Tensor,
    q_pe_BTHr: Tensor,
    lat_new_BTC: Tensor,
    k_pe_new_BTr: Tensor,
    pages_RW: Tensor,
    table_BN: Tensor,
    lengths_B: Tensor,
    layer: int,
    num_layers: int,
    block_size: int,
    scale: float,
) -> Tensor:
    """``o [B, T, H, C]`` (``q_lat``'s dtype): the new tokens' attention over their row's ``lengths_B[b]``
    cached latents in the pool (``pages_RW``, layer ``layer`` of ``num_layers``, blocks ``table_BN`` of
    ``block_size`` tokens) and, causally, over the new latents ``lat_new``/``k_pe_new``. A row with no cached
    token (a padding row) attends to its new tokens only. Shapes as in the module docstring; ``table_BN`` and
    ``lengths_B`` int64 on the device."""
    B, T, H, C = q_lat_BTHC.shape
    splits = latent_pool_splits(B)
    o_PBTHC, lse_PBTH = torch.ops.openk3.latent_pool_attention(
        q_lat_BTHC, q_pe_BTHr, pages_RW, table_BN, lengths_B, layer, num_layers, block_size, scale, splits
    )
    o_new_BTHC, lse_new_BTH = _new_token_attention(q_lat_BTHC, q_pe_BTHr, lat_new_BTC, k_pe_new_BTr, scale)
    lse_QBTH = torch.cat([lse_PBTH, lse_new_BTH[None]])  # finite for the new part: a token sees itself
    w_QBTH = (lse_QBTH - torch.logsumexp(lse_QBTH, 0)).exp()
    o_BTHC = (w_QBTH[:-1, ..., None] * o_PBTHC).sum(0) + w_QBTH[-1, ..., None] * o_new_BTHC
    return o_BTHC.to(q_lat_BTHC.dtype)


def _new_token_attention(
    q_lat_BTHC: Tensor, q_pe_BTHr: Tensor, lat_BTC: Tensor, k_pe_BTr: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """The new tokens' causal attention among themselves: ``(o [B, T, H, C], lse [B, T, H])`` in fp32 (fp64
    for fp64 inputs)."""
    acc = torch.promote_types(q_lat_BTHC.dtype, torch.float32)
    T = q_lat_BTHC.shape[1]
    s_BTHS = torch.einsum("bthc,bsc->bths", q_lat_BTHC.to(acc), lat_BTC.to(acc))
    s_BTHS = (s_BTHS + torch.einsum("bthr,bsr->bths", q_pe_BTHr.to(acc), k_pe_BTr.to(acc))) * scale
    causal_TS = torch.ones(T, T, dtype=torch.bool, device=s_BTHS.device).tril()
    s_BTHS = s_BTHS.masked_fill(~causal_TS[:, None, :], float("-inf"))
    lse_BTH = torch.logsumexp(s_BTHS, -1)
    o_BTHC = torch.einsum("bths,bsc->bthc", (s_BTHS - lse_BTH[..., None]).exp(), lat_BTC.to(acc))
    return o_BTHC, lse_BTH


@torch.library.custom_op("openk3::latent_pool_attention", mutates_args=())
def latent_pool_attention(
    q_lat: Tensor, q_pe: Tensor, pages: Tensor, table: Tensor, lengths: Tensor, layer: int, num_layers: int,
    block_size: int, scale: float, splits: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The cached part of :func:`paged_latent_attention`: ``(o [P, B, T, H, C], lse [P, B, T, H])`` in fp32
    (fp64 for fp64 inputs), one softmax-normalised part per split; the ``P`` splits partition each row's
    cached tokens in consecutive ranges (where they cut is the implementation's), and a split without tokens
    gives ``o = 0``, ``lse = −inf``. The Triton kernel where
    :func:`~openk3.ops.mla.triton_pool.kernel_takes` says so (imported only then), else torch."""
    from openk3.ops.kda.triton.dispatch import triton_available

    if q_lat.is_cuda and triton_available():
        from openk3.ops.mla.triton_pool import kernel_takes, latent_pool_attention_triton

        if kernel_takes(q_lat, q_pe, pages):
            return latent_pool_attention_triton(
                q_lat, q_pe, pages, table, lengths, layer, num_layers, block_size, scale, splits
            )
    return latent_pool_attention_torch(
        q_lat, q_pe, pages, table, lengths, layer, num_layers, block_size, scale, splits
    )


@latent_pool_attention.register_fake
def _(q_lat, q_pe, pages, table, lengths, layer, num_layers, block_size, scale, splits):
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    B, T, H, C = q_lat.shape
    return q_lat.new_empty(splits, B, T, H, C, dtype=acc), q_lat.new_empty(splits, B, T, H, dtype=acc)


def latent_pool_attention_torch(
    q_lat: Tensor, q_pe: Tensor, pages: Tensor, table: Tensor, lengths: Tensor, layer: int, num_layers: int,
    block_size: int, scale: float, splits: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`latent_pool_attention` in torch: gathers each row's ``N·bs`` table positions (padding masked),
    one softmax per split."""
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    B, T, H, C = q_lat.shape
    S = table.shape[1] * block_size
    chunk = math.ceil(S / splits)
    pos_S = torch.arange(S, device=q_lat.device)
    rows_BS = (table[:, pos_S // block_size] * num_layers + layer) * block_size + pos_S % block_size
    lat_BSW = pages.view(-1, C + q_pe.shape[-1])[rows_BS].to(acc)
    s_BTHS = torch.einsum("bthc,bsc->bths", q_lat.to(acc), lat_BSW[..., :C])
    s_BTHS = (s_BTHS + torch.einsum("bthr,bsr->bths", q_pe.to(acc), lat_BSW[..., C:])) * scale
    s_BTHS = s_BTHS.masked_fill((pos_S >= lengths[:, None])[:, None, None, :], float("-inf"))
    s_PBTHS = torch.nn.functional.pad(s_BTHS, (0, splits * chunk - S), value=float("-inf"))
    s_PBTHS = s_PBTHS.unflatten(-1, (splits, chunk)).movedim(-2, 0)
    lse_PBTH = torch.logsumexp(s_PBTHS, -1)
    p_PBTHS = (s_PBTHS - lse_PBTH[..., None]).exp().nan_to_num(0.0)  # an empty split: −inf − (−inf)
    lat_PBSC = torch.nn.functional.pad(lat_BSW[..., :C], (0, 0, 0, splits * chunk - S))
    lat_PBSC = lat_PBSC.unflatten(1, (splits, chunk)).movedim(1, 0)
    o_PBTHC = torch.einsum("pbths,pbsc->pbthc", p_PBTHS, lat_PBSC)
    return o_PBTHC.contiguous(), lse_PBTH.contiguous()  # the strides of the fake (compiled callers check)
