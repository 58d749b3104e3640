"""Per-Head Muon on sharded parameters: the single-device :class:`~openk3.train.optim.KimiMuon` update.

FSDP2 shards every matrix by rows (``Shard(0)``), and a shard boundary need not fall between head blocks
(a ``[H·d_h, d_in]`` projection over ``W`` ranks splits a head whenever ``H·d_h/W`` is not a multiple of
``d_h``). Newton–Schulz on a shard would orthogonalise the wrong matrix (the ZeRO bug DeepSpeed fixed,
issues #7807/#8090). Here:

* momentum, Nesterov and weight decay run on the local shards (``torch._foreach_*`` on DTensors: momentum
  stays sharded, no communication);
* the update matrix is gathered whole (``DTensor.full_tensor``: one all-gather per parameter), viewed as
  head blocks or experts exactly as on one device, and orthogonalised in the same same-shape buckets,
  so every rank computes the single-device result bit for bit; stacked experts sharded only along the
  expert axis (EP, FSDP dim 0) already hold whole matrices and are orthogonalised where they live;
* each rank keeps the rows of its own shard (``distribute_tensor(..., src_data_rank=None)``: no
  communication) and applies them to its local parameter.

Newton–Schulz runs once per optimizer step, on the gradient accumulated over all micro-batches (the
optimizer only sees ``p.grad`` at ``step``). Every rank runs the NS of every dense matrix (the
``full_tensor`` baseline); owner-based placement (each matrix orthogonalised on one rank, then scattered)
is the next step.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP's dim-0 shard of an EP shard

from openk3.train.optim import KimiMuon, build_optimizer


def whole_matrices_locally(t: DTensor) -> bool:
    """Whether every local shard of ``t`` is a stack of whole matrices: a 3-D expert stack ``[E, F, L]``
    split only along the expert axis (EP ``Shard(0)``, FSDP's dim-0 shards), so Newton–Schulz runs where
    the experts live, with no gather."""
    return t.ndim == 3 and all(
        isinstance(pl, Replicate) or (isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0)
        for pl in t.placements
    )


class ShardedKimiMuon(KimiMuon):
    """:class:`KimiMuon` for DTensor (FSDP2 / EP) parameters; plain tensors are updated as on one device.

    Same constructor, param groups and state dict as :class:`KimiMuon` (state tensors are DTensors with
    the parameter's placements). All ranks of a parameter's mesh must call :meth:`step` together.
    """

    def _whole(self, u: torch.Tensor) -> torch.Tensor:
        if not isinstance(u, DTensor):
            return u
        return u.to_local() if whole_matrices_locally(u) else u.full_tensor()

    def _update_target(self, p: torch.Tensor, o_bMN: torch.Tensor, u_bMN: torch.Tensor):
        if not isinstance(p, DTensor):
            return super()._update_target(p, o_bMN, u_bMN)
        if whole_matrices_locally(p):
            local = p.to_local()
            return local, o_bMN.reshape(local.shape)
        full = o_bMN.reshape(p.shape)
        return p.to_local(), distribute_tensor(
            full, p.device_mesh, p.placements, src_data_rank=None
        ).to_local()


def build_sharded_optimizer(model, **kwargs) -> ShardedKimiMuon:
    """:func:`~openk3.train.optim.build_optimizer`'s groups and settings, as a :class:`ShardedKimiMuon`."""
    single = build_optimizer(model, **kwargs)
    names = set(inspect.signature(KimiMuon.__init__).parameters) - {"self", "params"}
    return ShardedKimiMuon(single.param_groups, **{k: v for k, v in single.defaults.items() if k in names})
