"""Expert parallelism, both dispatchers, against the dense MoE on the concatenated batch.

One gloo world (2 processes; 4 in the slow variant) runs every check: the routed experts alone (forward,
input, routing-weight and expert-weight gradients; an expert no token chose keeps a zero gradient) on
random routing, skewed routing (every entry to rank 0's experts: the MoonEP plan must copy them to the other
ranks) and repeated experts within a token, and the whole k3-shaped MoE block with the swap applied from
outside.

* all-to-all: in fp32 the rows each expert sees and the order each token sums its entries are those of the
  dense path, so outputs and gradients must be bitwise equal;
* MoonEP contract: each row's expert output is the dense one, but a token's entries are summed per rank
  first and a redundant expert's weight gradient is summed on two ranks, so equality is up to fp32
  rounding (relative 1e-5), against the dense MoE and against the all-to-all dispatcher. The contract
  itself is checked too: every rank computes exactly ``S·K`` rows, the skewed case uses redundant experts,
  the dedupe sends fewer rows than entries, and unequal ``S`` fails on every rank with one message.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import nccl_world_available, run_world
from openk3.dist.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.dist.moonep import route
from openk3.model.modeling import build_model
from openk3.model.moe import SparseMoeBlock
from openk3.presets import k3_shaped

N = 12  # tokens per rank
K = 4  # experts per token (the k3-shaped block's own top-k is used for the block check)
TOL = dict(rtol=1e-5, atol=1e-6)  # MoonEP: fp32 rounding of the reordered sums


def _dense_block(device):
    model = build_model(k3_shaped(4, vocab_size=256), device=device, seed=0)
    return next(m for m in model.modules() if isinstance(m, SparseMoeBlock))


def _copy_local(ep_experts, dense_experts):
    for name in ("w1", "w3", "w2"):
        getattr(ep_experts, name).to_local().data.copy_(
            getattr(dense_experts, name)
            .detach()
            .chunk(ep_experts.ep_mesh.size())[ep_experts.ep_mesh.get_local_rank()]
        )


def _routing(case, world, E, k, L, device):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(world * N, L, generator=g)
    w = torch.rand(world * N, k, generator=g)
    if case == "random":
        idx = torch.stack(
            [torch.randperm(E - 1, generator=g)[:k] + 1 for _ in range(world * N)]
        )  # expert 0 idle
    elif case == "skewed":
        idx = torch.stack(
            [torch.randperm(E // world, generator=g)[:k] for _ in range(world * N)]
        )  # rank 0 only
    else:  # repeated experts within a token
        idx = torch.randint(0, E, (world * N, k), generator=g)
        idx[:, -1] = idx[:, 0]
    return z.to(device), w.to(device), idx.to(device)


def _run(experts, z, w, idx):
    """Output and the gradients of ``z``, ``w`` and the expert weights (local rows) of one fwd+bwd."""
    z, w = z.clone().requires_grad_(), w.clone().requires_grad_()
    experts.zero_grad()
    y = experts(z, w, idx)
    y.square().sum().backward()
    grads = [getattr(experts, n).grad for n in ("w1", "w3", "w2")]
    return y.detach(), z.grad, w.grad, [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def _compare(got, ref, exact):
    """Per quantity, whether ``got`` equals ``ref`` (bitwise, or within :data:`TOL`)."""
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, **TOL))
    names = ("y", "dz", "dweights")
    checks = {n: same(a, b) for n, a, b in zip(names, got[:3], ref[:3], strict=True)}
    checks["dw_experts"] = all(same(a, b) for a, b in zip(got[3], ref[3], strict=True))
    return checks


def _ep_world(rank, world, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    meshes = build_meshes(ParallelDims(world_size=world, ep=world), device.type)
    block = _dense_block(device)
    dense = block.experts
    E, L = dense.w1.shape[0], dense.w1.shape[2]
    P = E // world
    mine = slice(rank * P, (rank + 1) * P)
    eps = {}
    for name in ("alltoall", "moonep"):
        eps[name] = ExpertParallelExperts(dense, meshes.ep, dispatcher=name).to(device)
        _copy_local(eps[name], dense)
    out = {}
    rows = slice(rank * N, (rank + 1) * N)
    group = meshes.ep.get_group()
    for case in ("random", "skewed", "repeated"):
        z, w, idx = _routing(case, world, E, K, L, device)
        y, dz, dw, dexp = _run(dense, z, w, idx)
        ref = (y[rows], dz[rows], dw[rows], [g[mine] for g in dexp])
        a2a = _run(eps["alltoall"], z[rows], w[rows], idx[rows])
        moon = _run(eps["moonep"], z[rows], w[rows], idx[rows])
        out[f"alltoall {case}"] = _compare(a2a, ref, exact=True)
        out[f"moonep {case} vs dense"] = _compare(moon, ref, exact=False)
        out[f"moonep {case} vs alltoall"] = _compare(moon, a2a, exact=False)
        r = route(idx[rows], E, group)
        out[f"moonep {case} contract"] = {
            "S·K rows": sum(r.slot_sizes) == N * K and sum(r.recv_entries) == N * K,
            "dedupe": sum(r.send_rows) <= N * K and (case == "skewed" or sum(r.send_rows) < N * K),
            "redundant": case != "skewed" or int(r.plan.donor_R.max()) >= 0,
        }
        if case == "random" and rank == 0:  # expert 0 was never chosen
            out["idle expert"] = {
                n: bool((g[0] == 0).all()) for n, g in (("a2a", a2a[3][0]), ("moon", moon[3][0]))
            }
    try:  # unequal S·K: every rank fails with the same message, none hangs
        eps["moonep"](z[rows][: N - rank], w[rows][: N - rank], idx[rows][: N - rank])
        out["unequal S"] = {"raised": False}
    except ValueError as err:
        out["unequal S"] = {"raised": "same S·K entries on every EP rank" in str(err)}
    # the whole MoE block with the swap applied from outside (router, latent down/up projection, shared experts)
    ep_block = _dense_block(device)
    apply_expert_parallel(ep_block, meshes, dispatcher="moonep")
    ep_block.experts.to(device)
    _copy_local(ep_block.experts, block.experts)
    x = torch.randn(world, N, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(
        device
    )
    x_ref, x_ep = x.clone().requires_grad_(), x[rank : rank + 1].clone().requires_grad_()
    block.zero_grad()
    y_ref = block(x_ref)
    y_ref.square().sum().backward()
    y_ep = ep_block(x_ep)
    y_ep.square().sum().backward()
    d_down = ep_block.routed_expert_down_proj.weight.grad.clone()
    torch.distributed.all_reduce(d_down)  # dense parameters see every rank's tokens (FSDP's reduction)
    out["moonep block"] = {
        "y": torch.allclose(y_ep, y_ref[rank : rank + 1], **TOL),
        "dx": torch.allclose(x_ep.grad, x_ref.grad[rank : rank + 1], **TOL),
        "d_down": torch.allclose(d_down, block.routed_expert_down_proj.weight.grad, **TOL),
    }
    return out


def _check(results):
    for rank, out in enumerate(results):
        for case, checks in out.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, f"rank {rank}, {case}: {failed} differ from the dense MoE"


def test_ep_dispatchers_equal_dense_moe():
    _check(run_world(_ep_world, 2, "gloo", timeout=180))


@pytest.mark.slow
def test_ep_dispatchers_equal_dense_moe_world4():
    _check(run_world(_ep_world, 4, "gloo", timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])  # 16 experts: 8, 4 and 2 per rank
def test_ep_dispatchers_equal_dense_moe_nccl(world):
    reason = nccl_world_available(world)
    if reason:
        pytest.skip(reason)
    _check(run_world(_ep_world, world, "nccl", backend="nccl", timeout=180))
