"""Batched forward over the paged cache: ``B`` requests with ``T`` new tokens each on top of their cached
prefixes (one-token decodes, or prefill chunks that continue a cached prefix).

It is the model's own forward (:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`) given
the server's caches, so a change to a layer is made once:

* **MLA**: each MLA layer gets a :class:`~openk3.model.cache.PagedLatents`: the requests' cached latents
  gathered from their block tables (one ``index_select``), padded to the longest, and a key mask; the layer
  attends absorbed over the latents for up to 16 new tokens, naive above (the model's ``auto`` rule), and
  leaves the new latents in the cache, which this forward writes to the blocks.
* **KDA**: each KDA layer gets a :class:`~openk3.model.cache.KDAStateSlots`: views of the requests' states
  gathered into per-layer contiguous batches
  (:meth:`~openk3.serve.cache_storage.CacheStorage.gather_states`, which keeps a steady decode batch checked
  out between steps), which the layer overwrites in place.
* **Block AttnRes** runs two-phase (:class:`~openk3.model.attn_res.TwoPhaseAttnRes`).

Equal to the model's forward with a cache up to float rounding (tested).

Legend: ``B`` requests, ``T`` new tokens per request, ``V`` vocabulary, ``F`` a draft's tapped features,
``L`` MLA layers, ``C`` kv_lora_rank, ``r`` qk_rope_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.cache import KDAStateSlots, KimiCache, PagedLatents
from openk3.serve.cache_storage import CacheStorage
from openk3.serve.transfer import to_device


class PagedForward:
    """``__call__`` runs ``T`` new tokens for each of ``B`` requests and returns ``(logits, features)``: the
    last position's logits ``[B, V]`` and the draft's features ``[B, T, F]`` of ``feature_layers`` (``None``
    for none), reading and writing the requests' caches in the pool.

    Args of the call: ``token_ids`` (``B`` lists of ``T`` ints), ``positions`` (each request's
    ``num_computed_tokens``: the cached length, where the first new token's latent is written),
    ``block_tables`` (covering the new tokens), ``state_slots``; optional ``inputs_embeds`` ``[B, T, D]``
    in place of the token embeddings (a chunk holding an image's placeholder tokens); for a speculative
    draft (:mod:`openk3.serve.speculative`) ``feature_layers``, the target layers whose outputs it reads
    (:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`), and for a verification
    ``all_positions`` (logits of every new token ``[B, T, V]``) and ``steps_out``, a list that receives the
    KDA layers' caches, each keeping its states before and after every token
    (:meth:`~openk3.model.cache.KDAStateSlots.rollback`).
    """

    def __init__(self, lm: nn.Module, storage: CacheStorage) -> None:
        self.lm, self.storage = lm, storage
        self.kinds = lm.config.layer_types
        self.device = lm.model.embed_tokens.weight.device

    @torch.no_grad()
    def __call__(
        self,
        token_ids: list[list[int]],
        positions: list[int],
        block_tables: list[list[int]],
        state_slots: list[tuple[int, ...]],
        inputs_embeds: torch.Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
        all_positions: bool = False,
        steps_out: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        st, bs = self.storage, self.storage.layout.block_size
        T = len(token_ids[0])
        if any(len(t) != T for t in token_ids):
            raise ValueError("every request of one paged forward must bring the same number of tokens")
        caches = self.caches(block_tables, positions, state_slots)
        if steps_out is not None:
            kda = [c for c in caches if isinstance(c, KDAStateSlots)]
            for c in kda:
                c.verify = True
            steps_out.extend(kda)
        ids_BT = to_device(token_ids, self.device)
        h_BTD, f_BTF = self.lm.model.forward_with_features(
            ids_BT,
            feature_layers,
            KimiCache(caches),
            check_inputs=False,
            two_phase_attn_res=True,
            inputs_embeds=inputs_embeds,
        )
        logits_BV = self.lm.lm_head(h_BTD if all_positions else h_BTD[:, -1])
        latents = [c.new for c in caches if isinstance(c, PagedLatents)]
        if latents:
            pages = [t[p // bs] for t, start in zip(block_tables, positions) for p in range(start, start + T)]
            offsets = [p % bs for start in positions for p in range(start, start + T)]
            st.write_latents(pages, offsets, torch.stack(latents).flatten(1, 2))
        return logits_BV, f_BTF

    def caches(
        self, block_tables: list[list[int]], positions: list[int], state_slots: list[tuple[int, ...]]
    ) -> list[KDAStateSlots | PagedLatents]:
        """One paged cache per layer for the requests: their gathered KDA states and padded latents."""
        st = self.storage
        if "kda" in self.kinds:
            states = st.gather_states(state_slots)
            kda = iter(KDAStateSlots(r, c) for r, c in zip(states.recurrent, states.conv))
        if "mla" in self.kinds:
            past_LBSd, mask_BS = st.gather_latents(block_tables, positions)
            full = len(set(positions)) == 1  # no padding: SDPA's lower-right causal bias, no mask tensor
            mla = iter(PagedLatents(past, mask_BS, full) for past in past_LBSd)
        return [next(kda) if kind == "kda" else next(mla) for kind in self.kinds]
