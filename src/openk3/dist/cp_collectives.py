"""The one collective of context parallelism: a differentiable all-gather into a flat buffer.

Gloo refuses a stacked ``[W, n]`` output for ``all_gather_into_tensor`` and accepts a flat ``[W·n]`` one
(``docs/references.md#kda-context-parallel``), so every rank's tensor is flattened, gathered flat and viewed
as ``[W, *shape]``. The backward is the transpose: a sum-reduce-scatter of the incoming gradient, so rank
``r`` receives ``Σ_ranks grad[r]``.

**Every rank must run the backward** (it is a collective): a rank whose loss does not depend on the gathered
tensor would skip it and the others would wait until the process group's timeout. Callers therefore add
:func:`keep_in_backward` of the gathered tensor (an exact zero that keeps it in the graph) to what they return.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch ≥ 2.13 names the flat collectives ``*_single`` and deprecates the ``*_tensor`` names; earlier releases
# (2.11 on our GPU machines) have only the latter. Same semantics: a flat ``[W·n]`` buffer on every rank.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGatherFlat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        ctx.shape = x.shape
        ctx.num_anchors = len(anchors)
        world = dist.get_world_size(group)
        flat = _on_backend_device(x.contiguous().view(-1), group)
        out = flat.new_empty(world * flat.numel())
        _all_gather_flat(out, flat, group=group)
        return out.to(x.device).view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat = _on_backend_device(grad.contiguous().view(-1), ctx.group)
        out = flat.new_empty(ctx.shape.numel())
        _reduce_scatter_flat(out, flat, group=ctx.group)
        return out.to(grad.device).view(ctx.shape), None, *([None] * ctx.num_anchors)


def _on_backend_device(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` itself, or a host copy when the group is gloo and ``x`` is on a GPU (gloo gathers host memory:
    several processes sharing one GPU test CP that way)."""
    if x.is_cuda and dist.get_backend(group) == "gloo":
        return x.cpu()
    return x


def all_gather_flat(x: torch.Tensor, group=None, anchors: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """``[W, *x.shape]``: every rank's ``x`` in rank order (same shape and dtype on every rank); autograd sums
    the gradient of each rank's copy back to it. Collective over ``group`` (default: the world).

    ``anchors``: tensors that are not gathered but put the result in the autograd graph when any of them
    requires grad, so that a rank whose ``x`` happens to be a constant (nothing to send) still runs the
    backward collective with the others."""
    return _AllGatherFlat.apply(x, group, *anchors)


def keep_in_backward(gathered: torch.Tensor) -> torch.Tensor:
    """A 0-dim exact zero that depends on ``gathered`` (the sum of an empty slice: no NaN from its values),
    so a rank that uses none of it still joins the gather's backward collective."""
    return gathered.reshape(-1)[:0].sum()
