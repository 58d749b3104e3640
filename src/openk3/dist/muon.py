"""Per-Head Muon on sharded parameters: the single-device :class:`~openk3.train.optim.KimiMuon` update.

FSDP2 shards every matrix by rows (``Shard(0)``), and a shard boundary need not fall between head blocks
(a ``[H·d_h, d_in]`` projection over ``W`` ranks splits a head whenever ``H·d_h/W`` is not a multiple of
``d_h``). Newton–Schulz on a shard would orthogonalise the wrong matrix (the ZeRO bug DeepSpeed fixed,
issues #7807/#8090). Here, owner-based (Moonlight's distributed Muon with one owner per matrix instead of
every rank; the ``Owned`` compute layout of torchtitan's FlexShard DistMuon):

* momentum, Nesterov and weight decay run on the local shards (``torch._foreach_*`` on DTensors: momentum
  stays sharded, no communication);
* every row-sharded matrix gets one **owner** rank of its shard group, chosen by a deterministic
  longest-processing-time rule from the shapes alone (largest Newton–Schulz cost first, to the least loaded
  rank, ties to the lowest index), so every rank computes the same assignment with no communication;
* one ``all_to_all_single`` per (mesh, dtype) sends each rank's shard of every matrix to its owner; the owner
  reassembles the whole matrix, views it as head blocks or experts exactly as on one device (a head block
  is never cut: the owner holds every row), and orthogonalises its matrices in same-shape buckets;
* the reverse ``all_to_all_single`` sends each rank the rows of its shard, applied to the local parameter.

Each matrix's Newton–Schulz runs once, on one rank (not ``W`` times), and a rank receives only the matrices
it owns plus its own rows back: ``2·(W−1)/W`` of the parameters' bytes move per step over the shard group,
against ``(W−1)`` gathered copies for ``full_tensor`` on every rank. The split sizes are static (shapes),
so there is no host sync. Stacked experts sharded only along the expert axis (EP, FSDP's dim-0 shards)
already hold whole matrices and are orthogonalised where they live, with no communication. With HSDP each
replica group does the same work.

Newton–Schulz runs once per optimizer step, on the gradient accumulated over all micro-batches (the
optimizer only sees ``p.grad`` at ``step``).

Legend: ``W`` ranks of a shard group, ``b, M, N`` NS batch and matrix dims.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
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


def row_shard_dim(t: DTensor) -> int:
    """The mesh dim along which ``t`` is row-sharded (``Shard(0)``; every other mesh dim ``Replicate``).
    Raises ``ValueError`` for another layout (the owner exchange moves whole rows only)."""
    dims = [i for i, pl in enumerate(t.placements) if type(pl) is Shard and pl.dim == 0]
    if len(dims) != 1 or any(
        not isinstance(pl, Replicate) for i, pl in enumerate(t.placements) if i != dims[0]
    ):
        raise ValueError(
            f"distributed Muon takes row-sharded matrices (Shard(0) on one mesh dim, Replicate elsewhere) or "
            f"expert stacks sharded along the expert axis; got placements {t.placements} for shape {tuple(t.shape)}"
        )
    return dims[0]


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` over ``world`` ranks (``torch.chunk``'s split; trailing ranks 0)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(world)]
    return sizes + [0] * (world - len(sizes))


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Owner rank of each matrix: longest processing time first (ties: the earlier matrix), each to the rank
    with the least cost so far (ties: the lowest rank). Deterministic, so every rank agrees."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def _ns_cost(group: dict, shape: torch.Size) -> float:
    """Newton–Schulz cost of one update, ``b·M·N·min(M, N)`` over its ``[b, M, N]`` matrices."""
    b, M, N = KimiMuon._ns_matrices(group, torch.empty(shape, device="meta")).shape
    return float(b * M * N * min(M, N))


class ShardedKimiMuon(KimiMuon):
    """:class:`KimiMuon` for DTensor (FSDP2 / EP) parameters; plain tensors are updated as on one device.

    Same constructor, param groups and state dict as :class:`KimiMuon` (state tensors are DTensors with
    the parameter's placements). All ranks of a parameter's mesh must call :meth:`step` together. Raises
    ``ValueError`` for a DTensor layout other than row shards or expert-axis shards.
    """

    def _muon_step(self, groups: list[dict]) -> None:
        local, owned = [], []
        for group in groups:
            params, updates = self._momentum(group)
            for p, u in zip(params, updates, strict=True):
                if isinstance(p, DTensor) and not whole_matrices_locally(p):
                    owned.append((group, p, u))
                else:
                    local.append((group, p, u.to_local() if isinstance(u, DTensor) else u))
        outs = self._orthogonalise(local)
        entries = [
            (group, *self._update_target(p, o_bMN, u), *o_bMN.shape[-2:])
            for (group, p, u), o_bMN in zip(local, outs, strict=True)
        ]
        by_mesh: dict[tuple, list] = {}
        for group, p, u in owned:
            dim = row_shard_dim(p)
            by_mesh.setdefault((id(p.device_mesh), dim, u.dtype), []).append((group, p, u))
        for (_, dim, _), items in by_mesh.items():
            entries += self._owner_orthogonalise(items, dim)
        self._apply(entries)

    def _owner_orthogonalise(self, items: list, dim: int) -> list[tuple]:
        """Newton–Schulz of row-sharded updates on their owners; returns ``_apply`` entries for this rank."""
        mesh = items[0][1].device_mesh
        pg, W, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
        owners = assign_owners([_ns_cost(g, p.shape) for g, p, _ in items], W)
        rows = [shard_rows(p.shape[0], W) for _, p, _ in items]
        row_numel = [p[0].numel() if p.ndim > 1 else 1 for _, p, _ in items]
        locals_ = [u.to_local() for _, _, u in items]
        mine = [i for i in range(len(items)) if owners[i] == me]
        # to the owners: my rows of every matrix, grouped by owner
        send = [i for o in range(W) for i in range(len(items)) if owners[i] == o]
        send_splits = [
            sum(rows[i][me] * row_numel[i] for i in range(len(items)) if owners[i] == o) for o in range(W)
        ]
        recv_splits = [sum(rows[i][s] * row_numel[i] for i in mine) for s in range(W)]
        dtype, device = locals_[0].dtype, locals_[0].device
        send_buf = (
            torch.cat([locals_[i].reshape(-1) for i in send])
            if send
            else torch.zeros(0, dtype=dtype, device=device)
        )
        recv_buf = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv_buf, send_buf, recv_splits, send_splits, group=pg)
        pieces = [
            recv_buf_s.split([rows[i][s] * row_numel[i] for i in mine])
            for s, recv_buf_s in enumerate(recv_buf.split(recv_splits))
        ]
        whole = [
            torch.cat([pieces[s][j] for s in range(W)]).view(items[i][1].shape) for j, i in enumerate(mine)
        ]
        outs = self._orthogonalise([(items[i][0], items[i][1], u) for i, u in zip(mine, whole, strict=True)])
        # back from the owners: each rank's rows of the orthogonalised matrices
        full = [o.reshape(items[i][1].shape) for i, o in zip(mine, outs, strict=True)]
        back = []
        for s in range(W):
            for j, i in enumerate(mine):
                start = sum(rows[i][:s])
                back.append(full[j][start : start + rows[i][s]].reshape(-1))
        # the outputs are in the NS dtype (bf16 on CUDA); the shards take them back in their own dtype
        back_buf = torch.cat(back).to(dtype) if back else torch.zeros(0, dtype=dtype, device=device)
        got = torch.empty(sum(send_splits), dtype=dtype, device=device)
        dist.all_to_all_single(got, back_buf, send_splits, recv_splits, group=pg)
        got_parts = got.split([rows[i][me] * row_numel[i] for i in send])
        entries = []
        for i, o in zip(send, got_parts, strict=True):
            group, p, _ = items[i]
            M, N = self._ns_matrices(group, torch.empty(p.shape, device="meta")).shape[-2:]  # lr scale
            local = p.to_local()
            entries.append((group, local, o.view(local.shape), M, N))
        return entries

    def _update_target(self, p: torch.Tensor, o_bMN: torch.Tensor, u: torch.Tensor):
        if isinstance(p, DTensor):  # expert stacks that hold whole matrices locally
            local = p.to_local()
            return local, o_bMN.reshape(local.shape)
        return super()._update_target(p, o_bMN, u)


def build_sharded_optimizer(model, **kwargs) -> ShardedKimiMuon:
    """:func:`~openk3.train.optim.build_optimizer`'s groups and settings, as a :class:`ShardedKimiMuon`."""
    single = build_optimizer(model, **kwargs)
    names = set(inspect.signature(KimiMuon.__init__).parameters) - {"self", "params"}
    return ShardedKimiMuon(single.param_groups, **{k: v for k, v in single.defaults.items() if k in names})
