"""The model runner: executes a scheduled step over the paged cache and samples.

* Prefill chunks (more than one token) run through the model's own forward (the reference path): the
  first chunks of several new requests packed into one row with ``cu_seqlens``; a chunk that continues a
  cached prefix (a prefix hit or an earlier chunk) one request at a time, from the slot's KDA state and
  the gathered past latents. New latents and final KDA states are written back to blocks and slots.
* One-token chunks (decodes) of all requests run as one batch through
  :class:`~openk3.serve.decode_forward.PagedDecodeForward`.

Sampling reuses :func:`openk3.generate.sample_next` per request (temperature 0 = argmax; ``seed`` gives the
request its own generator).

Legend: ``B`` requests, ``T`` chunk tokens, ``V`` vocabulary, ``C`` kv_lora_rank, ``L`` MLA layers.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from openk3.generate import sample_next
from openk3.model.cache import KDACache, KimiCache, MLACache
from openk3.serve.cache_storage import CacheStorage
from openk3.serve.decode_forward import PagedDecodeForward
from openk3.serve.request import Request
from openk3.serve.scheduler import ScheduledChunk, SchedulerOutput


def language_model(model: nn.Module) -> nn.Module:
    """The causal LM inside a K3 wrapper (``language_model``), or the model itself."""
    return getattr(model, "language_model", model)


class ModelRunner:
    def __init__(self, model: nn.Module, storage: CacheStorage) -> None:
        self.lm = language_model(model)
        self.storage = storage
        self.kinds = self.lm.config.layer_types
        self.device = self.lm.model.embed_tokens.weight.device
        self.decode_forward = PagedDecodeForward(self.lm, storage)

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run every chunk of the step; return request id → sampled token for chunks that sample."""
        sampled: dict[str, int] = {}
        decodes = [c for c in out.chunks if c.num_tokens == 1]
        fresh = [c for c in out.chunks if c.num_tokens > 1 and c.start == 0]
        if len(fresh) > 1:
            logits_NV = self.prefill_packed(fresh)
            rows = [i for i, c in enumerate(fresh) if c.samples]
            tokens = sample_tokens([fresh[i].request for i in rows], logits_NV[rows])
            sampled.update({fresh[i].request.request_id: t for i, t in zip(rows, tokens)})
        for chunk in out.chunks:
            if chunk.num_tokens > 1 and not (len(fresh) > 1 and chunk.start == 0):
                logits_V = self.prefill(chunk)
                if chunk.samples:
                    sampled[chunk.request.request_id] = sample_tokens([chunk.request], logits_V[None])[0]
        if decodes:
            logits_BV = self.decode_forward(
                [c.token_ids[0] for c in decodes],
                [c.start for c in decodes],
                [c.block_table for c in decodes],
                [c.state_slot for c in decodes],
            )
            rows = [i for i, c in enumerate(decodes) if c.samples]
            tokens = sample_tokens([decodes[i].request for i in rows], logits_BV[rows])
            sampled.update({decodes[i].request.request_id: t for i, t in zip(rows, tokens)})
        return sampled

    def prefill(self, chunk: ScheduledChunk) -> torch.Tensor:
        """One request's chunk through the model forward; returns the last position's logits ``[V]``."""
        st, bs = self.storage, self.storage.layout.block_size
        past, T = chunk.start, chunk.num_tokens
        kda = st.read_states([chunk.state_slot]) if "kda" in self.kinds else []
        if past and "mla" in self.kinds:
            lat_LBSd, _ = st.gather_latents([chunk.block_table], [past])
        C = self.lm.config.kv_lora_rank
        layers, mla = [], []
        for kind in self.kinds:
            if kind == "kda":
                layers.append(kda[len(layers) - len(mla)])
            else:
                j = len(mla)
                mla.append(MLACache(lat_LBSd[j, :, :, :C], lat_LBSd[j, :, :, C:]) if past else MLACache())
                layers.append(mla[-1])
        cache = KimiCache(layers, seq_len=past)
        ids = torch.tensor([chunk.token_ids], device=self.device)
        h_BTD = self.lm.model(ids, cache)
        logits_V = self.lm.lm_head(h_BTD[0, -1])
        if kda:
            st.write_states([chunk.state_slot], kda)
        if mla:
            new_LTd = torch.stack([torch.cat([c.latent[0, past:], c.k_pe[0, past:]], -1) for c in mla])
            positions = range(past, past + T)
            st.write_latents(
                [chunk.block_table[p // bs] for p in positions], [p % bs for p in positions], new_LTd
            )
        return logits_V

    def prefill_packed(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """First chunks (nothing cached yet) of ``N`` requests packed into one forward with ``cu_seqlens``
        (documents never see each other); returns each one's last-position logits ``[N, V]``."""
        st, bs = self.storage, self.storage.layout.block_size
        lengths = [c.num_tokens for c in chunks]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64, device=self.device)
        layers = [KDACache() if kind == "kda" else MLACache() for kind in self.kinds]
        ids = torch.tensor([[t for c in chunks for t in c.token_ids]], device=self.device)
        h_BTD = self.lm.model(ids, KimiCache(layers), cu_seqlens)
        logits_NV = self.lm.lm_head(h_BTD[0, cu_seqlens[1:] - 1])
        kda = [c for c in layers if isinstance(c, KDACache)]
        if kda:
            st.write_states([c.state_slot for c in chunks], kda)
        mla = [c for c in layers if isinstance(c, MLACache)]
        if mla:
            new_LTd = torch.stack([torch.cat([c.latent[0], c.k_pe[0]], -1) for c in mla])
            pages = [c.block_table[p // bs] for c in chunks for p in range(c.num_tokens)]
            offsets = [p % bs for c in chunks for p in range(c.num_tokens)]
            st.write_latents(pages, offsets, new_LTd)
        return logits_NV


def sample_tokens(requests: list[Request], logits_BV: torch.Tensor) -> list[int]:
    """One token per row with each request's sampling parameters (no host sync for greedy rows until the
    final ``tolist``)."""
    if not requests:
        return []
    greedy = logits_BV.argmax(-1).tolist()
    out = []
    for i, request in enumerate(requests):
        sp = request.sampling_params
        if sp.temperature == 0:
            out.append(greedy[i])
        else:
            out.append(
                int(sample_next(logits_BV[i : i + 1], sp.temperature, sp.top_p, request.generator)[0, 0])
            )
    return out
