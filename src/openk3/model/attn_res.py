"""Block Attention Residuals (AttnRes) as K3 wires them (``docs/references.md#block-attention-residuals``;
arXiv 2603.15031).

Depth mixing replaces the residual add: each sublayer reads a softmax-weighted mix of the completed
*block* sums ``b_0 .. b_{n-1}`` (``b_0`` = the token embedding) and the running partial sum of the current
block. The weights come from a learned per-layer pseudo-query ``w`` (``*_res_proj``, ``[1, D]``) scored
against RMS-normalised sources (``*_res_norm``, gain γ)::

    V = [b_0, …, b_{n-1}, partial]            # N sources
    score_i = RMSNorm_nogain(V_i) · (γ ⊙ w)
    h = Σ_i softmax(score)_i · V_i             # in fp32, cast back

A block is ``attn_res_block_size`` **decoder layers** (K3: 12, so 93 layers give 8 blocks); the
embedding is appended as block 0 at layer 0. The final output mix comes before the final norm.

Legend: ``B`` batch, ``T`` tokens, ``D`` width, ``N`` sources.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.norm import RMSNorm, rms_normalize


def attn_res_mix(
    blocks: list[torch.Tensor], partial_BTD: torch.Tensor, norm: RMSNorm, proj: nn.Linear
) -> torch.Tensor:
    """Mix ``blocks`` (each ``[B, T, D]``) and ``partial_BTD`` with pseudo-query ``proj.weight`` ``[1, D]``.

    Returns ``[B, T, D]`` in ``partial_BTD.dtype``; the scores, softmax and sum run in fp32 (fp64 stays fp64).
    """
    V_NBTD = torch.stack([*blocks, partial_BTD])
    compute = torch.float64 if V_NBTD.dtype == torch.float64 else torch.float32
    V_NBTD = V_NBTD.to(compute)
    query_D = norm.weight.to(compute) * proj.weight[0].to(compute)
    score_NBT = rms_normalize(V_NBTD, norm.eps) @ query_D
    p_NBT = torch.softmax(score_NBT, dim=0)
    return torch.einsum("nbt,nbtd->btd", p_NBT, V_NBTD).to(partial_BTD.dtype)


def make_res_pair(hidden_size: int, eps: float) -> tuple[RMSNorm, nn.Linear]:
    """One AttnRes site: ``(*_res_norm, *_res_proj)``; the pseudo-query starts at zero (uniform mix)."""
    proj = nn.Linear(hidden_size, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return RMSNorm(hidden_size, eps), proj
