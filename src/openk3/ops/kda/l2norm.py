"""Row L2 normalisation of q and k, as the KDA kernels apply it in-op.

Legend: ``D`` the normalised (last) dim; ``...`` any leading dims.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6
"""fla's ``l2norm_fwd`` epsilon, added to ``Σx²`` under the square root
(``docs/references.md#kda-op-arguments``)."""


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Return ``x / sqrt(Σ_d x_d² + eps)`` over the last dim.

    This is fla's ``use_qk_l2norm_in_kernel`` normalisation (``docs/references.md#kda-op-arguments``), which
    differs from
    ``F.normalize`` (that one divides by ``max(‖x‖, 1e-12)``).

    Args:
        x: ``[..., D]`` floating tensor; the result has its dtype and shape, so call it on fp32/fp64 values.
        eps: added to the sum of squares (default ``1e-6``).
    """
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)
