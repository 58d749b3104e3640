"""Named device meshes for data, expert and context parallelism.

The world's ranks are laid out ``[dp_replicate, dp_shard, cp]`` (row-major, ``cp`` fastest). The dense
parameters are sharded over ``dp_shard·cp`` (FSDP2; a ``dp_shard_cp`` dimension of its own, as torchtitan
flattens one, since the ``cp`` ranks of one sequence compute different gradients) and replicated over
``dp_replicate`` (HSDP). With expert
parallelism the same ranks are also viewed as ``[dp_replicate, efsdp, ep]`` with
``efsdp = dp_shard·cp / ep``: an EP group is ``ep`` consecutive ranks of one data-shard group, and the
routed experts are FSDP-sharded over ``efsdp`` (torchtitan's expert-DP layout, PR #4314).

Every check runs before any process group is touched, and each error names the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")
EXPERT_MESH_DIMS = ("dp_replicate", "efsdp", "ep")
EXPERT_SHARD_DIM = "efsdp_ep"
"""The expert mesh's ``efsdp`` and ``ep`` flattened into one dimension (every rank of a replica): the group
over which a routed expert's values are partial (its gradient norm), reduced in one collective."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; their product ``dp_replicate·dp_shard·cp`` is the world size.

    Attributes:
        world_size: number of processes.
        dp_shard: FSDP2 shard degree (``-1``: the rest of the world after ``dp_replicate`` and ``cp``).
        dp_replicate: HSDP replica count (1 = plain FSDP).
        ep: expert-parallel degree; must divide ``dp_shard·cp`` (EP groups live inside a shard group).
        cp: context-parallel degree: each sequence is split over ``cp`` consecutive ranks
            (:mod:`openk3.dist.context_parallel`); the dense parameters are FSDP-sharded over
            ``dp_shard·cp`` (the cp ranks see different tokens of the same sequences).

    Raises ``ValueError`` naming the field and the numbers when a degree is not a positive integer, the
    degrees do not multiply to ``world_size``, or ``ep`` does not divide ``dp_shard·cp``.
    """

    world_size: int
    dp_shard: int = -1
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for field in ("world_size", "dp_replicate", "ep", "cp"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        if self.dp_shard == -1:
            rest, left = divmod(self.world_size, self.dp_replicate * self.cp)
            if left:
                raise ValueError(
                    f"world_size={self.world_size} is not divisible by dp_replicate·cp = "
                    f"{self.dp_replicate}·{self.cp}"
                )
            object.__setattr__(self, "dp_shard", rest)
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"dp_shard={self.dp_shard!r} must be a positive integer or -1 (fill)")
        product = self.dp_replicate * self.dp_shard * self.cp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate·dp_shard·cp = {self.dp_replicate}·{self.dp_shard}·{self.cp} = {product} "
                f"but world_size={self.world_size}"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard·cp = {self.dp_shard}·{self.cp} = {self.dp_shard * self.cp}"
            )

    @property
    def efsdp(self) -> int:
        """Shard degree of the routed experts: ``dp_shard·cp / ep``."""
        return self.dp_shard * self.cp // self.ep

    def check_model(self, text_config) -> None:
        """Raise ``ValueError`` when ``ep`` does not divide the model's ``num_experts`` (or a MoE-free model
        asks for ``ep > 1``)."""
        E = getattr(text_config, "num_experts", 0) or 0
        if self.ep > 1 and E == 0:
            raise ValueError(f"ep={self.ep} but the model has no routed experts")
        if E and E % self.ep:
            raise ValueError(
                f"num_experts={E} is not divisible by ep={self.ep} "
                f"(valid ep values: {[d for d in range(1, E + 1) if E % d == 0]})"
            )


@dataclass(frozen=True)
class Meshes:
    """The meshes one rank uses.

    Attributes:
        dense: ``[dp_replicate, dp_shard, cp]`` — every non-expert parameter.
        dense_shard_cp: the same ranks as ``[dp_replicate, dp_shard·cp]`` when ``cp > 1``, else None.
        expert: ``[dp_replicate, efsdp, ep]`` — routed experts; ``None`` when ``ep == 1``. Its ``efsdp`` and
            ``ep`` are also flattened into :data:`EXPERT_SHARD_DIM` (``expert[EXPERT_SHARD_DIM]``).
        dims: the degrees.
    """

    dense: DeviceMesh
    expert: DeviceMesh | None
    dims: ParallelDims
    dense_shard_cp: DeviceMesh | None = None
    """``[dp_replicate, dp_shard_cp]`` (``dp_shard·cp`` in one dimension) when ``cp > 1``: FSDP's mesh."""

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes for dense parameters: 1-D ``dp_shard`` (``dp_shard·cp`` flattened
        when ``cp > 1``) or 2-D HSDP with ``dp_replicate``."""
        if self.dense_shard_cp is not None:
            return self.dense_shard_cp if self.dims.dp_replicate > 1 else self.dense_shard_cp["dp_shard_cp"]
        if self.dims.dp_replicate > 1:
            return self.dense["dp_replicate", "dp_shard"]
        return self.dense["dp_shard"]

    @property
    def cp_group(self):
        """The process group of this rank's ``cp`` ranks (one sequence split over them)."""
        return self.dense["cp"].get_group()

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes for routed experts: ``efsdp`` (2-D with ``dp_replicate``)."""
        if self.expert is None:
            return self.fsdp
        if self.dims.dp_replicate > 1:
            return self.expert["dp_replicate", "efsdp"]
        return self.expert["efsdp"]

    @property
    def ep(self) -> DeviceMesh | None:
        return None if self.expert is None else self.expert["ep"]


def build_meshes(dims: ParallelDims, device_type: str = "cpu") -> Meshes:
    """Create the meshes on an initialised default process group whose size is ``dims.world_size``.

    Collective over all ranks (every rank must call it). Raises ``ValueError`` when the process group's size
    differs from ``dims.world_size``.
    """
    world = torch.distributed.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"the process group has {world} ranks but ParallelDims.world_size={dims.world_size}")
    ranks = torch.arange(world)
    dense = DeviceMesh(
        device_type, ranks.view(dims.dp_replicate, dims.dp_shard, dims.cp), mesh_dim_names=MESH_DIMS
    )
    shard_cp = None
    if dims.cp > 1:
        shard_cp = DeviceMesh(
            device_type,
            ranks.view(dims.dp_replicate, dims.dp_shard * dims.cp),
            mesh_dim_names=("dp_replicate", "dp_shard_cp"),
        )
    expert = None
    if dims.ep > 1:
        expert = DeviceMesh(
            device_type, ranks.view(dims.dp_replicate, dims.efsdp, dims.ep), mesh_dim_names=EXPERT_MESH_DIMS
        )
        # the routed experts' gradient norm is partial over efsdp and ep: with this flattened dimension
        # (and its process group) DTensor reduces it with one all-reduce, not one per dimension
        expert["efsdp", "ep"]._flatten(EXPERT_SHARD_DIM)
    return Meshes(dense, expert, dims, shard_cp)
