"""GLU activations: SwiGLU (Kimi-Linear) and SiTU-GLU (K3).

SiTU-GLU (``docs/references.md#situ-glu``): with ``softcap(x, β) = β·tanh(x/β)``,
``h = softcap(g, β₁) · σ(g) · softcap(u, β₂)``; the σ factor takes the *uncapped* gate, the product is
computed in fp32 and cast back; ``β₂ = None`` leaves the up branch uncapped. ``|h| < β₁·β₂``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU of same-shape ``gate`` and ``up`` (any shape), in fp32, returned in ``gate.dtype``.

    Computed as ``(tanh(g/β₁)·σ(g)) · (β₁β₂·tanh(u/β₂))`` (``β₁·u`` uncapped): the gate's factor β₁ moves to
    the up branch, one multiply fewer. With β₁ a power of two (K3: 4) scaling by it is exact, so this rounds
    exactly as ``softcap(g, β₁)·σ(g)·softcap(u, β₂)`` (outside subnormals); otherwise it differs by rounding.
    """
    g = gate.float() if gate.dtype != torch.float64 else gate
    u = up.float() if up.dtype != torch.float64 else up
    u = beta * u if linear_beta is None else (beta * linear_beta) * torch.tanh(u / linear_beta)
    return (torch.tanh(g / beta) * torch.sigmoid(g) * u).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) · up``."""
    return F.silu(gate) * up


def glu(config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The GLU that ``config.hidden_act`` names (``"silu"`` or ``"situ"``)."""
    if config.hidden_act == "situ":
        return situ_glu(gate, up, config.activation_situ_beta, config.activation_situ_linear_beta)
    return silu_glu(gate, up)
