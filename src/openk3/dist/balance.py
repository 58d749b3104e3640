"""Quantile Balancing under data parallelism: which group the routing counts are summed over, and the sum.

The balancer (:class:`openk3.train.balance.QuantileBalancer`) keeps integer histograms and loads that the
micro-batches of one optimizer step add to, and sums them over the data ranks once, at the step, before
the quantiles (so gradient accumulation and evaluation forwards never communicate, and nothing is counted
twice). The data group is every rank that sees different tokens with the same router: ``dp_replicate ×
dp_shard`` (× ``cp`` once context parallelism exists); EP does not change it (the router runs on each
rank's own tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from openk3.dist.mesh import Meshes


def data_process_group(meshes: Meshes) -> dist.ProcessGroup:
    """The process group over which routing counts are summed (all data ranks; today the whole world)."""
    dense = meshes.dense
    if dense.size() == dist.get_world_size():
        return dist.group.WORLD
    raise NotImplementedError(
        "routing counts over a data group smaller than the world (TP/PP) are not built yet"
    )


def all_reduce_counts_(
    counts: list[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Sum integer count tensors (histograms ``[E, B]``, loads ``[E]``, of any layers) over ``group`` in one
    ``all_reduce`` of one flat buffer, in place; returns ``counts``.

    Raises ``ValueError`` for tensors of mixed dtypes or a floating dtype (counts must add exactly).
    """
    if not counts:
        return counts
    dtypes = {c.dtype for c in counts}
    if len(dtypes) != 1 or next(iter(dtypes)).is_floating_point:
        raise ValueError(f"counts must share one integer dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([c.reshape(-1) for c in counts])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    torch._foreach_copy_(
        counts, [part.view_as(c) for part, c in zip(flat.split([c.numel() for c in counts]), counts)]
    )
    return counts
