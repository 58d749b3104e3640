"""Mesh validation (no processes) and the official K3 layout on a fake process group (one process).

The fake backend (``torch.testing._internal.distributed.fake_pg``) lets one process build the real
DeviceMeshes and DTensor placements of a large world; its collectives do nothing, so only shapes and
placements are checked here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from openk3.dist.mesh import ParallelDims
from openk3.dist.plan import plan
from openk3.presets import get_preset


def test_dims_fill_and_efsdp():
    dims = ParallelDims(world_size=2048, dp_replicate=4, ep=64)
    assert (dims.dp_shard, dims.efsdp) == (512, 8)
    dims.check_model(get_preset("kimi-k3").text_config)  # 896 experts / 64 = 14 per rank


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=8, dp_shard=3), r"dp_replicate·dp_shard·cp = 1·3·1 = 3 but world_size=8"),
        (dict(world_size=6, dp_replicate=4), r"world_size=6 is not divisible by dp_replicate·cp = 4·1"),
        (dict(world_size=8, ep=3), r"ep=3 must divide dp_shard·cp = 8·1 = 8"),
        (dict(world_size=6, cp=4), r"world_size=6 is not divisible by dp_replicate·cp = 1·4"),
        (dict(world_size=8, dp_shard=2, cp=2), r"dp_replicate·dp_shard·cp = 1·2·2 = 4 but world_size=8"),
        (dict(world_size=0), r"world_size=0 must be a positive integer"),
    ],
)
def test_dims_errors_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_experts_not_divisible_by_ep():
    ParallelDims(world_size=2048, ep=128).check_model(get_preset("kimi-k3").text_config)  # 896 = 7·128
    with pytest.raises(ValueError, match=r"num_experts=896 is not divisible by ep=256"):
        ParallelDims(world_size=2048, ep=256).check_model(get_preset("kimi-k3").text_config)


FAKE_WORLD = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from openk3.dist.mesh import ParallelDims, build_meshes
    from openk3.dist.expert_parallel import apply_expert_parallel
    from openk3.model.modeling import build_model
    from openk3.model.moe import SparseMoeBlock
    from openk3.presets import get_preset

    dist.init_process_group("fake", store=FakeStore(), rank=70, world_size=512)
    dims = ParallelDims(world_size=512, dp_shard=512, ep=64)
    meshes = build_meshes(dims)
    model = build_model(get_preset("kimi-k3"), device="meta")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    apply_expert_parallel(model, meshes)
    w1 = blocks[0].experts.w1
    local = sum(getattr(b.experts, w).to_local().numel() for b in blocks for w in ("w1", "w3", "w2"))
    print(len(blocks), tuple(w1.shape), tuple(w1.to_local().shape), w1.placements,
          meshes.ep.get_local_rank(), meshes.expert_fsdp.size(), meshes.fsdp.size(), local)
    """
)


def test_kimi_k3_expert_layout_on_fake_world():
    """512 ranks, ep = 64: each of the 92 MoE blocks' experts is a [896, 3072, 3584] DTensor, 14 local per
    rank (rank 70 is EP rank 6 of its group); experts shard over efsdp = 8, the rest over 512."""
    out = subprocess.run([sys.executable, "-c", FAKE_WORLD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip()
    assert line.startswith("92 (896, 3072, 3584) (14, 3072, 3584) (Shard(dim=0),) 6 8 512"), line
    # openk3 plan's expert share agrees with the real EP placements (before FSDP's efsdp split)
    budget = plan(get_preset("kimi-k3"), ParallelDims(world_size=512, dp_shard=512, ep=64), 4096)
    assert budget.expert_params // 64 == int(line.split()[-1])
    assert budget.experts_per_rank == 14


def test_plan_small_model_by_hand():
    """k3-shaped depth 4 on 2 GPUs, no EP: every share is half the model; the numbers by hand."""
    from openk3.model.modeling import build_model
    from openk3.presets import k3_shaped
    from openk3.train.optim import partition_parameters

    config = k3_shaped(4, vocab_size=256)
    model = build_model(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    adamw = sum(
        p.numel()
        for n, p in model.named_parameters()
        for r in partition_parameters(model)
        if r.name == n and r.kind == "adamw"
    )
    b = plan(config, ParallelDims(world_size=2), tokens_per_gpu=64)
    assert b.params_bytes == b.grads_bytes == 4 * total / 2
    assert b.optimizer_bytes == 4 * (total + adamw) / 2  # Muon: 1 value, AdamW: 2 values per parameter
    assert b.ep_comm_bytes == 0
    assert b.ep_buffer_bytes == 64 * 1 * 64 * 2  # S·K rows (K = 1) of the latent width 64, bf16
    assert b.fsdp_comm_bytes == (2 * 2 + 4) * total / 2  # gathers fwd+bwd (bf16), reduce-scatter (fp32)
