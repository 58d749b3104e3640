"""The decay-only gated linear recurrence: KDA's family without the delta rule (a Mamba2-like control).

Per head, with one log-decay ``g_t ≤ 0`` per token and head (the synthetic tasks' control mixer)::

    S_t = e^{g_t} S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)

Unrolled, ``o_t = Σ_{s ≤ t} e^{Γ_t − Γ_s} β_s (scale · q_t·k_s) v_s`` with ``Γ = cumsum(g)``: a causal
attention whose weights are the decays, computed here in that parallel (quadratic) form. Every exponent
``Γ_t − Γ_s`` (``s ≤ t``) is ≤ 0, so the weights stay in ``[0, 1]`` however long the sequence; the memory is
``B·H·T²`` numbers, which suits the short synthetic sequences it serves.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim.
"""

from __future__ import annotations

import torch


def parallel_decay_only(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The decay-only recurrence's outputs, by the parallel form above; differentiable by autograd.

    Args:
        q_BTHK, k_BTHK: queries and keys (normalise them first if wanted). v_BTHV: values.
        g_BTH: log-decay per token and head (natural log, ≤ 0). beta_BTH: write strength (post-sigmoid).
        scale: multiplies q; default ``K ** -0.5``.

    Returns:
        ``[B, T, H, V]`` in ``v``'s dtype, computed in float32 (float64 when any input is float64).

    Raises:
        ValueError: when the shapes do not agree.
    """
    B, T, H, K = q_BTHK.shape
    if k_BTHK.shape != q_BTHK.shape or v_BTHV.shape[:3] != (B, T, H) or g_BTH.shape != (B, T, H):
        raise ValueError(
            f"decay-only shapes disagree: q {tuple(q_BTHK.shape)}, k {tuple(k_BTHK.shape)}, "
            f"v {tuple(v_BTHV.shape)}, g {tuple(g_BTH.shape)} (want q = k = [B, T, H, K], v [B, T, H, V], "
            "g [B, T, H])"
        )
    if beta_BTH.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {[B, T, H]}; got {tuple(beta_BTH.shape)}")
    inputs = (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in inputs) else torch.float32
    q, k, v, g, beta = (t.to(dtype).transpose(1, 2) for t in inputs)  # heads before tokens
    Gamma_BHT = g.cumsum(-1)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    exponent_BHTT = (Gamma_BHT.unsqueeze(-1) - Gamma_BHT.unsqueeze(-2)).masked_fill(~causal_TT, -torch.inf)
    scores_BHTT = (q @ k.transpose(-1, -2)) * (K**-0.5 if scale is None else scale)
    weights_BHTT = scores_BHTT * exponent_BHTT.exp() * beta.unsqueeze(-2)
    return (weights_BHTT @ v).transpose(1, 2).to(v_BTHV.dtype)
