"""Stable LatentMoE (K3) and the plain MoE block (Kimi-Linear), with batched routed experts.

K3 order (reference/architecture.md §4, §9 item 11)::

    r = router(x)                                  # full width D (7168)
    z = routed_expert_down_proj(x)                 # D -> latent L (3584)
    e = Σ_k w_k · Expert_k(z)                      # SiTU-GLU experts L -> F (3072) -> L
    y = routed_expert_up_proj(routed_expert_norm(e)) + shared_experts(x)   # shared: one MLP, width 2F

Kimi-Linear has no latent path and no norm: ``y = Σ_k w_k · Expert_k(x) + shared_experts(x)``.

Expert compute is batched: token-slots are sorted by expert and run through a grouped matmul
(``torch.nn.functional.grouped_mm`` with per-expert offsets), with no per-expert Python loop and no host
sync. :func:`experts_loop_reference` is the readable loop kept as the test oracle.

Legend: ``N`` tokens, ``D`` width, ``L`` expert input width (latent or D), ``F`` expert width,
``E`` experts, ``k`` experts per token, ``M = N·k`` token-slots.
Official names: expert ``j`` is ``experts.{j}.w1`` (gate, ``[F, L]``), ``w3`` (up, ``[F, L]``),
``w2`` (down, ``[L, F]``); here they are stacked as ``experts.w1 [E, F, L]`` etc. (see checkpoint/names.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.model.activations import glu
from openk3.model.mlp import MLP
from openk3.model.norm import RMSNorm
from openk3.model.router import MoEGate, RouterOutput

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor, expert_M: torch.Tensor):
    """Row ``m`` of ``x_MI`` times ``w_EOI[expert_M[m]]ᵀ``; rows are sorted by expert, ``offs_E`` = cumsum."""
    w_EOI = w_EOI.to(x_MI.dtype)  # under autocast the activations are bf16 and the master weights fp32
    if x_MI.dtype in _GROUPED_MM_DTYPES and (x_MI.device.type == "cpu" or x_MI.dtype != torch.float32):
        return F.grouped_mm(x_MI, w_EOI.transpose(1, 2), offs=offs_E)
    # dtypes grouped_mm lacks (fp64, CUDA fp32): a gathered batched matmul, still loop-free
    return torch.bmm(w_EOI[expert_M], x_MI.unsqueeze(-1)).squeeze(-1)


def grouped_expert_ffn(config, x_ML, w1_EFL, w3_EFL, w2_ELF, offs_E, expert_M) -> torch.Tensor:
    """The GLU experts on rows sorted by expert: ``w2_e · glu(w1_e x, w3_e x)`` for row ``x`` of expert ``e``.

    ``offs_E`` (int32 ``[E]``) is the cumulative row count per expert, ``expert_M`` the expert of each row.
    Shared by :class:`RoutedExperts` and the expert-parallel module (``openk3.dist``), which passes its local
    experts and the rows it received. Returns ``[M, L]`` in ``x_ML.dtype``.
    """
    gate_MF = _grouped_linear(x_ML, w1_EFL, offs_E, expert_M)
    up_MF = _grouped_linear(x_ML, w3_EFL, offs_E, expert_M)
    return _grouped_linear(glu(config, gate_MF, up_MF), w2_ELF, offs_E, expert_M)


class RoutedExperts(nn.Module):
    """``E`` SiTU/SwiGLU experts stored stacked: ``w1, w3 [E, F, L]`` and ``w2 [E, L, F]``."""

    def __init__(self, config, input_size: int) -> None:
        super().__init__()
        E, F_, L = config.num_experts, config.moe_intermediate_size, input_size
        self.config = config
        self.w1 = nn.Parameter(torch.empty(E, F_, L))
        self.w3 = nn.Parameter(torch.empty(E, F_, L))
        self.w2 = nn.Parameter(torch.empty(E, L, F_))

    def forward(self, z_NL: torch.Tensor, weights_Nk: torch.Tensor, indices_Nk: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]``, in ``z_NL.dtype``."""
        N, k = indices_Nk.shape
        E = self.w1.shape[0]
        expert_M = indices_Nk.reshape(-1)
        order_M = torch.argsort(expert_M, stable=True)
        expert_M = expert_M[order_M]
        token_M = order_M // k
        counts_E = torch.zeros(E, dtype=torch.int64, device=z_NL.device).scatter_add_(
            0, expert_M, torch.ones_like(expert_M)
        )
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        y_ML = grouped_expert_ffn(self.config, z_NL[token_M], self.w1, self.w3, self.w2, offs_E, expert_M)
        w_M = weights_Nk.reshape(-1)[order_M].to(y_ML.dtype)
        out_NL = torch.zeros_like(z_NL)
        return out_NL.index_add_(0, token_M, y_ML * w_M[:, None])


def experts_loop_reference(experts: RoutedExperts, z_NL, weights_Nk, indices_Nk) -> torch.Tensor:
    """Readable per-expert loop (host syncs); the test oracle for :meth:`RoutedExperts.forward`."""
    out = torch.zeros_like(z_NL)
    for e in range(experts.w1.shape[0]):
        token, slot = torch.nonzero(indices_Nk == e, as_tuple=True)
        if token.numel() == 0:
            continue
        x = z_NL[token]
        h = glu(experts.config, x @ experts.w1[e].t(), x @ experts.w3[e].t())
        out.index_add_(0, token, (h @ experts.w2[e].t()) * weights_Nk[token, slot, None].to(x.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """``block_sparse_moe``: router + routed experts (+ latent path, K3) + shared experts.

    Set ``record_router = True`` to keep the last :class:`RouterOutput` in ``last_router_output`` (what
    Quantile Balancing reads); the block itself never changes the bias.
    """

    def __init__(self, config) -> None:
        super().__init__()
        D = config.hidden_size
        self.gate = MoEGate(config, D)
        if config.is_latent_moe:
            L = config.routed_expert_hidden_size
            self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.experts = RoutedExperts(config, config.expert_input_size)
        self.shared_experts = (
            MLP(config, D, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )
        self.is_latent = config.is_latent_moe
        self.record_router = False
        self.last_router_output: RouterOutput | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.gate(x_ND)
        if self.record_router:
            self.last_router_output = routing
        z_NL = self.routed_expert_down_proj(x_ND) if self.is_latent else x_ND
        e_NL = self.experts(z_NL, routing.weights_Nk, routing.indices_Nk)
        if self.is_latent:
            if self.routed_expert_norm is not None:
                e_NL = self.routed_expert_norm(e_NL)
            e_NL = self.routed_expert_up_proj(e_NL)
        if self.shared_experts is not None:
            e_NL = e_NL + self.shared_experts(x_ND)
        return e_NL.reshape(x_BTD.shape)
