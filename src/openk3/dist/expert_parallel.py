"""Expert parallelism applied from outside the model: each MoE block's routed experts are swapped for an
:class:`ExpertParallelExperts` that holds ``E/ep`` of them and exchanges tokens (:mod:`openk3.dist.dispatch`).

The swap keeps the parameter names (``experts.w1/w3 [E, F, L]``, ``w2 [E, L, F]``) and the global shapes:
the weights become DTensors sharded ``Shard(0)`` (over experts) on the ``ep`` mesh, so checkpoints and
the initialisation see the single-device tensors. The model code is unchanged: the block calls
``self.experts(z, weights, indices)`` either way. Dispatch happens at the width of ``z``, the latent width
for K3's LatentMoE (the router and the down-projection run before, on the local tokens).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from openk3.dist.dispatch import combine, dispatch
from openk3.dist.mesh import Meshes
from openk3.model.moe import RoutedExperts, SparseMoeBlock, grouped_expert_ffn


class ExpertParallelExperts(RoutedExperts):
    """Routed experts sharded over the ``ep`` mesh; same forward contract as :class:`RoutedExperts`.

    Raises ``ValueError`` when ``num_experts`` is not divisible by the ``ep`` size.
    """

    def __init__(self, experts: RoutedExperts, ep_mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        self.config = experts.config
        E = experts.w1.shape[0]
        R = ep_mesh.size()
        if E % R:
            raise ValueError(f"num_experts={E} is not divisible by ep={R}")
        self.ep_mesh = ep_mesh
        self.num_experts = E
        self.grad_scale = 1.0
        """Factor on the weight gradients. Each rank's experts collect the gradients of every EP rank's tokens;
        under FSDP's data-parallel mean (each rank's loss a mean over its own tokens, gradients averaged
        over ``efsdp`` only) :func:`openk3.dist.fsdp.shard_model` sets ``1/ep`` so expert gradients are
        not ``ep`` times too large."""
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            local = torch.empty((E // R, *full.shape[1:]), dtype=full.dtype, device=full.device)
            dt = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(self, name, nn.Parameter(dt, requires_grad=full.requires_grad))

    def forward(self, z_NL: torch.Tensor, weights_Nk: torch.Tensor, indices_Nk: torch.Tensor) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        d = dispatch(z_NL, indices_Nk, self.num_experts, group)
        w1, w3, w2 = (_ScaleGrad.apply(_local(w), self.grad_scale) for w in (self.w1, self.w3, self.w2))
        y_QL = grouped_expert_ffn(self.config, d.x_QL, w1, w3, w2, d.offs_P, d.expert_Q)
        return combine(y_QL, weights_Nk, d, group, z_NL.shape[0])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (exact for a power of two)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.scale == 1.0 else grad * ctx.scale), None


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts ``[P, …]`` of an expert weight (the EP shard; FSDP has unsharded its own dims)."""
    return w.to_local() if isinstance(w, DTensor) else w


def apply_expert_parallel(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Swap the routed experts of every MoE block of ``model`` for :class:`ExpertParallelExperts`, in place."""
    if meshes.ep is None:
        return model
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts = ExpertParallelExperts(module.experts, meshes.ep)
    return model
