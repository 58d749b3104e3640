"""Weight initialisation (the K3 release init is unpublished; ``docs/references.md#initialisation``).

* Linear, embedding and routed-expert weights: normal(0, ``initializer_range``) (Kimi-Linear).
* RMSNorm gains: 1. AttnRes pseudo-queries (``*_res_proj``): 0, so every mix starts uniform (paper).
* KDA ``A_log``: 0 with the lower-bounded gate (fla ``safe_gate``), ``log U(1, 16)`` with softplus;
  ``dt_bias`` puts the initial per-step decay ``−g`` at ``dt ~ logU(1e-3, 0.1)`` (fla): inverse softplus
  of dt (softplus gate), or ``logit(dt/|lb|)`` (lower-bounded gate, where ``−g = |lb|·σ(dt_bias)`` at 0 input).
* ShortConvolution: PyTorch's Conv1d default (kaiming-uniform, a = √5). Router bias: 0.
* Vision tower: the patch convolution and the learned position table normal(0, ``initializer_range``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.model.kda import KimiDeltaAttention
from openk3.model.moe import MoEGate, RoutedExperts
from openk3.model.norm import RMSNorm
from openk3.model.short_conv import ShortConvolution
from openk3.model.vision import PositionEmbedding2D


@torch.no_grad()
def _init_kda(m: KimiDeltaAttention, generator) -> None:
    H = m.num_heads
    dt = torch.exp(
        torch.rand(m.dt_bias.shape, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    ).clamp_min(1e-4)
    m.A_log.zero_()
    if m.lower_bound is None:
        m.A_log[:H] = torch.log(torch.empty(H).uniform_(1, 16, generator=generator))
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    else:
        m.dt_bias.copy_(torch.logit(dt / abs(m.lower_bound)))


@torch.no_grad()
def init_weights(model: nn.Module, config, seed: int | None = None) -> None:
    """Initialise every parameter and buffer of ``model`` in place (CPU generator; deterministic with seed)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, m in model.named_modules():
        init_module_(name, m, config.initializer_range, gen)


@torch.no_grad()
def init_module_(name: str, m: nn.Module, std: float, gen: torch.Generator | None) -> None:
    """Initialise the direct parameters and buffers of one module ``m`` (named ``name``), drawing from ``gen``.

    :func:`init_weights` calls this for every module in ``named_modules`` order; a sharded model replays
    the same order one module at a time (``openk3.dist.fsdp.materialize``) and so draws the same numbers.
    """

    def normal_(t: torch.Tensor) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std)

    if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d, PositionEmbedding2D)):
        if name.endswith("_res_proj"):
            m.weight.zero_()
        else:
            normal_(m.weight)
    elif isinstance(m, RMSNorm):
        m.weight.fill_(1.0)
    elif isinstance(m, ShortConvolution):
        bound = 1 / math.sqrt(m.kernel_size)  # kaiming_uniform(a=√5) on fan_in = W
        m.weight.copy_(torch.rand(m.weight.shape, generator=gen) * 2 * bound - bound)
    elif isinstance(m, KimiDeltaAttention):
        _init_kda(m, gen)
    elif isinstance(m, RoutedExperts):
        for w in (m.w1, m.w2, m.w3):
            normal_(w)
    elif isinstance(m, MoEGate):
        normal_(m.weight)
        m.e_score_correction_bias.zero_()
