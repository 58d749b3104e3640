"""Expert parallelism (dropless all-to-all dispatcher) against the dense MoE on the concatenated batch.

One world of 2 gloo processes runs every check: the routed experts alone (forward, input and weight
gradients; an expert no token chose keeps a zero gradient), skewed routing (all entries to one rank's
experts), repeated experts within a token, and the whole k3-shaped MoE block with the swap applied from
outside. fp32: the rows each expert sees and the order each token sums its entries are those of the dense
path, so the outputs and gradients must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import nccl_world_available, run_world
from openk3.config import text_config_of
from openk3.dist.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.model.modeling import build_model
from openk3.model.moe import SparseMoeBlock
from openk3.presets import k3_shaped

N = 12  # tokens per rank


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


def _ep_world(rank, world, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    meshes = build_meshes(ParallelDims(world_size=world, ep=world), device.type)
    block = _dense_block(device)
    dense = block.experts
    E, k = dense.w1.shape[0], text_config_of(k3_shaped(4)).num_experts_per_token + 1
    L = dense.w1.shape[2]
    ep = ExpertParallelExperts(dense, meshes.ep).to(device)
    _copy_local(ep, dense)
    out = {}
    rows = slice(rank * N, (rank + 1) * N)
    for case in ("random", "skewed", "repeated"):
        z, w, idx = _routing(case, world, E, k, L, device)
        z_ref, z_ep = z.clone().requires_grad_(), z[rows].clone().requires_grad_()
        dense.zero_grad()
        ep.zero_grad()
        y_ref = dense(z_ref, w, idx)
        y_ref.square().sum().backward()
        y_ep = ep(z_ep, w[rows], idx[rows])
        y_ep.square().sum().backward()
        P = E // world
        out[case] = {
            "y": torch.equal(y_ep, y_ref[rows]),
            "dz": torch.equal(z_ep.grad, z_ref.grad[rows]),
            "dw": all(
                torch.equal(getattr(ep, n).grad.to_local(), getattr(dense, n).grad[rank * P : (rank + 1) * P])
                for n in ("w1", "w3", "w2")
            ),
            "idle_zero": rank != 0 or case != "random" or bool((ep.w1.grad.to_local()[0] == 0).all()),
        }
    # the whole MoE block with the swap applied from outside (router, latent down/up projection, shared experts)
    ep_block = _dense_block(device)
    apply_expert_parallel(ep_block, meshes)
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
    out["block"] = {
        "y": torch.equal(y_ep, y_ref[rank : rank + 1]),
        "dx": torch.equal(x_ep.grad, x_ref.grad[rank : rank + 1]),
        "d_down": torch.allclose(d_down, block.routed_expert_down_proj.weight.grad, rtol=1e-5, atol=1e-7),
    }
    return out


def _check(results):
    for rank, out in enumerate(results):
        for case, checks in out.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, f"rank {rank}, {case}: {failed} differ from the dense MoE"


def test_ep_alltoall_equals_dense_moe():
    _check(run_world(_ep_world, 2, "gloo", timeout=180))


@pytest.mark.gpu
def test_ep_alltoall_equals_dense_moe_nccl():
    reason = nccl_world_available(2)
    if reason:
        pytest.skip(reason)
    _check(run_world(_ep_world, 2, "nccl", backend="nccl", timeout=180))
