"""Per-layer generation caches.

* KDA layer: the three ShortConvolution caches ``[B, H·K, W−1]`` (last inputs, model dtype) and the
  recurrent state ``[B, H, K, V]`` in fp32 (K-first; fla's ``state_v_first`` layout is its transpose).
* MLA layer: the 576-number latent per token (K3): ``kv_a_layernorm(c)`` ``[B, S, kv_lora_rank]`` and the
  shared, unrotated ``k_pe`` ``[B, S, qk_rope_head_dim]``.

:class:`KimiCache` holds one entry per decoder layer and the number of tokens seen (``seq_len``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDACache:
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(q, k, v) conv caches, each ``[B, H·K, W−1]``."""
    recurrent_state: torch.Tensor | None = None
    """fp32 ``[B, H, K, V]``."""


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


@dataclass
class KimiCache:
    """Caches of a whole model for one batch of sequences."""

    layers: list[KDACache | MLACache] = field(default_factory=list)
    seq_len: int = 0
    """Tokens already processed (the position of the next token)."""

    @classmethod
    def for_config(cls, config) -> KimiCache:
        return cls([KDACache() if kind == "kda" else MLACache() for kind in config.layer_types])
