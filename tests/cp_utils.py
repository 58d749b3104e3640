"""Helpers of the context-parallel tests: one attention layer under CP against the same layer unsharded.

Legend: ``T`` global tokens, ``D`` model width.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from openk3.dist.context_parallel import apply_context_parallel


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got − want| / max|want|``."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def rel_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖``."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def layer_under_cp_error(
    base: torch.nn.Module, layout: str, cu: list[int], dtype, D: int, seed: int
) -> float:
    """Run a copy of ``base`` (a KDA or MLA layer) in ``dtype`` on a random ``[1, T, D]`` row with documents
    ``cu`` unsharded, and another copy under CP on this rank's tokens; returns the largest of: the max
    relative difference of the outputs and of the input gradients at this rank's positions, and the relative
    norm of each parameter gradient summed over the ranks (one fp32 sum over all tokens, whose order the split
    changes). Collective over the default group."""
    T = cu[-1]
    ref = copy.deepcopy(base).to(dtype)
    cp_layer = copy.deepcopy(ref)
    plan = apply_context_parallel(torch.nn.ModuleDict({"attn": cp_layer}), layout=layout).begin(cu)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    dY = torch.randn(1, T, D, generator=gen, dtype=torch.float64).to(dtype)
    y = ref(x, cu_seqlens=torch.tensor(cu))
    (y * dY).sum().backward()
    x_l = plan.shard(x.detach()).requires_grad_()
    y_l = cp_layer(x_l)
    (y_l * plan.shard(dY)).sum().backward()
    worst = max(rel_max(y_l.detach(), plan.shard(y.detach())), rel_max(x_l.grad, plan.shard(x.grad)))
    for p, p_ref in zip(cp_layer.parameters(), ref.parameters(), strict=True):
        dist.all_reduce(p.grad)
        worst = max(worst, rel_norm(p.grad, p_ref.grad))
    return worst
