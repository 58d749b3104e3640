"""Gated NoPE Multi-head Latent Attention (``self_attn`` of an MLA layer), naive and absorbed paths.

``docs/references.md#gated-nope-mla`` (DeepSeek-V3 ``naive``/``absorb``)::

    q            = q_b_proj(q_a_layernorm(q_a_proj x))  | q_proj x      # [B, T, H, n + r]
    [c | k_pe]   = kv_a_proj_with_mqa x                                 # c: kv_lora_rank, k_pe: r (shared, never rotated)
    c            = kv_a_layernorm(c)                                    # the cached latent (eps 1e-6)
    [k_nope | v] = kv_b_proj c                                          # [B, S, H, n + v]
    o            = softmax((q_nope·k_nope + q_pe·k_pe) · (n + r)^-½) v  # causal
    y            = o_proj(o ⊙ σ(g_proj x))                              # gate only when mla_use_output_gate

The cache keeps ``c`` and ``k_pe`` (kv_lora_rank + r = 576 numbers per token in K3). The *naive* path
expands them into per-head keys and values; the *absorbed* path folds ``W_UK`` into the query and
``W_UV`` into the output and attends over the latent directly (what decode uses). With a server's
:class:`~openk3.model.cache.PagedLatents` the cached latents come padded with a key mask, and the new ones
are handed back in the cache (NoPE: no positions, so where the padding sits does not matter); with a
:class:`~openk3.model.cache.PagedPool` (a server's decode step) the absorbed path reads the block pool in
place (:func:`openk3.ops.mla.paged_latent_attention`).

Legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``H`` heads, ``n`` qk_nope,
``r`` qk_rope, ``v`` v_head_dim, ``C`` kv_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.model.cache import MLACache, PagedLatents, PagedPool
from openk3.model.norm import RMSNorm
from openk3.model.packing import PackedProjection, few_rows, pack_linears, packed_or_none, project
from openk3.model.varlen import document_ids
from openk3.ops.mla import paged_latent_attention

ABSORB_MAX_TOKENS = 16
"""With a cache, at most this many new tokens and no grad, ``auto`` takes the absorbed path."""
MLA_LORA_NORM_EPS = 1e-6
"""``q_a_layernorm``/``kv_a_layernorm`` use the RMSNorm default eps, not ``rms_norm_eps`` (official code)."""


def attention_mask(
    T: int, S: int, device, cu_seqlens: torch.Tensor | None, force: bool = False
) -> torch.Tensor | None:
    """Boolean ``[T, S]`` mask (True = attend) for new tokens at positions ``S−T..S−1``.

    Returns ``None`` for plain causal attention without a past (SDPA's ``is_causal``) unless ``force``.
    """
    if (cu_seqlens is None or cu_seqlens.numel() == 2) and T == S and not force:
        return None  # no past, at most one document: plain causal
    q_pos = torch.arange(S - T, S, device=device)
    mask = q_pos[:, None] >= torch.arange(S, device=device)[None, :]
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, S)
        mask = mask & (doc[S - T :, None] == doc[None, :])
    return mask


class MultiheadLatentAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, MLA_LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False) if config.mla_use_output_gate else None
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        self.q_lora = config.q_lora_rank is not None
        self.attn_impl = "auto"
        """``"naive"``, ``"absorb"`` or ``"auto"`` (absorbed when decoding a few tokens over a cache)."""
        self.packed: PackedProjection | None = None
        """The input projections as one GEMM (:meth:`pack_projections`, the server's forwards)."""

    @property
    def query_in_proj(self) -> nn.Linear:
        """The query's first projection: ``q_a_proj`` (low-rank query) or ``q_proj``."""
        return self.q_a_proj if self.q_lora else self.q_proj

    def _input_linears(self) -> list[nn.Linear]:
        return [self.query_in_proj, self.kv_a_proj_with_mqa] + (
            [self.g_proj] if self.g_proj is not None else []
        )

    def pack_projections(self) -> None:
        """Pack the query's first projection, ``kv_a_proj_with_mqa`` and ``g_proj`` into one matrix
        (:func:`~openk3.model.packing.pack_linears`), read by forwards without gradient."""
        self.packed = pack_linears(self._input_linears())

    def input_projections(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q_a x | q x, kv_a_proj_with_mqa x[, g_proj x])``: one GEMM when packed and without gradient."""
        packed = packed_or_none(self.packed)
        if packed is not None:
            return packed(x_BTD)
        return tuple(lin(x_BTD) for lin in self._input_linears())

    def query(
        self, x_BTD: torch.Tensor, q_in: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_nope [B, T, H, n], q_pe [B, T, H, r])`` from the normed input (also used by the draft);
        ``q_in``: its first projection (``q_a_proj x`` or ``q_proj x``) when already computed."""
        B, T, _ = x_BTD.shape
        if q_in is None:
            q_in = self.query_in_proj(x_BTD)
        q = project(self.q_a_layernorm(q_in), self.q_b_proj) if self.q_lora else q_in
        q_BTHd = q.view(B, T, self.num_heads, self.nope + self.rope)
        return q_BTHd[..., : self.nope], q_BTHd[..., self.nope :]

    def forward(
        self,
        x_BTD: torch.Tensor,
        cache: MLACache | PagedLatents | PagedPool | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: ``x_BTD`` normed input; ``cache`` (appended in place); ``cu_seqlens`` int64 ``[N+1]`` (B = 1,
        no cache). Returns ``[B, T, D]``."""
        B, T, _ = x_BTD.shape
        q_in, ckv_BTd, *gate = self.input_projections(x_BTD)
        q_nope, q_pe = self.query(x_BTD, q_in)
        c_BTC = self.kv_a_layernorm(ckv_BTd[..., : self.kv_lora_rank])
        k_pe_BTr = ckv_BTd[..., self.kv_lora_rank :]
        if isinstance(cache, PagedPool):
            o_BTHv = self.pool_attention(q_nope, q_pe, c_BTC, k_pe_BTr, cache)
            return self._output(o_BTHv, gate)
        c_BTC, k_pe_BTr, mask_TS = self.attended_latents(c_BTC, k_pe_BTr, cache, cu_seqlens)
        absorb = self.attn_impl == "absorb" or (
            self.attn_impl == "auto"
            and cache is not None
            and T <= ABSORB_MAX_TOKENS
            and not torch.is_grad_enabled()
        )
        if isinstance(cache, PagedLatents):
            mask_TS = cache.attention_mask(T, dense=absorb)  # [B, 1, T, S], or a lower-right causal bias
        attend = self.absorbed_attention if absorb else self.naive_attention
        return self._output(attend(q_nope, q_pe, c_BTC, k_pe_BTr, mask_TS), gate)

    def _output(self, o_BTHv: torch.Tensor, gate: list[torch.Tensor]) -> torch.Tensor:
        """``o_proj(o ⊙ σ(g))`` (the gate when the layer has one) of the heads' outputs: ``[B, T, D]``."""
        B, T = o_BTHv.shape[:2]
        o_BTP = o_BTHv.reshape(B, T, self.num_heads * self.v_dim)
        if gate:
            o_BTP = o_BTP * torch.sigmoid(gate[0])
        return project(o_BTP, self.o_proj)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, n, C], W_UV [H, v, C])``: views of ``kv_b_proj``'s weight."""
        w_HdC = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w_HdC[:, : self.nope], w_HdC[:, self.nope :]

    def pool_attention(self, q_nope, q_pe, c_BTC, k_pe_BTr, cache: PagedPool) -> torch.Tensor:
        """Absorbed attention over the cached latents in the block pool and, causally, the new ones; keeps the
        new latents in ``cache.new``. Returns ``[B, T, H, v]``."""
        cache.new = torch.cat([c_BTC, k_pe_BTr], -1)
        w_uk_HnC, w_uv_HvC = self._absorbed_weights()
        few = few_rows(c_BTC)  # one row: fp32 products and sums Inductor fuses (packing.project)
        acc = torch.promote_types(q_nope.dtype, torch.float32)
        if few:
            q_lat_BTHC = (q_nope.to(acc)[..., None] * w_uk_HnC.to(acc)).sum(-2).to(q_nope.dtype)
        else:
            q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q_nope, w_uk_HnC)
        o_lat_BTHC = paged_latent_attention(
            q_lat_BTHC, q_pe, c_BTC, k_pe_BTr, cache.pages, cache.table_BN, cache.lengths_B, cache.layer,
            cache.num_layers, cache.block_size, self.scale,
        )  # fmt: skip
        if few:
            return (o_lat_BTHC.to(acc)[..., None, :] * w_uv_HvC.to(acc)).sum(-1).to(o_lat_BTHC.dtype)
        return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_uv_HvC)

    def attended_latents(self, c_BTC, k_pe_BTr, cache: MLACache | PagedLatents | None, cu_seqlens):
        """``(c_BSC, k_pe_BSr, mask_TS)``: the latents the new tokens attend to (the cache's and theirs) and the
        mask (None: plain causal, or, with ``PagedLatents``, the mask :meth:`forward` takes from the paged
        cache). The seam context parallelism overrides (:mod:`openk3.dist.cp_mla`)."""
        T = c_BTC.shape[1]
        if cache is not None:
            c_BTC, k_pe_BTr = cache.append(c_BTC, k_pe_BTr)
        if isinstance(cache, PagedLatents):
            return c_BTC, k_pe_BTr, None
        return c_BTC, k_pe_BTr, attention_mask(T, c_BTC.shape[1], c_BTC.device, cu_seqlens)

    def naive_attention(self, q_nope, q_pe, c_BSC, k_pe_BSr, mask_TS) -> torch.Tensor:
        """Expand the latent into per-head K/V, then scaled-dot-product attention; ``mask_TS`` ``[T, S]`` or
        ``[B, 1, T, S]`` (True = attend), SDPA's lower-right causal bias, or None (causal, ``T = S``).
        Returns ``[B, T, H, v]``."""
        B, S, _ = c_BSC.shape
        H = self.num_heads
        kv_BSHd = self.kv_b_proj(c_BSC).view(B, S, H, self.nope + self.v_dim)
        k_nope, v_BSHv = kv_BSHd[..., : self.nope], kv_BSHd[..., self.nope :]
        k_BSHd = torch.cat([k_nope, k_pe_BSr[:, :, None, :].expand(B, S, H, self.rope)], dim=-1)
        q_BTHd = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(
            q_BTHd.transpose(1, 2),
            k_BSHd.transpose(1, 2),
            v_BSHv.transpose(1, 2),
            attn_mask=mask_TS,
            is_causal=mask_TS is None,
            scale=self.scale,
        )
        return o.transpose(1, 2)

    def absorbed_attention(self, q_nope, q_pe, c_BSC, k_pe_BSr, mask_TS) -> torch.Tensor:
        """Attend over the latent: ``q̃ = q_nope W_UK``, ``o = (P c) W_UVᵀ``; ``mask_TS`` as
        :meth:`naive_attention`. Returns ``[B, T, H, v]``."""
        w_uk_HnC, w_uv_HvC = self._absorbed_weights()
        q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q_nope, w_uk_HnC)
        scores_BHTS = torch.einsum("bthc,bsc->bhts", q_lat_BTHC, c_BSC)
        scores_BHTS = scores_BHTS + torch.einsum("bthr,bsr->bhts", q_pe, k_pe_BSr)
        scores_BHTS = (
            scores_BHTS.float() * self.scale
            if scores_BHTS.dtype != torch.float64
            else scores_BHTS * self.scale
        )
        if mask_TS is None:  # plain causal over a sequence with no past
            mask_TS = attention_mask(q_nope.shape[1], c_BSC.shape[1], c_BSC.device, None, force=True)
        scores_BHTS = scores_BHTS.masked_fill(~mask_TS, float("-inf"))
        p_BHTS = torch.softmax(scores_BHTS, dim=-1).to(c_BSC.dtype)
        o_lat_BTHC = torch.einsum("bhts,bsc->bthc", p_BHTS, c_BSC)
        return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_uv_HvC)
