"""Speculative decoding in the engine (``openk3 serve --draft DRAFT``; ``docs/speculative.md``).

:class:`SpeculativeDecoder` sits beside the :class:`~openk3.serve.model_runner.ModelRunner`:

* **Features.** During a runner step (:meth:`capturing`), forward pre-hooks on the target's tapped layers
  collect the draft's input features from every forward the runner makes (packed first chunks, paged chunks, verifications); after each forward the
  runner hands over the chunks it ran (:meth:`forwarded`), and each request's draft cache (an
  :class:`~openk3.model.cache.MLACache` of its own) reads ``(feature_t, token_{t+1})`` for those positions.
  A prefix-cache hit skips the draft's context over the cached part (speed only; the output is unchanged).
* **Decodes.** A running request with a token to decode (and ``k ≥ 1`` for it) is taken out of the normal
  path (:meth:`decode`): its draft proposes a chain of ``k`` tokens, the chains of all such requests with
  the same ``k`` are verified in one :class:`~openk3.serve.decode_forward.PagedForward` call of ``k + 1``
  tokens each (all positions' logits, every KDA state kept), each row is accepted by the rule of
  :mod:`openk3.speculative` with the request's own sampling settings and generator, and its KDA state and
  conv window are set to those after its last kept token. MLA latents written for rejected drafts lie
  beyond ``num_computed_tokens`` and are overwritten before their block is full, so no block the prefix
  cache can hand out ever holds them.

``k`` per request: ``SamplingParams.num_speculative_tokens`` (``None``: the engine's default), capped so
that the chain never runs past ``max_tokens`` (the blocks written stay inside the admission reservation);
``0``, requests that ask for ``logprobs`` and requests with one token left decode as usual.

Legend: ``B`` requests, ``T = k + 1`` verified tokens, ``F`` tapped features, ``L`` KDA layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.cache import MLACache
from openk3.model.draft import EagleDraft, capture_features
from openk3.serve.request import Request
from openk3.speculative import MAX_SPECULATIVE_TOKENS, TokenChooser


@dataclass
class _DraftState:
    cache: MLACache
    g_11D: torch.Tensor | None = None
    """The draft's last output (the next chain step's feature), or ``None`` before its first position."""


class SpeculativeDecoder:
    def __init__(self, lm: nn.Module, draft: EagleDraft, runner, kv, num_speculative_tokens: int) -> None:
        if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens}"
            )
        self.lm, self.draft, self.runner, self.kv = lm, draft.eval(), runner, kv
        self.k = num_speculative_tokens
        self.states: dict[str, _DraftState] = {}
        self.num_drafted = 0
        """Drafted tokens verified so far (with :attr:`num_accepted`: the acceptance rate)."""
        self.num_accepted = 0
        self._taps: list[torch.Tensor] = []

    @contextlib.contextmanager
    def capturing(self):
        """Collect the tapped target features of the forwards inside the block (one runner step)."""
        self._taps.clear()
        with capture_features(self.lm, self.draft.draft_config.feature_layers) as taps:
            self._taps = taps
            yield

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # ---- draft context -----------------------------------------------------------------------------------
    def _state(self, request: Request) -> _DraftState:
        return self.states.setdefault(request.request_id, _DraftState(self.draft.new_cache()))

    def _feed(self, request: Request, taps_TF: torch.Tensor, next_ids: list[int]) -> None:
        """The draft reads features ``[T, F]`` with the tokens after them."""
        st = self._state(request)
        ids = torch.tensor([next_ids], device=taps_TF.device)
        g, _ = self.draft(self.draft.fuse(taps_TF[None]), ids, self.lm.model.embed_tokens, cache=st.cache)
        st.g_11D = g[:, -1:]

    def forwarded(self, chunks, sampled: dict) -> None:
        """The runner ran ``chunks`` in one forward (packed first chunks or one paged batch) and sampled."""
        taps = self._taps.pop(0)  # [B, T, F] of a paged batch, or [1, ΣT, F] of a packed row
        rows = list(taps) if taps.shape[0] == len(chunks) else taps[0].split([c.num_tokens for c in chunks])
        for c, taps_TF in zip(chunks, rows):
            r = c.request
            nxt = r.token_ids_between(c.start + 1, c.start + c.num_tokens + 1)
            if len(nxt) < c.num_tokens:  # the chunk's last position predicts the token just sampled
                nxt = nxt + [sampled[r.request_id]]
            self._feed(r, taps_TF, nxt)

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
        return max(0, min(k, sp.max_tokens - len(r.output_token_ids) - 1))

    def decode(self, chunks, sampled: dict) -> list:
        """Run the speculative decodes of ``chunks`` (``sampled[id]`` = the list of emitted tokens); return the
        chunks left for the normal path."""
        groups: dict[int, list] = {}
        rest = []
        for c in chunks:
            k = self._k_for(c)
            (groups.setdefault(k, []) if k else rest).append(c)
        for k, group in groups.items():
            self._verify(group, k, sampled)
        return rest

    def _chains(self, chunks, k: int, choosers) -> list[tuple[list[int], list]]:
        """Draft ``k`` tokens for every request of ``chunks`` at once: each chain step is one draft forward over
        all of them, attending to each request's own cache (padded, with a key mask) plus its chain so far.
        Returns per request ``(drafts, q rows)``; the requests' caches are left unchanged."""
        states = [self.states[c.request.request_id] for c in chunks]
        B, dev = len(chunks), states[0].g_11D.device
        lengths = [st.cache.latent.shape[1] for st in states]
        S = max(lengths)
        lat = states[0].cache.latent.new_zeros(B, S, states[0].cache.latent.shape[-1])
        kpe = states[0].cache.k_pe.new_zeros(B, S, states[0].cache.k_pe.shape[-1])
        for b, st in enumerate(states):
            lat[b, : lengths[b]], kpe[b, : lengths[b]] = st.cache.latent[0], st.cache.k_pe[0]
        keys_BS = torch.arange(S, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]
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
            choosers.append(TokenChooser(sp.temperature, sp.top_p, vocab, c.request.generator))
            self.kv.allocate_slots(c.request, k + 1)
        rows = self._chains(chunks, k, choosers)
        steps: list = []
        logits_BTV = self.runner.paged_forward(
            [[*c.token_ids, *drafts] for c, (drafts, _) in zip(chunks, rows)],
            [c.start for c in chunks],
            [c.block_table for c in chunks],
            [c.state_slot for c in chunks],
            all_positions=True,
            steps_out=steps,
        )
        taps_BTF = self._taps.pop(0)
        kept = []
        for b, (c, (drafts, qs), choose) in enumerate(zip(chunks, rows, choosers)):
            n, nxt = choose.verify(logits_BTV[b], drafts, qs)
            kept.append(n + 1)
            self.num_drafted += k
            self.num_accepted += n
            tokens = [*drafts[:n], nxt]
            sampled[c.request.request_id] = tokens
            self._feed(c.request, taps_BTF[b, : n + 1], tokens)
        if steps:
            self._roll_back(chunks, steps, kept)

    def _roll_back(self, chunks, caches, kept: list[int]) -> None:
        """Set each row's KDA state and conv window to those after its ``kept`` verified tokens."""
        states = self.runner.storage.gather_states([c.state_slot for c in chunks])  # the resident batch
        dev = states.recurrent.device
        n_B = torch.tensor(kept, device=dev)
        b_B = torch.arange(len(chunks), device=dev)
        W1 = states.conv.shape[-1]
        win_BW = n_B[:, None] + torch.arange(W1, device=dev)
        for i, c in enumerate(caches):
            rec_TBHKV = torch.stack(c.steps.recurrent)
            states.recurrent[i].copy_(rec_TBHKV[n_B, b_B])
            for j, x_BPS in enumerate(c.steps.conv_inputs):
                idx = win_BW[:, None, :].expand(-1, x_BPS.shape[1], -1)
                states.conv[i, :, j].copy_(x_BPS.gather(2, idx))
