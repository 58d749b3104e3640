"""RMSNorm and the sigmoid-gated per-head RMSNorm of the KDA output.

Legend: ``*`` any leading dims, ``D`` normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype != torch.float64 else x


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x · rsqrt(mean(x², -1) + eps)`` computed in float32 (float64 stays float64); no gain, no cast.

    Runs as ``F.rms_norm``: the same composite ops on CPU (bit-identical), torch's fused kernel on CUDA.
    """
    x = _upcast(x)
    return F.rms_norm(x, (x.shape[-1],), None, eps)


class RMSNorm(nn.Module):
    """``weight ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, returned in ``x.dtype``.

    One ``F.rms_norm`` in the wider of ``x``'s and the weight's dtypes (a bf16 ``x`` with fp32 master
    weights, as under autocast, is upcast): with both bf16 (inference) the mean square and the
    normalisation and the gain run in fp32 inside torch's op and round once, the same math as upcasting
    first (bit-identical on the CPU, whose composite upcasts), so a bf16 model's norm is one CUDA kernel.
    fp32 and fp64 compute in their dtype.

    Args:
        dim: normalised width D.
        eps: added to the mean square (the configs use ``rms_norm_eps`` = 1e-5).
    Shapes: ``x_*D -> y_*D``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x_D.dtype == weight.dtype:  # one operator: the casts below would all be no-ops
            return F.rms_norm(x_D, (x_D.shape[-1],), weight, self.eps)
        compute = torch.promote_types(x_D.dtype, weight.dtype)
        x = x_D.to(compute)
        return F.rms_norm(x, (x.shape[-1],), weight.to(compute), self.eps).to(x_D.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """Per-head output norm of KDA: ``RMSNorm(o) ⊙ σ(gate)`` (fla ``FusedRMSNormGated``, activation sigmoid).

    Shapes: ``o_*K``, ``gate_*K -> y_*K`` (``K`` = head size; the weight is shared by all heads).
    """

    def forward(self, o_K: torch.Tensor, gate_K: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        o = _upcast(o_K)
        y = F.rms_norm(o, (o.shape[-1],), self.weight.to(o.dtype), self.eps)
        return (y * torch.sigmoid(_upcast(gate_K))).to(o_K.dtype)
