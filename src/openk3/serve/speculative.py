"""Speculative decoding in the engine (``openk3 serve --draft DRAFT``; ``docs/speculative.md``).

:class:`SpeculativeDecoder` sits beside the :class:`~openk3.serve.model_runner.ModelRunner`:

* **Features.** Every forward the runner makes (packed first chunks, paged chunks, verifications) asks the
  model for the draft's input features (:attr:`SpeculativeDecoder.feature_layers`, through
  :meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`); after each forward the runner
  hands over the chunks it ran with their features (:meth:`forwarded`), and each request's draft cache (an
  :class:`~openk3.model.cache.MLACache` of its own) reads ``(feature_t, token_{t+1})`` for those positions.
  A prefix-cache hit skips the draft's context over the cached part (speed only; the output is unchanged).
* **Decodes.** A running request with a token to decode (and ``k ≥ 1`` for it) is taken out of the normal
  path (:meth:`decode`) before the step's other chunks run. Greedy requests of one ``k`` run as one static
  step of :mod:`openk3.serve.speculative_graph` when the engine has one (on CUDA by default: draft chain,
  verification, acceptance, rollback and draft update in one CUDA-graph replay). Otherwise (sampled
  requests, or no static step) the draft proposes a chain of ``k`` tokens, the chains of all such requests
  with the same ``k`` are verified in one :class:`~openk3.serve.decode_forward.PagedForward` call of
  ``k + 1`` tokens each (all positions' logits; each KDA layer keeps the state after every token on the
  requests' :class:`~openk3.model.cache.KDAStateSlots`), each row is accepted by the rule of
  :mod:`openk3.speculative` with the request's own sampling settings and generator, and its KDA state and
  conv window are set to those after its last kept token (:meth:`~openk3.model.cache.KDAStateSlots.rollback`,
  in place). The engine's plain decode graphs are not built with a draft (their step returns no
  features, and the draft reads every forward's). MLA latents written for rejected drafts lie
  beyond ``num_computed_tokens`` and are overwritten before their block is full, so no block the prefix
  cache can hand out ever holds them.

``k`` per request: ``SamplingParams.num_speculative_tokens`` (``None``: the engine's default). The chain
may run past ``max_tokens``: admission reserves the engine's default ``k`` positions beyond it
(:class:`~openk3.serve.kv_manager.KVCacheManager`'s ``lookahead_tokens``) and the scheduler drops the
emitted tokens past the end, so every greedy decode of the default ``k`` joins the step's one static run up
to its last token (a chain cut at the end would split the step into one run per ``k``, and the last token
would take the paged forward); only a request's own larger ``k`` is cut to the reservation. ``0`` and
requests that ask for ``logprobs`` decode as usual.

Legend: ``B`` requests, ``T = k + 1`` verified tokens, ``F`` tapped features, ``L`` KDA layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.cache import MLACache
from openk3.model.draft import EagleDraft
from openk3.serve.model_runner import request_generator
from openk3.serve.request import Request
from openk3.serve.speculative_graph import SpeculativeGraphs
from openk3.speculative import MAX_SPECULATIVE_TOKENS, TokenChooser


@dataclass
class _DraftState:
    cache: MLACache
    g_11D: torch.Tensor | None = None
    """The draft's last output (the next chain step's feature), or ``None`` before its first position."""


class SpeculativeDecoder:
    def __init__(
        self,
        lm: nn.Module,
        draft: EagleDraft,
        runner,
        kv,
        num_speculative_tokens: int,
        graphs: SpeculativeGraphs | None = None,
    ) -> None:
        """``graphs``: the static greedy step (``None``: every verification on the paged forward)."""
        if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens}"
            )
        self.lm, self.draft, self.runner, self.kv = lm, draft.eval(), runner, kv
        self.k, self.graphs = num_speculative_tokens, graphs
        self.states: dict[str, _DraftState] = {}
        self.num_drafted = 0
        """Drafted tokens verified so far (with :attr:`num_accepted`: the acceptance rate)."""
        self.num_accepted = 0
        self.num_verified = 0
        """Rows verified so far, one per request per speculative step (each emits ``1 +`` its accepted
        drafts)."""
        self.feature_layers = draft.draft_config.feature_layers
        """The target layers whose outputs every forward of the runner returns for the draft."""

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # ---- draft context -----------------------------------------------------------------------------------
    def _state(self, request: Request) -> _DraftState:
        return self.states.setdefault(request.request_id, _DraftState(self.draft.new_cache()))

    def _padded_caches(self, states: list[_DraftState], device):
        """The draft caches of ``states`` padded to the longest: ``(latent [B, S, C], k_pe [B, S, r], keys
        [B, S] bool)``."""
        attn = self.draft.layer.self_attn
        lengths = [0 if st.cache.latent is None else st.cache.latent.shape[1] for st in states]
        B, S = len(states), max(lengths)
        weight = self.draft.layer.fc.weight
        lat = weight.new_zeros(B, S, attn.kv_lora_rank)
        kpe = weight.new_zeros(B, S, attn.rope)
        for b, st in enumerate(states):
            if lengths[b]:
                lat[b, : lengths[b]], kpe[b, : lengths[b]] = st.cache.latent[0], st.cache.k_pe[0]
        keys_BS = torch.arange(S, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        return lat, kpe, keys_BS

    def _feed(self, requests: list[Request], taps: list[torch.Tensor], next_ids: list[list[int]]) -> None:
        """Each request's draft reads its features ``[T_b, F]`` with the tokens after them, all in one draft
        forward (rows padded to the longest; padding comes last, so causality hides it)."""
        states = [self._state(r) for r in requests]
        dev = taps[0].device
        lat, kpe, keys_BS = self._padded_caches(states, dev)
        B, T = len(requests), max(len(i) for i in next_ids)
        taps_BTF = taps[0].new_zeros(B, T, taps[0].shape[-1])
        ids_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, (t, i) in enumerate(zip(taps, next_ids)):
            taps_BTF[b, : len(i)] = t
            ids_BT[b, : len(i)] = torch.tensor(i, device=dev)
        causal_TT = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([keys_BS[:, None, :].expand(B, T, -1), causal_TT.expand(B, T, T)], -1)
        g_BTD, (c_BTC, k_pe_BTr) = self.draft(
            self.draft.fuse(taps_BTF),
            ids_BT,
            self.lm.model.embed_tokens,
            mask_TS=mask[:, None],
            past=(lat, kpe),
        )
        for b, (st, i) in enumerate(zip(states, next_ids)):
            st.cache.append(c_BTC[b : b + 1, : len(i)], k_pe_BTr[b : b + 1, : len(i)])
            st.g_11D = g_BTD[b : b + 1, len(i) - 1 : len(i)]

    def forwarded(self, chunks, taps: torch.Tensor, sampled: dict) -> None:
        """The runner ran ``chunks`` in one forward (packed first chunks or one paged batch) and sampled;
        ``taps`` are that forward's features: ``[B, T, F]`` of a paged batch, or ``[1, ΣT, F]`` of a packed
        row."""
        rows = list(taps) if taps.shape[0] == len(chunks) else taps[0].split([c.num_tokens for c in chunks])
        next_ids = []
        for c in chunks:
            nxt = c.request.token_ids_between(c.start + 1, c.start + c.num_tokens + 1)
            if len(nxt) < c.num_tokens:  # the chunk's last position predicts the token just sampled
                nxt = nxt + [sampled[c.request.request_id]]
            next_ids.append(nxt)
        self._feed([c.request for c in chunks], list(rows), next_ids)

    # ---- decodes -----------------------------------------------------------------------------------------
    def _k_for(self, chunk) -> int:
        r = chunk.request
        sp = r.sampling_params
        if chunk.num_tokens != 1 or r.num_computed_tokens < r.num_prompt_tokens or sp.logprobs is not None:
            return 0
        st = self.states.get(r.request_id)
        if st is None or st.g_11D is None:
            return 0
        k = self.k if sp.num_speculative_tokens is None else sp.num_speculative_tokens
        left = sp.max_tokens - len(r.output_token_ids)  # ≥ 1: the chain writes positions up to left - 1 + k
        return min(k, left - 1 + self.kv.lookahead_tokens)

    def decode(self, chunks, sampled: dict) -> list:
        """Run the speculative decodes of ``chunks`` (``sampled[id]`` = the list of emitted tokens); return the
        chunks left for the normal path."""
        groups: dict[int, list] = {}
        rest = []
        for c in chunks:
            k = self._k_for(c)
            (groups.setdefault(k, []) if k else rest).append(c)
        for k, group in groups.items():
            if self.graphs is not None:
                greedy = [c for c in group if c.request.sampling_params.temperature == 0]
                if greedy and self.graphs.supports_speculative(greedy, k):
                    self._verify_static(greedy, k, sampled)
                    group = [c for c in group if c.request.sampling_params.temperature != 0]
            if group:
                self._verify(group, k, sampled)
        return rest

    def _verify_static(self, chunks, k: int, sampled: dict) -> None:
        """Greedy decodes through the static step (:mod:`openk3.serve.speculative_graph`)."""
        for c in chunks:
            self.kv.allocate_slots(c.request, k + 1)
        states = [self.states[c.request.request_id] for c in chunks]
        for c, emitted in zip(chunks, self.graphs.run_speculative(chunks, k, states)):
            self.num_drafted += k
            self.num_accepted += len(emitted) - 1
            self.num_verified += 1
            sampled[c.request.request_id] = emitted

    def _chains(self, chunks, k: int, choosers) -> list[tuple[list[int], list]]:
        """Draft ``k`` tokens for every request of ``chunks`` at once: each chain step is one draft forward over
        all of them, attending to each request's own cache (padded, with a key mask) plus its chain so far.
        Returns per request ``(drafts, q rows)``; the requests' caches are left unchanged."""
        states = [self.states[c.request.request_id] for c in chunks]
        B, dev = len(chunks), states[0].g_11D.device
        lat, kpe, keys_BS = self._padded_caches(states, dev)
        g_B1D = torch.cat([st.g_11D for st in states])
        chains: list[tuple[list[int], list]] = [([], []) for _ in chunks]
        for j in range(k):
            if j:
                ids_B1 = torch.tensor([[d[-1]] for d, _ in chains], device=dev)
                keys_BS = torch.cat([keys_BS, keys_BS.new_ones(B, 1)], 1)
                g_B1D, new = self.draft(
                    g_B1D,
                    ids_B1,
                    self.lm.model.embed_tokens,
                    mask_TS=keys_BS[:, None, None, :],
                    past=(lat, kpe),
                )
                lat, kpe = torch.cat([lat, new[0]], 1), torch.cat([kpe, new[1]], 1)
            logits_BV = self.draft.logits(g_B1D, self.lm.lm_head)[:, -1]
            greedy = logits_BV[:, : self.runner.sample_vocab_size].argmax(-1).tolist()
            for b, (choose, (drafts, qs)) in enumerate(zip(choosers, chains)):
                d, q = (greedy[b], None) if choose.temperature == 0 else choose.draft(logits_BV[b : b + 1])
                drafts.append(d)
                qs.append(q)
        return chains

    def _verify(self, chunks, k: int, sampled: dict) -> None:
        vocab = self.runner.sample_vocab_size
        choosers = []
        for c in chunks:
            sp = c.request.sampling_params
            # a seeded draw needs a generator on the model's device
            generator = request_generator(c.request, self.runner.device)
            choosers.append(TokenChooser(sp.temperature, sp.top_p, vocab, generator))
            self.kv.allocate_slots(c.request, k + 1)
        rows = self._chains(chunks, k, choosers)
        steps: list = []
        logits_BTV, taps_BTF = self.runner.paged_forward(
            [[*c.token_ids, *drafts] for c, (drafts, _) in zip(chunks, rows)],
            [c.start for c in chunks],
            [c.block_table for c in chunks],
            [c.state_slot for c in chunks],
            feature_layers=self.feature_layers,
            all_positions=True,
            steps_out=steps,
        )
        kept, emitted = [], []
        for b, (c, (drafts, qs), choose) in enumerate(zip(chunks, rows, choosers)):
            n, nxt = choose.verify(logits_BTV[b], drafts, qs)
            kept.append(n + 1)
            self.num_drafted += k
            self.num_accepted += n
            self.num_verified += 1
            emitted.append([*drafts[:n], nxt])
            sampled[c.request.request_id] = emitted[-1]
        self._feed([c.request for c in chunks], [taps_BTF[b, :n] for b, n in enumerate(kept)], emitted)
        for slots in steps:  # each row's KDA state and conv window after its last kept token
            slots.rollback(kept)
