"""The greedy speculative step at static shapes, captured in CUDA graphs (``docs/speculative.md``): the draft
chain, the target's verification of ``k + 1`` tokens, the acceptance, the rollback and the draft's update
run as one graph replay per step, and the host reads back one small tensor.

:class:`StaticSpeculative` extends the static decode step of :mod:`openk3.serve.decode_graph` (the same
fixed buffers of token ids, cached lengths, block tables and valid flags, the same paged caches built on the
device, the same padding rows) for ``B`` rows of one ``k``:

1. **Draft chain.** The draft starts from each row's last output (:attr:`~StaticSpeculative.g_BD`) and its
   cached latents, copied before the step into :attr:`~StaticSpeculative.past_BSW` (``S = N·bs`` positions,
   the first :attr:`~StaticSpeculative.draft_len_B` real) unless the buffers hold them already (below);
   step ``j`` takes the argmax of its logits as ``d_{j+1}`` and, for ``j ≥ 1``, runs the draft layer on
   ``d_j`` over the past and the chain so far.
2. **Verification.** The drafts are written after the last emitted token ``y`` into the ids buffer and the
   target runs once over ``[y, d_1 … d_k]`` on the paged caches, every KDA layer keeping the state after
   each token (:class:`~openk3.model.cache.KDAStateSlots` with ``verify``); the forward also returns the
   draft's features ``[B, k + 1, F]`` (:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`,
   as on every path).
3. **Acceptance on the device.** ``a_j`` = the target's argmax at position ``j``; ``n`` = the length of the
   prefix where ``d_{j+1} = a_j``; the emitted tokens are ``d_1 … d_n, a_n`` (the target's greedy tokens).
4. **Rollback on the device.** Each KDA state and conv window is set to the one after token ``n`` of the
   chunk (``n + 1`` tokens kept, no recompute); the ``k + 1`` latents go to the blocks (written last, after
   step 5, which reads no block): those past the kept ones lie beyond ``num_computed_tokens`` and are
   overwritten before their block is full.
5. **Draft update.** The draft reads the features of positions ``0 … k`` with the emitted tokens after them
   (``d_{j+1}`` for ``j < n``, ``a_n`` at ``n``; later positions are computed and dropped: causal attention
   keeps them out of the kept ones), its output at ``n`` goes to :attr:`~StaticSpeculative.g_BD` and its
   new latents to :attr:`~StaticSpeculative.new_BTW` and into the draft cache buffer after each row's cache.

Steps 1–5 are :meth:`StaticSpeculative.sample`, which returns the verified latents' rows; the step is then
:meth:`~openk3.serve.decode_graph.StaticDecode.forward`'s: ``sample``, then the one write into the pool
(``store_latents``). On CUDA it is compiled and captured as the plain step is: ``sample`` through
``torch.compile`` (one graph per ``(B, k + 1)``: the block tables' width and the draft cache's length ``S``
symbolic, so the steps of every ``N`` share it), the pool write eager in the same CUDA graph. The compiled
part writes the KDA states and conv windows, the ids buffer (a view of the small packed inputs) and the
step's draft and output buffers, and only reads the pool.

The host then reads :attr:`~StaticSpeculative.out_BT1` (``n`` and the emitted tokens of every real row: the
step's one device→host copy) and appends the first ``n + 1`` new latents to each request's draft cache. A
request that stays in its row from one run of a step to the next finds its draft cache and last output in
the buffers already (the step wrote them); any other row is copied in before the run.
Sampled requests (temperature > 0) verify on the eager path of :mod:`openk3.serve.speculative`: their rule
draws on each request's own generator.

Legend: ``B`` bucket rows, ``k`` drafted tokens, ``T = k + 1`` verified tokens, ``N`` blocks per row,
``S = N·bs`` draft cache positions, ``D`` width, ``F`` tapped features, ``W = C + r`` latent width, ``V``
vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.draft import EagleDraft
from openk3.model.mla import ABSORB_MAX_TOKENS
from openk3.serve.cache_storage import CacheStorage, StateBatch
from openk3.serve.decode_graph import DecodeGraphs, LatentRows, StaticDecode, bucket_of


class StaticSpeculative(StaticDecode):
    """One greedy speculative step for ``B`` rows of ``k`` drafts over ``N`` blocks each, on fixed buffers
    (see the module docstring). Extra inputs per row: the draft cache's length."""

    def __init__(
        self,
        lm: nn.Module,
        draft: EagleDraft,
        storage: CacheStorage,
        inputs: torch.Tensor,
        B: int,
        k: int,
        N: int,
        sample_vocab_size: int | None,
    ) -> None:
        super().__init__(lm, storage, inputs, B, k + 1, N, sample_vocab_size, extra_inputs=1)
        self.draft, self.k = draft, k
        self.draft_len_B = self.extra_BE[:, 0]
        attn = draft.layer.self_attn
        weight = draft.layer.fc.weight
        self.C = attn.kv_lora_rank
        S, T, W, D = N * storage.layout.block_size, k + 1, attn.kv_lora_rank + attn.rope, weight.shape[0]
        self.past_BSW = weight.new_zeros(B, S, W)
        """The draft's cached latents (``kv_a_layernorm(c)`` then ``k_pe``), the first ``draft_len`` real."""
        torch._dynamo.mark_dynamic(self.past_BSW, 1)  # S = N·bs: one compiled graph for every N
        self.g_BD = weight.new_zeros(B, D)
        """The draft's last output per row: read as the chain's first feature, then overwritten with the
        draft's output at the last kept position (the next step's)."""
        self.out_BT1 = torch.zeros(B, T + 1, dtype=torch.int64, device=weight.device)
        """Per row: kept drafts ``n``, then the emitted tokens ``d_1 … d_n, a_n`` (later entries repeat
        ``a_n``)."""
        self.new_BTW = weight.new_zeros(B, T, W)
        """The draft update's new latents (the first ``n + 1`` are kept), also written into
        :attr:`past_BSW` after each row's cache."""
        self.rows: list = []
        """The draft states of the next run's real rows (set by :class:`SpeculativeGraphs`)."""
        self.resident: list[tuple[object, int] | None] = [None] * B
        """Per row: the draft state whose first ``L`` cached latents and last output the buffers hold, as
        ``(state, L)`` (``None``: unknown), so a request that stays in its row is not copied in again."""

    @torch.no_grad()
    def sample(self, states: StateBatch | None) -> LatentRows | None:
        """The step up to the pool write (:meth:`~StaticDecode.forward` then writes the latents it returns):
        reads the input buffers, ``states`` (updated in place) and the draft buffers; writes
        :attr:`out_BT1`, :attr:`new_BTW` and the draft buffers :attr:`g_BD`, :attr:`past_BSW`, and returns
        the verified tokens' latents' rows. The block pool is only read here, and written after it: the
        draft update reads its own :attr:`past_BSW`, not the pool."""
        B, k, T, C = self.B, self.k, self.T, self.C
        draft, embed, head = self.draft, self.lm.model.embed_tokens, self.lm.lm_head
        dev = self.ids_BT.device
        S = self.past_BSW.shape[1]
        keys_BS = torch.arange(S, device=dev) < self.draft_len_B[:, None]
        lat_BSC, kpe_BSr = self.past_BSW[..., :C], self.past_BSW[..., C:]
        # 1. the draft chain
        g_B1D, chain_keys_BS, chain_lat, chain_kpe = self.g_BD[:, None], keys_BS, lat_BSC, kpe_BSr
        drafts: list[torch.Tensor] = []
        for j in range(k):
            if j:
                chain_keys_BS = torch.cat([chain_keys_BS, chain_keys_BS.new_ones(B, 1)], 1)
                g_B1D, (c_B1C, kpe_B1r) = draft(
                    g_B1D, drafts[-1][:, None], embed, mask_TS=chain_keys_BS[:, None, None, :],
                    past=(chain_lat, chain_kpe),
                )  # fmt: skip
                chain_lat, chain_kpe = torch.cat([chain_lat, c_B1C], 1), torch.cat([chain_kpe, kpe_B1r], 1)
            drafts.append(self._argmax(draft.logits(g_B1D, head)[:, -1]))
        drafts_BK = torch.stack(drafts, 1)
        self.ids_BT[:, 1:].copy_(drafts_BK)
        # 2. verification, with the draft's features
        h_BTD, f_BTF, mla, kda = self.run_model(states, True, draft.draft_config.feature_layers)
        best_BT = self._argmax(head(h_BTD))
        # 3. greedy acceptance
        n_B = (drafts_BK == best_BT[:, :k]).long().cumprod(1).sum(1)
        next_B = best_BT.gather(1, n_B[:, None])[:, 0]
        j_T = torch.arange(T, device=dev)
        emitted_BT = torch.where(
            j_T < n_B[:, None], torch.cat([drafts_BK, next_B[:, None]], 1), next_B[:, None]
        )
        # 4. rollback to the state after the last kept token (n + 1 tokens: y and n drafts)
        for slots in kda:
            slots.rollback(n_B + 1)
        rows = self.latent_rows(mla)
        # 5. the draft reads the kept positions' features (and computes, then drops, the others)
        causal_TT = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        mask_BTS = torch.cat([keys_BS[:, None, :].expand(B, T, S), causal_TT.expand(B, T, T)], -1)
        g_BTD, (c_BTC, kpe_BTr) = draft(
            draft.fuse(f_BTF), emitted_BT, embed, mask_TS=mask_BTS[:, None], past=(lat_BSC, kpe_BSr)
        )
        b_B = torch.arange(B, device=dev)
        self.g_BD.copy_(g_BTD[b_B, n_B])
        self.new_BTW.copy_(torch.cat([c_BTC, kpe_BTr], -1))
        # after each row's cache (draft_len + T ≤ S: the cache is no longer than the target's context);
        # positions past the kept ones lie beyond the next step's draft_len
        self.past_BSW[b_B[:, None], self.draft_len_B[:, None] + j_T] = self.new_BTW
        self.out_BT1.copy_(torch.cat([n_B[:, None], emitted_BT], 1))
        return rows

    def capture(self, states: StateBatch | None) -> None:
        super().capture(states)
        self.resident = [None] * self.B  # the warm-up runs wrote every row's draft buffers

    def before_run(self) -> None:
        """Copy each real row's draft cache and last output into the buffers unless they hold them already
        (the same request in the same row after this step's previous run); padding rows lose theirs."""
        C = self.C
        for b, st in enumerate(self.rows):
            L = 0 if st.cache.latent is None else st.cache.latent.shape[1]
            held = self.resident[b]
            if held is None or held[0] is not st or held[1] != L:
                if L:
                    self.past_BSW[b, :L, :C].copy_(st.cache.latent[0])
                    self.past_BSW[b, :L, C:].copy_(st.cache.k_pe[0])
                self.g_BD[b].copy_(st.g_11D[0, 0])
        self.resident[len(self.rows) :] = [None] * (self.B - len(self.rows))

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sample_vocab_size is not None:
            logits = logits[..., : self.sample_vocab_size]
        return logits.argmax(-1)


class SpeculativeGraphs(DecodeGraphs):
    """Runs greedy speculative steps through :class:`StaticSpeculative`, one per ``(B, k + 1, N)`` (in
    :attr:`steps`), captured in
    CUDA graphs when ``capture`` (CUDA only), else eager; arguments as :class:`DecodeGraphs` plus the draft.
    """

    def __init__(
        self,
        lm: nn.Module,
        draft: EagleDraft,
        storage: CacheStorage,
        scratch_slot: tuple[int, ...],
        max_batch: int,
        max_blocks: int,
        sample_vocab_size: int | None,
        capture: bool,
    ) -> None:
        super().__init__(lm, storage, scratch_slot, max_batch, max_blocks, sample_vocab_size, capture)
        self.draft = draft

    def new_step(self, B: int, T: int, N: int) -> StaticSpeculative:
        """A speculative step of ``(B, k + 1 = T, N)`` on the packed inputs of ``(B, T)``."""
        return StaticSpeculative(
            self.lm,
            self.draft,
            self.storage,
            self.packed_inputs(B, T, 1),
            B,
            T - 1,
            N,
            self.sample_vocab_size,
        )

    def supports_speculative(self, chunks, k: int) -> bool:
        """Whether one-token decodes ``chunks`` can draft and verify ``k`` tokens here: greedy, at most the
        largest bucket, ``k + 1`` tokens on the absorbed attention path."""
        return (
            len(chunks) <= self.max_bucket
            and k + 1 <= ABSORB_MAX_TOKENS
            and all(c.request.sampling_params.temperature == 0 for c in chunks)
        )

    def run_speculative(self, chunks, k: int, states: list) -> list[list[int]]:
        """One speculative step for one-token decodes ``chunks`` (their blocks allocated for ``k + 1``
        tokens) with draft states ``states`` (``cache``: an :class:`~openk3.model.cache.MLACache`, ``g_11D``:
        the last output), updated here. Returns each chunk's emitted tokens (kept drafts + one)."""
        n = len(chunks)
        step = self.step_for(bucket_of(n), k + 1, self.blocks_for(chunks, k + 1))
        lengths = [0 if st.cache.latent is None else st.cache.latent.shape[1] for st in states]
        ids = [t for c in chunks for t in c.token_ids + [0] * k]
        step.rows = states
        self.launch(step, chunks, ids, lengths)
        rows = step.out_BT1[:n].tolist()  # the step's one host wait: one device→host copy
        new_BTW = step.new_BTW[:n].clone()  # the buffers are the next replay's
        g_BD = step.g_BD[:n].clone()
        emitted = []
        for b, (st, row, L) in enumerate(zip(states, rows, lengths)):
            kept = row[0] + 1
            st.cache.append(new_BTW[b : b + 1, :kept, : step.C], new_BTW[b : b + 1, :kept, step.C :])
            st.g_11D = g_BD[b : b + 1, None]
            step.resident[b] = (st, L + kept)
            emitted.append(row[1 : 1 + kept])
        step.rows = []
        return emitted
