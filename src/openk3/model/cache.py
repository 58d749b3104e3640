"""Per-layer generation caches.

* KDA layer: the three ShortConvolution caches ``[B, H·K, W−1]`` (last inputs, model dtype) and the
  recurrent state ``[B, H, K, V]`` in fp32 (K-first; fla's ``state_v_first`` layout is its transpose).
* MLA layer: the 576-number latent per token (K3): ``kv_a_layernorm(c)`` ``[B, S, kv_lora_rank]`` and the
  shared, unrotated ``k_pe`` ``[B, S, qk_rope_head_dim]``.

:class:`KimiCache` holds one entry per decoder layer and the number of tokens seen (``seq_len``).

Speculative verification (``docs/speculative.md``): between :meth:`KimiCache.begin_verify` and
:meth:`KimiCache.rollback` every KDA layer keeps its state after each new token (:class:`KDASteps`), so
rolling back to the last accepted token selects a kept state and cuts the MLA latents; nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDASteps:
    """The states of one KDA layer at every token of a verified chunk of ``T`` tokens."""

    conv_inputs: tuple[torch.Tensor, ...] = ()
    """(q, k, v) conv inputs ``[B, H·K, W−1+T]``: the cached ``W − 1``, then the chunk's; the conv cache
    after ``n`` tokens of the chunk is ``[..., n : n + W − 1]``."""
    recurrent: list[torch.Tensor] = field(default_factory=list)
    """``T + 1`` recurrent states ``[B, H, K, V]``: before the chunk, then after each of its tokens."""


@dataclass
class KDACache:
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(q, k, v) conv caches, each ``[B, H·K, W−1]``."""
    recurrent_state: torch.Tensor | None = None
    """fp32 ``[B, H, K, V]``."""
    steps: KDASteps | None = None
    """Per-token states of an open verification (``None`` outside one); the layer's forward fills it."""

    def rollback(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` (0 … T) tokens of the verified chunk: their kept state."""
        st = self.steps
        W1 = st.conv_inputs[0].shape[-1] - (len(st.recurrent) - 1)  # W − 1
        self.conv_states = tuple(x[..., num_tokens : num_tokens + W1].contiguous() for x in st.conv_inputs)
        self.recurrent_state = st.recurrent[num_tokens]
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
                c.steps = KDASteps()

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
