"""One decode token of a KDA layer for ``B`` requests, updating their gathered states in place.

The same computation as :class:`~openk3.model.kda.KimiDeltaAttention` with a cache and one new token
(``docs/references.md#kda-layer``), written for the server's state batch
(:class:`~openk3.serve.cache_storage.StateBatch`), whose per-layer recurrent state ``[B, H, K, V]`` and conv
caches ``[B, 3, P, W−1]`` are overwritten instead of replaced, so a decode step allocates no state-sized
tensor:

* the q/k/v short convolutions run as one depthwise step over the stacked ``[B, 3, P]`` projections (the
  taps summed in :class:`~openk3.model.short_conv.ShortConvolution`'s order), then the window shifts by one;
* the recurrence (``docs/references.md#kda-recurrence``: ``S ← Diag(e^g) S``; ``S ← S + β k (v − Sᵀk)ᵀ``;
  ``o = Sᵀ(scale·q)``) runs on CUDA in the Triton decode kernel, which updates the state rows in place
  (:func:`~openk3.ops.kda.triton.decode.fused_recurrent_kda_decode`), elsewhere as ``mul_``/``bmm``/
  ``baddbmm_`` on the state, in the order of :func:`~openk3.ops.kda.naive.kda_step` (the reference it is
  tested against).

Legend: ``B`` requests, ``D`` width, ``H`` heads, ``K`` head size (= V), ``P = H·K``, ``W`` conv kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.ops.kda import kda_gate, l2norm
from openk3.ops.kda.triton.dispatch import use_triton_recurrent


def short_conv_step_(x_B3P: torch.Tensor, state_B3PW: torch.Tensor, weight_3PW: torch.Tensor) -> torch.Tensor:
    """``SiLU(causal depthwise conv)`` of one new input per channel; shifts ``state`` (the last ``W − 1``
    inputs, any float dtype) in place. Returns ``[B, 3, P]`` in ``x``'s dtype."""
    W = weight_3PW.shape[-1]
    past_B3PW = state_B3PW.to(x_B3P.dtype)
    y_B3P = torch.zeros_like(x_B3P)
    for w in range(W - 1):
        y_B3P = y_B3P + past_B3PW[..., w] * weight_3PW[..., w]
    y_B3P = F.silu(y_B3P + x_B3P * weight_3PW[..., W - 1])
    state_B3PW[..., :-1] = state_B3PW[..., 1:].clone()
    state_B3PW[..., -1] = x_B3P
    return y_B3P


def recurrent_step_(
    S_BHKV: torch.Tensor,
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g_BHK: torch.Tensor,
    beta_BH: torch.Tensor,
) -> torch.Tensor:
    """One KDA token on a contiguous state, in place; inputs prepared (q l2-normalised and scaled, k
    l2-normalised, ``g`` the log-decay), all in ``S``'s dtype. Returns ``o [B, H, V]``."""
    B, H, K, V = S_BHKV.shape
    S_NKV = S_BHKV.view(B * H, K, V)
    S_BHKV.mul_(g_BHK.exp().unsqueeze(-1))
    kS_N1V = torch.bmm(k_BHK.reshape(B * H, 1, K), S_NKV)
    delta_N1V = beta_BH.reshape(B * H, 1, 1) * (v_BHV.reshape(B * H, 1, V) - kS_N1V)
    S_NKV.baddbmm_(k_BHK.reshape(B * H, K, 1), delta_N1V)
    return torch.bmm(q_BHK.reshape(B * H, 1, K), S_NKV).view(B, H, V)


def kda_decode_(
    attn: nn.Module, x_B1D: torch.Tensor, S_BHKV: torch.Tensor, conv_B3PW: torch.Tensor
) -> torch.Tensor:
    """``attn`` (a :class:`~openk3.model.kda.KimiDeltaAttention`) on one normed token per request
    ``[B, 1, D]``; ``S_BHKV`` (contiguous, fp32 or fp64) and ``conv_B3PW`` are updated in place.
    Returns ``[B, 1, D]`` in ``x``'s dtype."""
    B, _, D = x_B1D.shape
    H, K = attn.num_heads, attn.head_dim
    x_BD = x_B1D.view(B, D)
    convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    weight_3PW = torch.stack([c.weight[:, 0, :] for c in convs]).to(x_BD.dtype)
    proj_B3P = torch.stack([attn.q_proj(x_BD), attn.k_proj(x_BD), attn.v_proj(x_BD)], 1)
    qkv_B3P = short_conv_step_(proj_B3P, conv_B3PW, weight_3PW)
    q_BHK, k_BHK, v_BHK = (qkv_B3P[:, i].view(B, H, K) for i in range(3))
    g_raw_BHK = attn.f_b_proj(attn.f_a_proj(x_BD)).view(B, H, K)
    beta_BH = torch.sigmoid(attn.b_proj(x_BD).to(torch.promote_types(x_BD.dtype, torch.float32)))
    if use_triton_recurrent(q_BHK, k_BHK, v_BHK, g_raw_BHK, beta_BH, initial_state=S_BHKV):
        from openk3.ops.kda.triton.decode import fused_recurrent_kda_decode

        o_BHK = fused_recurrent_kda_decode(
            q_BHK[:, None], k_BHK[:, None], v_BHK[:, None], g_raw_BHK[:, None], beta_BH[:, None], S_BHKV,
            torch.arange(B, device=S_BHKV.device), A_log=attn.A_log, dt_bias=attn.dt_bias,
            lower_bound=attn.lower_bound, use_qk_l2norm_in_kernel=True,
        )[:, 0]  # fmt: skip
    else:
        dtype = S_BHKV.dtype
        g_BHK = kda_gate(g_raw_BHK.to(dtype), attn.A_log, attn.dt_bias, attn.lower_bound)
        q_BHK = l2norm(q_BHK.to(dtype)) * K**-0.5
        k_BHK = l2norm(k_BHK.to(dtype))
        o_BHK = recurrent_step_(S_BHKV, q_BHK, k_BHK, v_BHK.to(dtype), g_BHK, beta_BH.to(dtype))
    gate_BP = attn.g_proj(x_BD) if attn.full_rank_gate else attn.g_b_proj(attn.g_a_proj(x_BD))
    o_BHK = attn.o_norm(o_BHK.to(x_BD.dtype), gate_BP.view(B, H, K))
    return attn.o_proj(o_BHK.reshape(B, H * K)).view(B, 1, D)
