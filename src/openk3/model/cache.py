"""Per-layer generation caches.

* KDA layer: the three ShortConvolution caches ``[B, H·K, W−1]`` (last inputs, model dtype) and the
  recurrent state ``[B, H, K, V]`` in fp32 (K-first; fla's ``state_v_first`` layout is its transpose).
* MLA layer: the 576-number latent per token (K3): ``kv_a_layernorm(c)`` ``[B, S, kv_lora_rank]`` and the
  shared, unrotated ``k_pe`` ``[B, S, qk_rope_head_dim]``.

:class:`KimiCache` holds one entry per decoder layer and the number of tokens seen (``seq_len``).

The paged caches are what a server hands the same layers (``openk3.serve``): :class:`KDAStateSlots` are views
of a batch of states that the layer updates in place; :class:`PagedLatents` are cached latents gathered from
blocks and padded to the longest request, with a key mask, and receive the new tokens' latents for the
server to write back; :class:`PagedPool` hands the layer the block pool itself (a decode step's, read in
place through the block tables by :func:`openk3.ops.mla.paged_latent_attention`) and receives the new
latents the same way.

Speculative verification (``docs/speculative.md``): while a KDA cache's ``steps`` is a list, the layer runs
the chunk one decode step per token and appends the state after each one (the state before the chunk
first), so rolling back to the last accepted token selects a kept state and cuts the MLA latents; nothing
is recomputed. :meth:`KimiCache.begin_verify` / :meth:`KimiCache.rollback` do it for a model cache,
:meth:`KDAStateSlots.rollback` per row for a server's states (``verify`` set: the same states kept as
tensors, the rollback index possibly on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention.bias import causal_lower_right


@dataclass
class KDACache:
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(q, k, v) conv caches, each ``[B, H·K, W−1]``."""
    recurrent_state: torch.Tensor | None = None
    """fp32 ``[B, H, K, V]``."""
    steps: list[tuple] | None = None
    """``(conv_states, recurrent_state)`` before and after each token of an open verification (``None``
    outside one); the layer fills it."""

    def snapshot(self) -> tuple:
        """The current state (the layer replaces its tensors, never writes them in place)."""
        return self.conv_states, self.recurrent_state

    def rollback(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` (0 … T) tokens of the verified chunk: their kept state."""
        self.conv_states, self.recurrent_state = self.steps[num_tokens]
        self.steps = None


@dataclass
class MLACache:
    latent: torch.Tensor | None = None
    """``kv_a_layernorm(c)``: ``[B, S, kv_lora_rank]``."""
    k_pe: torch.Tensor | None = None
    """Shared key part (never rotated): ``[B, S, qk_rope_head_dim]``."""

    def append(self, latent_BTC: torch.Tensor, k_pe_BTR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens; return the whole cached ``(latent, k_pe)``."""
        if self.latent is None:
            self.latent, self.k_pe = latent_BTC, k_pe_BTR
        else:
            self.latent = torch.cat([self.latent, latent_BTC], dim=1)
            self.k_pe = torch.cat([self.k_pe, k_pe_BTR], dim=1)
        return self.latent, self.k_pe

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens (a rolled-back speculative step)."""
        if self.latent is not None:
            self.latent, self.k_pe = self.latent[:, :num_tokens], self.k_pe[:, :num_tokens]


@dataclass
class KimiCache:
    """Caches of a whole model for one batch of sequences."""

    layers: list[KDACache | MLACache] = field(default_factory=list)
    seq_len: int = 0
    """Tokens already processed (the position of the next token)."""
    verify_start: int | None = None
    """``seq_len`` at :meth:`begin_verify` (``None``: no verification open)."""

    @classmethod
    def for_config(cls, config) -> KimiCache:
        return cls([KDACache() if kind == "kda" else MLACache() for kind in config.layer_types])

    def begin_verify(self) -> None:
        """The next forward verifies drafted tokens: its KDA layers keep the state after every token."""
        self.verify_start = self.seq_len
        for c in self.layers:
            if isinstance(c, KDACache):
                c.steps = []

    def rollback(self, num_kept: int) -> None:
        """Keep the first ``num_kept`` tokens of the verified chunk (the accepted prefix) in every layer and
        drop the rest. Raises ``ValueError`` without an open verification or for a count outside
        ``[0, tokens verified]``."""
        if self.verify_start is None:
            raise ValueError("rollback needs begin_verify() and a forward first")
        T = self.seq_len - self.verify_start
        if isinstance(num_kept, bool) or not isinstance(num_kept, int) or not 0 <= num_kept <= T:
            raise ValueError(f"num_kept must be an int in [0, {T}] (the verified tokens), got {num_kept!r}")
        for c in self.layers:
            if isinstance(c, KDACache):
                c.rollback(num_kept)
            else:
                c.truncate(self.verify_start + num_kept)
        self.seq_len, self.verify_start = self.verify_start + num_kept, None


@dataclass
class KDAStateSlots:
    """Paged KDA cache of ``B`` requests: views the layer overwrites in place (no new tensors are kept)."""

    recurrent: torch.Tensor
    """``[B, H, K, V]`` contiguous, fp32 (fp64 for an fp64 model)."""
    conv: torch.Tensor
    """``[B, 3, H·K, W−1]``: the q, k, v conv caches (last ``W − 1`` inputs), any float dtype."""
    verify: bool = False
    """The next forward verifies drafted tokens: the layer keeps the state after every token in :attr:`steps`."""
    steps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """After a verifying forward of ``T`` tokens: the recurrent state before it ``[B, H, K, V]``, the
    recurrent state after each token ``[B, T, H, K, V]`` and the conv window before and after each token
    ``[B, T + 1, 3, H·K, W−1]`` (in the layer's input dtype; ``None`` outside a verification)."""

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the current states (the layer overwrites them in place)."""
        return self.recurrent.clone(), self.conv.clone()

    def rollback(self, kept: list[int] | torch.Tensor) -> None:
        """Set row ``b``'s states to those after its first ``kept[b]`` (0 … T) verified tokens, in place.
        ``kept``: ints, or an int64 tensor ``[B]`` on the states' device (no host data: a CUDA graph can
        capture it)."""
        (rec0_B, rec_BT, conv_BT), self.steps, self.verify = self.steps, None, False
        dev = self.recurrent.device
        n_B = kept if isinstance(kept, torch.Tensor) else torch.tensor(kept, device=dev)
        b_B = torch.arange(n_B.shape[0], device=dev)
        after_B = rec_BT[b_B, (n_B - 1).clamp(min=0)]
        self.recurrent.copy_(torch.where((n_B == 0)[:, None, None, None], rec0_B, after_B))
        self.conv.copy_(conv_BT[b_B, n_B])


@dataclass
class PagedPool:
    """One MLA layer's view of the paged block pool for ``B`` rows: the rows' block tables and cached lengths,
    read in place by the layer's absorbed attention (no gathered copy); the new tokens' latents are handed
    back in :attr:`new` for the server to write after the step."""

    pages: torch.Tensor
    """The pool's pages (contiguous, any shape), read as rows of the latent width ``C + r``."""
    table_BN: torch.Tensor
    """int64 ``[B, N]`` block ids of each row (null block 0 past its end)."""
    lengths_B: torch.Tensor
    """int64 ``[B]``: cached tokens of each row (0 for a padding row)."""
    layer: int
    """This layer's index among the pool's ``num_layers`` MLA layers."""
    num_layers: int
    block_size: int
    new: torch.Tensor | None = None
    """``[B, T, C + r]`` set by the layer."""


@dataclass
class PagedLatents:
    """Paged MLA cache of ``B`` requests: their cached latents padded to the longest (``S`` tokens), a key
    mask, and, after the layer ran, the new tokens' latents."""

    past: torch.Tensor
    """``[B, S, C + r]`` in the model dtype: ``kv_a_layernorm(c)`` then ``k_pe``; padding rows any value."""
    mask: torch.Tensor
    """``[B, S]`` bool, True for a real cached token."""
    full: bool = False
    """Every row has ``S`` real cached tokens (no padding: one request, or equal lengths), so the new tokens'
    mask is plain causal aligned to the end and attention can use a fused kernel without a mask tensor."""
    new: torch.Tensor | None = None
    """``[B, T, C + r]`` set by :meth:`append`."""

    def append(self, latent_BTC: torch.Tensor, k_pe_BTr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new tokens in :attr:`new`; return ``(latent [B, S + T, C], k_pe [B, S + T, r])``."""
        C = latent_BTC.shape[-1]
        self.new = torch.cat([latent_BTC, k_pe_BTr], -1)
        return torch.cat([self.past[..., :C], latent_BTC], 1), torch.cat([self.past[..., C:], k_pe_BTr], 1)

    def attention_mask(self, T: int, dense: bool = True):
        """``[B, 1, T, S + T]`` bool: the new tokens see the real cached tokens and, causally, each other.

        With ``dense=False`` and :attr:`full`, SDPA's lower-right causal bias instead (no tensor; flash-class
        kernels take it)."""
        B, S = self.mask.shape
        if self.full and not dense:
            return causal_lower_right(T, S + T)
        causal_TS = torch.ones(T, S + T, dtype=torch.bool, device=self.mask.device).tril(S)
        keys_BS = torch.cat([self.mask, self.mask.new_ones(B, T)], 1)
        return (causal_TS[None] & keys_BS[:, None, :])[:, None]
