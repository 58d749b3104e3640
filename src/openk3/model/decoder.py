"""One decoder layer: a sequence mixer (KDA or MLA) and a width mixer (dense FFN or MoE).

Kimi-Linear is pre-norm with residual adds (``docs/references.md#decoder-wiring``)::

    h = h + self_attn(input_layernorm(h));  h = h + ffn(post_attention_layernorm(h))

K3 replaces both adds with Block AttnRes (``docs/references.md#block-attention-residuals``). The stream is
carried as ``(blocks, partial)``:
``blocks`` are completed block sums (``b_0`` = embedding), ``partial`` is the running sum of the current
block's sublayer outputs. For layer ``i``::

    h = AttnRes(blocks, partial; self_attention_res_*)   if blocks else partial
    if i % block_size == 0: blocks.append(partial); partial = None
    a = self_attn(input_layernorm(h));     partial = a if partial is None else partial + a
    h = AttnRes(blocks, partial; mlp_res_*)
    partial = partial + ffn(post_attention_layernorm(h))

Layer 0's ``self_attention_res_*`` exist (the checkpoint has them) but are never used.
Legend: ``B`` batch, ``T`` tokens, ``D`` width.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.attn_res import attn_res_mix, make_res_pair
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import MultiheadLatentAttention
from openk3.model.mlp import MLP
from openk3.model.moe import SparseMoeBlock
from openk3.model.norm import RMSNorm


class KimiDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config) if self.is_kda else MultiheadLatentAttention(config)
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config, D, config.intermediate_size)
        self.block_size = config.attn_res_block_size
        self.opens_block = self.block_size is not None and layer_idx % self.block_size == 0
        """Whether this layer starts a new AttnRes block (its input partial sum becomes a closed block). A bool
        fixed here, not computed from ``layer_idx`` in the forward: ``torch.compile`` then guards on it, and
        layers of one kind share a compiled graph instead of compiling once per layer index."""
        if self.block_size is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = make_res_pair(D, config.rms_norm_eps)
            self.mlp_res_norm, self.mlp_res_proj = make_res_pair(D, config.rms_norm_eps)

    def ffn(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.mlp(x_BTD) if hasattr(self, "mlp") else self.block_sparse_moe(x_BTD)

    def forward_residual(self, h_BTD: torch.Tensor, cache=None, cu_seqlens=None) -> torch.Tensor:
        """Kimi-Linear wiring (plain residual adds)."""
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cache, cu_seqlens)
        return h_BTD + self.ffn(self.post_attention_layernorm(h_BTD))

    def forward_attn_res(
        self,
        blocks: list[torch.Tensor],
        partial_BTD: torch.Tensor,
        cache=None,
        cu_seqlens=None,
        mix=attn_res_mix,
    ) -> torch.Tensor:
        """K3 wiring (Block AttnRes); returns the new partial sum.

        ``blocks`` is read, never changed: when this layer opens a new block (:attr:`opens_block`) the caller
        appends ``partial_BTD`` to its list after the call (FSDP2 hands hooked methods copies of their list
        arguments, so an in-place append would be lost). ``mix``: :func:`~openk3.model.attn_res.attn_res_mix`
        or a :class:`~openk3.model.attn_res.TwoPhaseAttnRes` of the whole forward."""
        if blocks:
            h_BTD = mix(blocks, partial_BTD, self.self_attention_res_norm, self.self_attention_res_proj)
        else:
            h_BTD = partial_BTD
        if self.opens_block:
            blocks = [*blocks, partial_BTD]
            partial_BTD = None
        a_BTD = self.self_attn(self.input_layernorm(h_BTD), cache, cu_seqlens)
        partial_BTD = a_BTD if partial_BTD is None else partial_BTD + a_BTD
        h_BTD = mix(blocks, partial_BTD, self.mlp_res_norm, self.mlp_res_proj)
        return partial_BTD + self.ffn(self.post_attention_layernorm(h_BTD))
