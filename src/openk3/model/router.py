"""MoE router (``block_sparse_moe.gate``): full-width sigmoid scores, bias-corrected top-k selection.

Follows DeepSeek-V3 / Kimi-Linear ("noaux_tc"; ``docs/references.md#router``):

* ``s = σ(x Wᵀ)`` in fp32 (or softmax), on the full hidden width (K3 routes at 7168, not the latent).
* Selection uses ``s + e_score_correction_bias``; the weights use the **unbiased** ``s`` gathered at the
  chosen experts, renormalised to sum 1 (``moe_renormalize``, k > 1, +1e-20) and scaled by
  ``routed_scaling_factor``.
* For Quantile Balancing (``docs/references.md#quantile-balancing``) the router also reports, without acting
  on it, each token's biased
  ``(k+1)``-th score (the cutoff α) and the per-expert token counts. The bias is a buffer that the
  balancer overwrites; no optimizer touches it.

Legend: ``N`` tokens, ``D`` width, ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def few_token_slots(num_slots: int, num_experts: int) -> bool:
    """Whether a routing of ``num_slots = N·k`` token-slots is a decode step's: traced by ``torch.compile``,
    without gradient, no more slots than experts. Such a step is a chain of kernels whose launches, not their
    bytes, set its time; there the router and the experts take forms Inductor fuses into fewer kernels (the
    router's logits as products and sums, its top-k as a sort; :func:`~openk3.model.moe.gathered_experts`)."""
    return num_slots <= num_experts and not torch.is_grad_enabled() and torch.compiler.is_compiling()


@dataclass
class RouterOutput:
    """What one routing call decided, and what balancing needs.

    Attributes:
        weights_Nk: routed weights (unbiased, renormalised, scaled), fp32 ``[N, k]``.
        indices_Nk: chosen experts, int64 ``[N, k]``.
        scores_NE: unbiased scores ``s``, fp32 ``[N, E]``.
        cutoff_N: biased score of the ``(k+1)``-th choice (``-inf`` when ``k = E``), fp32 ``[N]``.
        counts_E: tokens routed to each expert, int64 ``[E]`` (computed when read: only load balancing
            needs it, so an inference forward runs none of its operators).
    """

    weights_Nk: torch.Tensor
    indices_Nk: torch.Tensor
    scores_NE: torch.Tensor
    cutoff_N: torch.Tensor

    @property
    def counts_E(self) -> torch.Tensor:  # noqa: N802 (shape-suffix name)
        idx_M = self.indices_Nk.reshape(-1)
        counts_E = torch.zeros(self.scores_NE.shape[-1], dtype=torch.int64, device=idx_M.device)
        return counts_E.scatter_add_(0, idx_M, torch.ones_like(idx_M))


class MoEGate(nn.Module):
    """Router with ``weight [E, D]`` and the fp32 buffer ``e_score_correction_bias [E]``."""

    def __init__(self, config, hidden_size: int) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_ND: torch.Tensor) -> RouterOutput:
        compute = torch.float64 if x_ND.dtype == torch.float64 else torch.float32
        k, E = self.top_k, self.num_experts
        few = few_token_slots(x_ND.shape[0] * k, E)
        if few:  # one fused reduction with the casts and the sigmoid
            logits_NE = (x_ND.to(compute)[:, None, :] * self.weight.to(compute)).sum(-1)
        else:
            logits_NE = x_ND.to(compute) @ self.weight.to(compute).t()
        s_NE = torch.sigmoid(logits_NE) if self.activation == "sigmoid" else torch.softmax(logits_NE, -1)
        biased_NE = s_NE + self.e_score_correction_bias.to(compute)
        if few:  # Inductor sorts a short row in one Triton kernel; top-k is two or three library kernels
            top_vals, top_idx = (t[:, : min(k + 1, E)] for t in torch.sort(biased_NE, -1, descending=True))
        else:
            top_vals, top_idx = torch.topk(biased_NE, min(k + 1, E), dim=-1, sorted=True)
        idx_Nk = top_idx[:, :k]
        cutoff_N = top_vals[:, k] if k < E else torch.full_like(top_vals[:, 0], float("-inf"))
        w_Nk = s_NE.gather(-1, idx_Nk)
        if self.renormalize and k > 1:
            w_Nk = w_Nk / (w_Nk.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:  # × 1.0 is exact: no operator for it
            w_Nk = w_Nk * self.routed_scaling_factor
        return RouterOutput(w_Nk, idx_Nk, s_NE, cutoff_N)
