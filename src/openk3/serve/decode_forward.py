"""Batched forward over the paged cache: ``B`` requests with ``T`` new tokens each on top of their cached
prefixes (one-token decodes, or prefill chunks that continue a cached prefix), absorbed MLA over latent
blocks, two-phase AttnRes.

This is the serving fast path beside the model's own forward (the reference, used for the first prefill
chunk of new requests): the same layers and weights, wired the same way (``openk3.model.decoder``), with
three differences:

* **Paged, padded MLA.** Each request's cached latents are gathered from its block table (one
  ``index_select``) and padded to the longest; a key mask ``[B, 1, T, S]`` hides the padding and the
  future inside the model's attention: absorbed (``q̃ = q_nope W_UK`` scored against the 576-number latent,
  DeepSeek-V3 ``absorb``) for up to 16 new tokens, as the model's ``auto`` rule, else naive. NoPE MLA has
  no positions, so padding placement does not matter.
* **Batched KDA state.** The KDA states of the ``B`` requests are gathered into per-layer contiguous
  batches (:meth:`~openk3.serve.cache_storage.CacheStorage.gather_states`, which keeps a steady decode
  batch checked out between steps); a decode token updates them in place
  (:func:`~openk3.serve.kda_decode.kda_decode_`), a longer chunk runs the layer's forward on them and
  copies the new states in.
* **Two-phase Block AttnRes** (two-phase inference, ``docs/references.md#block-attention-residuals``). The
  pseudo-queries
  do not depend on the input, so every mix that reads the same set of completed blocks is scored in one
  batched pass (phase 1: per query ``m_b = max z``, ``s_b = Σ e^{z−m_b}``, ``acc_b = Σ e^{z−m_b} v``);
  each mix then folds in the running partial sum ``v_p`` with logit ``z_p`` (phase 2, online softmax):
  ``h = (acc_b e^{m_b−m} + v_p e^{z_p−m}) / (s_b e^{m_b−m} + e^{z_p−m})``, ``m = max(m_b, z_p)``.

Equal to the model's forward with a cache up to float rounding (tested).

Legend: ``B`` requests, ``T`` new tokens per request, ``S`` cached tokens (padded), ``D`` width, ``V``
vocabulary, ``Q`` mixes that read one block set, ``N`` completed blocks, ``C`` kv_lora_rank, ``r``
qk_rope_head_dim, ``L`` MLA layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.norm import rms_normalize
from openk3.serve.cache_storage import CacheStorage
from openk3.serve.kda_decode import kda_decode_


@dataclass
class _MixSite:
    """One AttnRes mix: which layer and sublayer, and how many completed blocks it reads."""

    norm: nn.Module
    proj: nn.Linear
    num_blocks: int
    index: int = 0
    """Position of this mix in its block set's query stack."""


def attn_res_sites(backbone: nn.Module) -> tuple[list[_MixSite | None], list[_MixSite], _MixSite]:
    """Walk the K3 wiring once: the ``self_attention_res`` site of each layer (``None`` when no block exists
    yet), the ``mlp_res`` site of each layer, and the output site; sites reading equal block sets share a
    query stack."""
    attn_sites: list[_MixSite | None] = []
    mlp_sites: list[_MixSite] = []
    n = 0
    for i, layer in enumerate(backbone.layers):
        attn_sites.append(
            _MixSite(layer.self_attention_res_norm, layer.self_attention_res_proj, n) if n else None
        )
        if i % layer.block_size == 0:
            n += 1
        mlp_sites.append(_MixSite(layer.mlp_res_norm, layer.mlp_res_proj, n))
    out_site = _MixSite(backbone.output_attn_res_norm, backbone.output_attn_res_proj, n)
    counts: dict[int, int] = {}
    for site in [s for s in attn_sites if s is not None] + mlp_sites + [out_site]:
        site.index = counts.get(site.num_blocks, 0)
        counts[site.num_blocks] = site.index + 1
    return attn_sites, mlp_sites, out_site


class TwoPhaseAttnRes:
    """Phase-1 statistics per block set, computed on first use; phase 2 per mix. fp32 (fp64 stays)."""

    def __init__(self, sites: list[_MixSite], blocks: list[torch.Tensor]) -> None:
        self.sites = sites
        self.blocks = blocks
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _phase1(self, num_blocks: int, compute: torch.dtype):
        group = sorted((s for s in self.sites if s.num_blocks == num_blocks), key=lambda s: s.index)
        eps = group[0].norm.eps
        if any(s.norm.eps != eps for s in group):
            raise ValueError("AttnRes norms reading one block set must share eps for the two-phase mix")
        q_QD = torch.stack([s.norm.weight.to(compute) * s.proj.weight[0].to(compute) for s in group])
        v_NBTD = torch.stack(self.blocks[:num_blocks]).to(compute)
        z_QNBT = torch.einsum("qd,nbtd->qnbt", q_QD, rms_normalize(v_NBTD, eps))
        m_QBT = z_QNBT.amax(1)
        e_QNBT = torch.exp(z_QNBT - m_QBT[:, None])
        acc_QBTD = torch.einsum("qnbt,nbtd->qbtd", e_QNBT, v_NBTD)
        return q_QD, m_QBT, e_QNBT.sum(1), acc_QBTD

    def mix(self, site: _MixSite, partial_BTD: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if partial_BTD.dtype == torch.float64 else torch.float32
        if site.num_blocks not in self.stats:
            self.stats[site.num_blocks] = self._phase1(site.num_blocks, compute)
        q_QD, m_QBT, s_QBT, acc_QBTD = self.stats[site.num_blocks]
        j = site.index
        v_BTD = partial_BTD.to(compute)
        z_BT = rms_normalize(v_BTD, site.norm.eps) @ q_QD[j]
        m_BT = torch.maximum(m_QBT[j], z_BT)
        a_BT, c_BT = torch.exp(m_QBT[j] - m_BT), torch.exp(z_BT - m_BT)
        h_BTD = (acc_QBTD[j] * a_BT[..., None] + v_BTD * c_BT[..., None]) / (s_QBT[j] * a_BT + c_BT)[
            ..., None
        ]
        return h_BTD.to(partial_BTD.dtype)


ABSORB_MAX_TOKENS = 16
"""Up to this many new tokens per request MLA attends over the latent (absorbed), as the model's ``auto``."""


def mla_paged_attention(attn: nn.Module, x_BTD: torch.Tensor, past_BSd: torch.Tensor, mask_BS: torch.Tensor):
    """One MLA mixer call for ``T`` new tokens over padded cached latents ``[B, S, C + r]`` with key mask
    ``[B, S]``. Returns ``(y [B, T, D], new latents [B, T, C + r])``."""
    B, T, _ = x_BTD.shape
    C = attn.kv_lora_rank
    q_nope, q_pe = attn.query(x_BTD)
    ckv_BTd = attn.kv_a_proj_with_mqa(x_BTD)
    c_BTC = attn.kv_a_layernorm(ckv_BTd[..., :C])
    k_pe_BTr = ckv_BTd[..., C:]
    c_BSC = torch.cat([past_BSd[..., :C], c_BTC], 1)
    k_pe_BSr = torch.cat([past_BSd[..., C:], k_pe_BTr], 1)
    S = c_BSC.shape[1]
    causal_TS = torch.arange(S - T, S, device=x_BTD.device)[:, None] >= torch.arange(S, device=x_BTD.device)
    keys_BS = torch.cat([mask_BS, mask_BS.new_ones(B, T)], 1)
    mask_B1TS = (causal_TS[None] & keys_BS[:, None, :])[:, None]
    absorb = attn.attn_impl == "absorb" or (attn.attn_impl == "auto" and T <= ABSORB_MAX_TOKENS)
    attend = attn.absorbed_attention if absorb else attn.naive_attention
    o_BTHv = attend(q_nope, q_pe, c_BSC, k_pe_BSr, mask_B1TS)
    o_BTP = o_BTHv.reshape(B, T, -1)
    if attn.g_proj is not None:
        o_BTP = o_BTP * torch.sigmoid(attn.g_proj(x_BTD))
    return attn.o_proj(o_BTP), torch.cat([c_BTC, k_pe_BTr], -1)


class PagedForward:
    """``__call__`` runs ``T`` new tokens for each of ``B`` requests and returns the last position's logits
    ``[B, V]``, reading and writing the requests' caches in the pool.

    Args of the call: ``token_ids`` (``B`` lists of ``T`` ints), ``positions`` (each request's
    ``num_computed_tokens``: the cached length, where the first new token's latent is written),
    ``block_tables`` (covering the new tokens), ``state_slots``; optional ``inputs_embeds`` ``[B, T, D]``
    in place of the token embeddings (a chunk holding an image's placeholder tokens).
    """

    def __init__(self, lm: nn.Module, storage: CacheStorage) -> None:
        self.lm, self.storage = lm, storage
        self.backbone = lm.model
        self.config = lm.config
        self.kinds = self.config.layer_types
        self.kda_index = [self.kinds[:i].count("kda") for i in range(len(self.kinds))]
        self.mla_index = [self.kinds[:i].count("mla") for i in range(len(self.kinds))]
        self.sites = attn_res_sites(self.backbone) if self.config.uses_attn_res else None

    @torch.no_grad()
    def __call__(
        self,
        token_ids: list[list[int]],
        positions: list[int],
        block_tables: list[list[int]],
        state_slots: list[tuple[int, ...]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        st, bs = self.storage, self.storage.layout.block_size
        device = self.backbone.embed_tokens.weight.device
        T = len(token_ids[0])
        if any(len(t) != T for t in token_ids):
            raise ValueError("every request of one paged forward must bring the same number of tokens")
        states = st.gather_states(state_slots) if "kda" in self.kinds else None
        caches = states.caches(st.layout.model_dtype) if states is not None and T > 1 else None
        has_mla = "mla" in self.kinds
        if has_mla:
            past_LBSd, mask_BS = st.gather_latents(block_tables, positions)
        new_latents: list[torch.Tensor] = []

        def mixer(i: int, x_BTD: torch.Tensor) -> torch.Tensor:
            attn = self.backbone.layers[i].self_attn
            if self.kinds[i] == "kda":
                j = self.kda_index[i]
                if caches is not None:
                    return attn(x_BTD, caches[j])
                return kda_decode_(attn, x_BTD, states.recurrent[j], states.conv[j])
            y, lat = mla_paged_attention(attn, x_BTD, past_LBSd[self.mla_index[i]], mask_BS)
            new_latents.append(lat)
            return y

        if inputs_embeds is None:
            h_BTD = self.backbone.embed_tokens(torch.tensor(token_ids, device=device))
        else:  # ``[B, T, D]``: the token embeddings with a prompt's images placed in them
            h_BTD = inputs_embeds
        if self.sites is None:
            for i, layer in enumerate(self.backbone.layers):
                h_BTD = h_BTD + mixer(i, layer.input_layernorm(h_BTD))
                h_BTD = h_BTD + layer.ffn(layer.post_attention_layernorm(h_BTD))
        else:
            h_BTD = self._attn_res_layers(h_BTD, mixer)
        logits_BV = self.lm.lm_head(self.backbone.norm(h_BTD[:, -1]))
        if caches is not None:
            states.absorb(caches)
        if has_mla:
            pages = [
                table[p // bs]
                for table, start in zip(block_tables, positions)
                for p in range(start, start + T)
            ]
            offsets = [p % bs for start in positions for p in range(start, start + T)]
            st.write_latents(pages, offsets, torch.stack(new_latents).flatten(1, 2))
        return logits_BV

    def _attn_res_layers(self, h_BTD: torch.Tensor, mixer) -> torch.Tensor:
        """The K3 wiring of ``KimiDecoderLayer.forward_attn_res`` with two-phase mixes."""
        attn_sites, mlp_sites, out_site = self.sites
        blocks: list[torch.Tensor] = []
        res = TwoPhaseAttnRes([s for s in attn_sites if s is not None] + mlp_sites + [out_site], blocks)
        partial = h_BTD
        for i, layer in enumerate(self.backbone.layers):
            x_BTD = res.mix(attn_sites[i], partial) if blocks else partial
            if i % layer.block_size == 0:
                blocks.append(partial)
                partial = None
            a_BTD = mixer(i, layer.input_layernorm(x_BTD))
            partial = a_BTD if partial is None else partial + a_BTD
            x_BTD = res.mix(mlp_sites[i], partial)
            partial = partial + layer.ffn(layer.post_attention_layernorm(x_BTD))
        return res.mix(out_site, partial)
