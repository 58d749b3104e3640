"""Distributed Per-Head Muon and Quantile Balancing against one process, in one gloo world of 2.

* Muon (world 2; world 4 in the slow variant): a module with a per-head projection ``[6, 4]`` of 3 heads (FSDP's ``Shard(0)`` at world 2 puts rows
  0-2 and 3-5 on the two ranks, so head 1, rows 2-3, straddles the boundary), an uneven plain matrix
  ``[5, 3]``, stacked experts ``[4, 3, 5]`` and an AdamW vector, trained 3 steps. Gradient accumulation
  1: bitwise equal to :class:`KimiMuon` on one process (``(g₀+g₁)/2 = g₀/2 + g₁/2`` exactly, NS on the
  same whole matrices). Accumulation 4: within fp32 roundings of accumulation 1 (a Newton–Schulz per
  micro-batch would move the parameters by ~1e-2). A Newton–Schulz on the shards is checked to differ,
  so the test can see a split head. Owner-based: the matrices each rank orthogonalises, summed over the
  ranks, are exactly the single-device ones (each once, none on two ranks).
* Quantile Balancing: the router biases after one step of the balancer over the data group equal one
  process observing both ranks' micro-batches (integer histograms, same fp64 arithmetic): bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from dist_utils import nccl_world_available, run_world
from openk3.dist.balance import data_process_group
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.dist.muon import ShardedKimiMuon, assign_owners, shard_rows
from openk3.model.modeling import build_model
from openk3.presets import k3_shaped
from openk3.train.balance import QuantileBalancer
from openk3.train.optim import KimiMuon

STEPS, BATCH = 3, 8


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads = nn.Parameter(torch.randn(6, 4, generator=g))
        self.plain = nn.Parameter(torch.randn(5, 3, generator=g))
        self.experts = nn.Parameter(torch.randn(4, 3, 5, generator=g))
        self.bias = nn.Parameter(torch.randn(5, generator=g))

    def forward(self, x_B4):
        h_B6 = torch.tanh(x_B4 @ self.heads.t())
        h_B5 = torch.tanh(h_B6[:, :3] @ self.plain.t() + self.bias)
        return sum((torch.tanh(h_B5 @ self.experts[e].t()) ** 2).mean() for e in range(4))


def _groups(model):
    return [
        dict(params=[model.heads], kind="muon_per_head", heads=3),
        dict(params=[model.plain, model.experts], kind="muon"),
        dict(params=[model.bias], kind="adamw", weight_decay=0.0),
    ]


def _data(world):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(world * BATCH, 4, generator=g) for _ in range(STEPS)]


def _train(model, opt, batches, parts, scale):
    for x in batches:
        opt.zero_grad(set_to_none=True)
        for chunk in x.chunk(parts):
            (model(chunk) * scale / parts).backward()
        opt.step()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


class _CountNS:
    """Wraps ``optim.newton_schulz``: records the ``[M, N]`` shape of every matrix it orthogonalises."""

    def __init__(self, fn):
        self.fn, self.shapes = fn, []

    def __call__(self, G, *args):
        self.shapes += [tuple(G.shape[-2:])] * (G.numel() // (G.shape[-2] * G.shape[-1]))
        return self.fn(G, *args)


def _muon_checks(rank, world, mesh):
    import openk3.train.optim as optim

    kwargs = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    ref = Toy()
    counter = optim.newton_schulz = _CountNS(optim.newton_schulz)
    ref_params = _train(ref, KimiMuon(_groups(ref), **kwargs), _data(world), world, 1.0)
    out = {"ns_single": sorted(counter.shapes)}
    counter.shapes = []
    for accum in (1, 4):
        model = Toy()
        fully_shard(model, mesh=mesh)
        local = [x.chunk(world)[rank] for x in _data(world)]
        params = _train(model, ShardedKimiMuon(_groups(model), **kwargs), local, accum, 1.0)
        out[accum] = max((p - q).abs().max().item() for p, q in zip(params, ref_params, strict=True))
        if accum == 1:
            out["ns_mine"], counter.shapes = counter.shapes, []
    optim.newton_schulz = counter.fn
    if world != 2:  # the shards are 2, 2, 2, 0 rows: whole heads, nothing to show
        return out
    # the same step with Newton–Schulz on each rank's rows would be wrong: show the test sees the split head
    model = Toy()
    fully_shard(model, mesh=mesh)
    model(_data(world)[0].chunk(world)[rank]).backward()
    _shard_step(model.heads, kwargs)
    ref2 = Toy()
    ref2_opt = KimiMuon([dict(params=[ref2.heads], kind="muon_per_head", heads=3)], **kwargs)
    for chunk in _data(world)[0].chunk(world):
        (ref2(chunk) / world).backward()
    ref2_opt.step()
    out["naive"] = (model.heads.full_tensor() - ref2.heads.detach()).abs().max().item()
    return out


def _shard_step(p, kwargs):
    """Newton–Schulz on this rank's rows of ``p`` (what a shard-unaware optimizer would do)."""
    local = p.to_local()
    shadow = nn.Parameter(local.detach().clone())
    shadow.grad = p.grad.to_local()
    KimiMuon([dict(params=[shadow], kind="muon")], **kwargs).step()
    local.data.copy_(shadow.detach())


def _qb_checks(rank, world, group):
    """Biases after one balancer step: this rank's micro-batch reduced over ``group`` vs one process that
    observes every rank's micro-batch (reduced over a group of itself alone)."""
    config = k3_shaped(4, vocab_size=256)
    ids = torch.randint(0, 256, (world * 2, 16), generator=torch.Generator().manual_seed(5))
    solo, _ = torch.distributed.new_subgroups(group_size=1)
    biases = []
    for chunks, pg in (([ids.chunk(world)[rank]], group), (ids.chunk(world), solo)):
        model = build_model(config, seed=0)
        balancer = QuantileBalancer(model, process_group=pg)
        with torch.no_grad():
            for chunk in chunks:
                model(chunk)  # training mode: each MoE block counts its routing
        balancer.step()
        biases.append(torch.cat([block.gate.e_score_correction_bias for block in balancer.blocks]))
    return torch.equal(biases[0], biases[1]) and bool(biases[0].abs().sum() > 0)


def _optim_world(rank, world, backend):
    device_type = "cuda" if backend == "nccl" else "cpu"
    meshes = build_meshes(ParallelDims(world_size=world), device_type)
    out = _muon_checks(rank, world, meshes.fsdp)
    out["qb"] = _qb_checks(rank, world, data_process_group(meshes))
    return out


def _check(results, world):
    # owner-based: over the ranks, every matrix is orthogonalised exactly once (the experts where they live)
    done = sorted(shape for out in results for shape in out["ns_mine"])
    assert done == results[0]["ns_single"], "the ranks' Newton–Schulz matrices are not the single-device ones"
    for out in results:
        # world 2: bitwise; world 4: gloo sums four gradients in its own order (fp32 rounding, ≤ 1.2e-7 seen)
        assert out[1] <= (0.0 if world == 2 else 1e-6), (
            f"accumulation 1 differs from one process by {out[1]:.3g}"
        )
        assert out[4] < 1e-6, f"accumulation 4 differs from one process by {out[4]:.3g}"
        if world == 2:
            assert out["naive"] > 1e-3, "NS on shards matched: the test cannot see a split head"
        assert out["qb"], "QB biases differ from one process"


def test_sharded_muon_and_qb_equal_one_process():
    _check(run_world(_optim_world, 2, "gloo", timeout=180), 2)


@pytest.mark.slow
def test_sharded_muon_and_qb_equal_one_process_world4():
    """World 4: rank 3 holds no row of the head projection and of the plain matrix (owners still get them)."""
    _check(run_world(_optim_world, 4, "gloo", timeout=300), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])  # the test's stacked experts [4, 3, 5] have 4 rows to shard
def test_sharded_muon_and_qb_equal_one_process_nccl(world):
    reason = nccl_world_available(world)
    if reason:
        pytest.skip(reason)
    _check(run_world(_optim_world, world, "nccl", backend="nccl", timeout=180), world)


def test_owner_assignment_and_row_split():
    # longest first to the least loaded rank, ties to the lowest index: [9, 5, 5, 4, 1] over 2 ranks
    assert assign_owners([5.0, 9.0, 5.0, 4.0, 1.0], 2) == [1, 0, 1, 0, 1]
    assert assign_owners([1.0, 1.0, 1.0], 4) == [0, 1, 2]
    # torch.chunk's split (FSDP2's Shard(0)): 6 rows over 4 ranks is 2, 2, 2, 0
    assert shard_rows(6, 4) == [2, 2, 2, 0]
    assert shard_rows(5, 2) == [3, 2]
