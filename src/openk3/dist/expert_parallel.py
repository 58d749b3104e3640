"""Expert parallelism applied from outside the model: each MoE block's routed experts are swapped for an
:class:`ExpertParallelExperts` that holds ``E/ep`` of them and exchanges tokens (:mod:`openk3.dist.dispatch`).

The swap keeps the parameter names (``experts.w1/w3 [E, F, L]``, ``w2 [E, L, F]``) and the global shapes:
the weights become DTensors sharded ``Shard(0)`` (over experts) on the ``ep`` mesh, so checkpoints and
the initialisation see the single-device tensors. The model code is unchanged: the block calls
``self.experts(z, weights, indices)`` either way. Dispatch happens at the width of ``z``, the latent width
for K3's LatentMoE (the router and the down-projection run before, on the local tokens).

Two dispatchers behind one signature (:data:`DISPATCHERS`): ``"alltoall"``, the dropless all-to-all
(:func:`openk3.dist.dispatch.alltoall_experts`, the oracle and the default), and ``"moonep"``, the
MoonEP contract (:func:`openk3.dist.moonep.moonep_experts`: exactly ``S·K`` rows per rank, redundant
experts, same-rank dedupe).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from openk3.dist.dispatch import alltoall_experts
from openk3.dist.mesh import Meshes
from openk3.dist.moonep import moonep_experts
from openk3.model.moe import RoutedExperts, SparseMoeBlock
from openk3.quant.mxfp4 import mxfp4_ste, mxfp8_ste

DISPATCHERS = {"alltoall": alltoall_experts, "moonep": moonep_experts}
"""EP dispatchers by name; each maps ``(config, z, weights, indices, w1, w3, w2, num_experts, group,
x_quant)`` to the routed experts' output ``[N, L]`` (this rank's ``P`` experts in ``w1, w3, w2``; ``x_quant``
maps each expert GEMM input, or ``None``)."""


class ExpertParallelExperts(RoutedExperts):
    """Routed experts sharded over the ``ep`` mesh; same forward contract as :class:`RoutedExperts`, ``qat``
    included (MXFP4 fake-quantised local weights, MXFP8 GEMM inputs; :mod:`openk3.quant.qat`).

    ``dispatcher`` names one of :data:`DISPATCHERS`. Raises ``ValueError`` when ``num_experts`` is not
    divisible by the ``ep`` size or the dispatcher is unknown.
    """

    def __init__(self, experts: RoutedExperts, ep_mesh: DeviceMesh, dispatcher: str = "alltoall") -> None:
        nn.Module.__init__(self)
        self.config = experts.config
        E = experts.w1.shape[0]
        R = ep_mesh.size()
        if E % R:
            raise ValueError(f"num_experts={E} is not divisible by ep={R}")
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={dispatcher!r}: use one of {', '.join(DISPATCHERS)}")
        self.dispatcher = dispatcher
        self.qat = experts.qat
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
        w1, w3, w2 = (_ScaleGrad.apply(_local(w), self.grad_scale) for w in (self.w1, self.w3, self.w2))
        x_quant = None
        if self.qat:  # MX blocks run along each expert row: quantising this rank's experts = its share of all
            w1, w3, w2, x_quant = mxfp4_ste(w1), mxfp4_ste(w3), mxfp4_ste(w2), mxfp8_ste
        run = DISPATCHERS[self.dispatcher]
        return run(
            self.config, z_NL, weights_Nk, indices_Nk, w1, w3, w2, self.num_experts, self.ep_mesh.get_group(),
            x_quant,
        )  # fmt: skip


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


def apply_expert_parallel(model: nn.Module, meshes: Meshes, dispatcher: str = "alltoall") -> nn.Module:
    """Swap the routed experts of every MoE block of ``model`` for :class:`ExpertParallelExperts` (with
    ``dispatcher``, one of :data:`DISPATCHERS`), in place."""
    if meshes.ep is None:
        return model
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts = ExpertParallelExperts(module.experts, meshes.ep, dispatcher)
    return model
