"""Per-layer generation caches.

* KDA layer: the three ShortConvolution caches ``[B, H·K, W−1]`` (last inputs, model dtype) and the
  recurrent state ``[B, H, K, V]`` in fp32 (K-first; fla's ``state_v_first`` layout is its transpose).
* MLA layer: the 576-number latent per token (K3): ``kv_a_layernorm(c)`` ``[B, S, kv_lora_rank]`` and the
  shared, unrotated ``k_pe`` ``[B, S, qk_rope_head_dim]``.

:class:`KimiCache` holds one entry per decoder layer and the number of tokens seen (``seq_len``).

The paged caches are what a server hands the same layers (``openk3.serve``): :class:`KDAStateSlots` are views
of a batch of states that the layer updates in place; :class:`PagedLatents` are cached latents gathered from
blocks and padded to the longest request, with a key mask, and receive the new tokens' latents for the
server to write back.
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


@dataclass
class KDAStateSlots:
    """Paged KDA cache of ``B`` requests: views the layer overwrites in place (no new tensors are kept)."""

    recurrent: torch.Tensor
    """``[B, H, K, V]`` contiguous, fp32 (fp64 for an fp64 model)."""
    conv: torch.Tensor
    """``[B, 3, H·K, W−1]``: the q, k, v conv caches (last ``W − 1`` inputs), any float dtype."""


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
        dev = self.mask.device
        causal_TS = torch.arange(S, S + T, device=dev)[:, None] >= torch.arange(S + T, device=dev)
        keys_BS = torch.cat([self.mask, self.mask.new_ones(B, T)], 1)
        return (causal_TS[None] & keys_BS[:, None, :])[:, None]
