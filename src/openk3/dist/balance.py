"""Quantile Balancing under data parallelism: the group the routing counts are summed over.

The MoE blocks keep integer histograms and loads that the micro-batches of one optimizer step add to
(:mod:`openk3.model.routing_stats`); the balancer (:class:`openk3.train.balance.QuantileBalancer`, given this
group as ``process_group``) sums them over the data ranks in one ``all_reduce``, at the step, before the
quantiles (so gradient accumulation and evaluation forwards never communicate, and nothing is counted
twice). The data group is every rank that sees different tokens with the same router: ``dp_replicate ×
dp_shard`` (× ``cp`` once context parallelism exists); EP does not change it (the router runs on each
rank's own tokens).
"""

from __future__ import annotations

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
