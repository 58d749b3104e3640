"""The model runner: executes a scheduled step over the paged cache and samples.

* Chunks run through :class:`~openk3.serve.decode_forward.PagedForward`, one batch per chunk length: all
  one-token decodes together, and prefill chunks of equal length together (first chunks, chunks that
  continue a prefix hit or an earlier chunk).
* Chunks of up to 16 tokens (decodes, a prefix hit's suffix) that sample greedily, if at all, run through
  :class:`~openk3.serve.decode_graph.DecodeGraphs` when the engine has one (CUDA graphs on CUDA): static
  shapes, the argmax on the device.
* A first chunk (nothing cached: ``start == 0``) whose length no other chunk of the step shares runs
  through the model's own forward (the reference path) instead, packed into one row with ``cu_seqlens``
  together with the other such chunks; latents and final KDA states are written to blocks and slots.

A chunk holding media placeholder tokens of a request with images (``request.media``) runs on the token
embeddings with the images' embeddings placed at those tokens (:meth:`ModelRunner.chunk_embeds`); the
images are encoded once per request, at its first such chunk.

With a draft (:mod:`openk3.serve.speculative`), the speculative decodes of a step are taken out first and
verified (greedy ones through the static step of :mod:`openk3.serve.speculative_graph` when the engine has
one, the others through the paged forward); the other chunks run as above, on the paged forward and the
packed forward, each of which returns the draft's features with its logits.

Sampling reuses :func:`openk3.generate.sample_next` per request (temperature 0 = argmax; ``seed`` gives the
request its own generator, on the model's device); a batch's tokens, greedy or drawn, come back in one
device→host copy.

Legend: ``B`` requests, ``N`` packed requests, ``T`` chunk tokens, ``V`` vocabulary, ``F`` a draft's tapped
features.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from openk3.generate import sample_next
from openk3.model.cache import KDACache, KimiCache, MLACache
from openk3.serve.cache_storage import CacheStorage
from openk3.serve.decode_forward import PagedForward
from openk3.serve.decode_graph import DecodeGraphs
from openk3.serve.request import Request, TokenLogprobs
from openk3.serve.scheduler import ScheduledChunk, SchedulerOutput
from openk3.serve.transfer import to_device


def language_model(model: nn.Module) -> nn.Module:
    """The causal LM inside a K3 wrapper (``language_model``), or the model itself."""
    return getattr(model, "language_model", model)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        storage: CacheStorage,
        sample_vocab_size: int | None = None,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        """``sample_vocab_size``: sample only ids below it (the tokenizer's id space when it is smaller than
        the model's vocabulary; ``None``: every id). ``decode_graphs``: the static step for short greedy
        chunks (``None``: they take the paged forward)."""
        self.lm = language_model(model)
        self.model = model
        self.storage = storage
        self.sample_vocab_size = sample_vocab_size
        self.kinds = self.lm.config.layer_types
        self.device = self.lm.model.embed_tokens.weight.device
        self.paged_forward = PagedForward(self.lm, storage)
        self.decode_graphs = decode_graphs
        self.speculative = None
        """A :class:`~openk3.serve.speculative.SpeculativeDecoder` when the engine has a draft (the runner
        then has no plain decode graphs: the draft reads every forward's features)."""

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run every chunk of the step; return request id → sampled token for chunks that sample (a list of
        tokens for a speculative decode). See :meth:`_execute`."""
        sampled: dict[str, int] = {}  # a list of tokens for a speculative decode
        spec = self.speculative
        chunks = out.chunks if spec is None else spec.decode(out.chunks, sampled)
        return self._execute(chunks, sampled)

    def _execute(self, chunks: list[ScheduledChunk], sampled: dict[str, int]) -> dict[str, int]:
        """Run ``chunks``; add request id → sampled token to ``sampled`` for chunks that sample and return it.

        Chunks of equal length run as one :class:`PagedForward` batch; first chunks (``start == 0``) whose
        length no other chunk shares are packed into one reference forward instead. With a draft, each forward
        also returns the draft's features, which the draft then reads
        (:meth:`~openk3.serve.speculative.SpeculativeDecoder.forwarded`)."""
        spec = self.speculative
        taps_at = () if spec is None else spec.feature_layers
        by_length: dict[int, list[ScheduledChunk]] = {}
        for chunk in chunks:
            by_length.setdefault(chunk.num_tokens, []).append(chunk)
        fresh = [g[0] for g in by_length.values() if len(g) == 1 and g[0].start == 0]
        if fresh:
            logits_NV, taps_1TF = self.prefill_packed(fresh, taps_at)
            self._sample(fresh, logits_NV, sampled)
            if spec is not None:
                spec.forwarded(fresh, taps_1TF, sampled)
        for chunks in by_length.values():
            if len(chunks) == 1 and chunks[0].start == 0:
                continue
            embeds = self.chunk_embeds(chunks)  # None unless a chunk holds an image's placeholders
            if embeds is None and self.decode_graphs is not None and self.decode_graphs.supports(chunks):
                tokens = self.decode_graphs.run(chunks)
                sampled.update({c.request.request_id: t for c, t in zip(chunks, tokens) if c.samples})
                continue
            logits_BV, taps_BTF = self.paged_forward(
                [c.token_ids for c in chunks],
                [c.start for c in chunks],
                [c.block_table for c in chunks],
                [c.state_slot for c in chunks],
                embeds,
                taps_at,
            )
            self._sample(chunks, logits_BV, sampled)
            if spec is not None:
                spec.forwarded(chunks, taps_BTF, sampled)
        return sampled

    def _sample(self, chunks: list[ScheduledChunk], logits_BV: torch.Tensor, sampled: dict[str, int]) -> None:
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if not rows:  # a prefill chunk before the prompt's end: nothing to read
            return
        if len(rows) < len(chunks):
            logits_BV = logits_BV.index_select(0, to_device(rows, logits_BV.device))
        if self.sample_vocab_size is not None:
            logits_BV = logits_BV[:, : self.sample_vocab_size]
        requests = [chunks[i].request for i in rows]
        tokens = sample_tokens(requests, logits_BV)
        sampled.update({r.request_id: t for r, t in zip(requests, tokens)})
        record_logprobs(requests, logits_BV, tokens)

    def prefill_packed(
        self, chunks: list[ScheduledChunk], feature_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """First chunks (nothing cached yet) of ``N`` requests packed into one forward with ``cu_seqlens``
        (documents never see each other); returns each one's last-position logits ``[N, V]`` and the
        draft's features of ``feature_layers`` at every packed position ``[1, ΣT, F]`` (``None`` for none)."""
        st, bs = self.storage, self.storage.layout.block_size
        lengths = [c.num_tokens for c in chunks]
        cu_seqlens = to_device([0, *itertools.accumulate(lengths)], self.device)
        layers = [KDACache() if kind == "kda" else MLACache() for kind in self.kinds]
        ids = to_device([[t for c in chunks for t in c.token_ids]], self.device)
        embeds = self.chunk_embeds(chunks)
        embeds = None if embeds is None else embeds.reshape(1, -1, embeds.shape[-1])
        # ids were checked when the requests were added; one document needs no cu_seqlens (plain causal)
        packed = cu_seqlens if len(chunks) > 1 else None
        h_BTD, f_1TF = self.lm.model.forward_with_features(
            ids, feature_layers, KimiCache(layers), packed, check_inputs=False, inputs_embeds=embeds
        )
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
        return logits_NV, f_1TF

    def chunk_embeds(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Token embeddings ``[B, T, D]`` of the chunks with their requests' images placed at the media
        placeholder tokens of the prompt (in reading order); ``None`` when no chunk holds one. A generated
        token equal to the placeholder id stays a token."""
        placeholder = getattr(self.model.config, "media_placeholder_token_id", None)
        slots = [self._media_slots(c, placeholder) for c in chunks]
        if not any(slots):
            return None
        embed = self.lm.model.embed_tokens
        rows = []
        for c, slot in zip(chunks, slots):
            row_TD = embed(to_device(c.token_ids, self.device))
            r = c.request
            if slot:
                if r.media_embeds is None:
                    pixels = r.media.pixel_values.to(self.device)
                    r.media_embeds = self.model.embed_media(pixels, r.media.grid_thws)
                before = r.prompt_token_ids[: c.start].count(placeholder)
                mask_T = torch.zeros(c.num_tokens, dtype=torch.bool)
                mask_T[slot] = True
                taken = r.media_embeds[before : before + len(slot)]
                row_TD = row_TD.masked_scatter(
                    mask_T.to(self.device, non_blocking=True)[:, None], taken.to(row_TD.dtype)
                )
                if c.start + c.num_tokens >= r.num_prompt_tokens:
                    r.media_embeds = None  # the prompt is computed: its images are in the cache now
            rows.append(row_TD)
        return torch.stack(rows)

    @staticmethod
    def _media_slots(chunk: ScheduledChunk, placeholder: int | None) -> list[int]:
        """Offsets in ``chunk`` of its request's prompt placeholder tokens (none without media)."""
        r = chunk.request
        if r.media is None:
            return []
        prompt_part = r.prompt_token_ids[chunk.start : chunk.start + chunk.num_tokens]
        return [j for j, t in enumerate(prompt_part) if t == placeholder]


def sample_tokens(requests: list[Request], logits_BV: torch.Tensor) -> list[int]:
    """One token per row with each request's sampling parameters, read back in one device→host copy (the
    batch's one host wait): greedy rows take the row's argmax, the others a draw on the device
    (:func:`~openk3.generate.sample_next` with the request's generator, in row order)."""
    if not requests:
        return []
    tokens_B = logits_BV.argmax(-1)
    for i, request in enumerate(requests):
        sp = request.sampling_params
        if sp.temperature != 0:
            generator = request_generator(request, logits_BV.device)
            tokens_B[i : i + 1] = sample_next(logits_BV[i : i + 1], sp.temperature, sp.top_p, generator)[:, 0]
    return tokens_B.tolist()


def request_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """The request's seeded generator on ``device`` (``None`` without a seed: the default generator).

    A request builds its generator on the CPU; a draw on a GPU needs one of that GPU, so the first draw there
    replaces it with one seeded the same way (its stream of numbers is the GPU's, not the CPU's)."""
    generator = request.generator
    if generator is not None and generator.device != device:
        generator = request.generator = torch.Generator(device).manual_seed(request.sampling_params.seed)
    return generator


def record_logprobs(requests: list[Request], logits_BV: torch.Tensor, tokens: list[int]) -> None:
    """Set ``sampled_logprobs`` of each request that asked for ``logprobs``: ``log_softmax`` (fp32) of its
    row of raw logits at the sampled token, and its ``logprobs`` most likely tokens."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return
    logp_BV = torch.log_softmax(logits_BV.index_select(0, to_device(rows, logits_BV.device)).float(), dim=-1)
    k = max(requests[i].sampling_params.logprobs for i in rows)
    top_val_BK, top_id_BK = logp_BV.topk(k, dim=-1) if k else (logp_BV[:, :0], logp_BV[:, :0].long())
    chosen = logp_BV.gather(1, to_device([[tokens[i]] for i in rows], logp_BV.device))[:, 0]
    chosen, top_val_BK, top_id_BK = chosen.tolist(), top_val_BK.tolist(), top_id_BK.tolist()
    for b, i in enumerate(rows):
        n = requests[i].sampling_params.logprobs
        top = tuple(zip(top_id_BK[b][:n], top_val_BK[b][:n]))
        requests[i].sampled_logprobs = TokenLogprobs(tokens[i], chosen[b], top)
