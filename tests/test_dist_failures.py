"""A rank that dies mid-step: the launcher names it, the survivor fails within the collective timeout
instead of hanging, and the last checkpoint stays intact (the interrupted save never appears under its
final name)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from dist_utils import run_world
from openk3.dist.checkpoint import save_checkpoint
from openk3.dist.fsdp import build_sharded_model
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.dist.muon import build_sharded_optimizer
from openk3.presets import k3_shaped


def _dies_mid_save(rank, world, folder):
    meshes = build_meshes(ParallelDims(world_size=world))
    model = build_sharded_model(k3_shaped(4, vocab_size=256), meshes, "cpu", param_dtype=torch.float32)
    opt = build_sharded_optimizer(model)
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    save_checkpoint(folder, 1, model, opt)
    if rank == 1:
        os._exit(3)  # lost mid-step: the next collective never gets this rank
    start = time.monotonic()
    error = None
    try:
        save_checkpoint(folder, 2, model, opt)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        error = str(e)
    seconds = time.monotonic() - start
    (Path(folder) / "rank0.json").write_text(json.dumps({"error": error, "seconds": seconds}))


def test_rank_dies_mid_save(tmp_path):
    try:
        run_world(_dies_mid_save, 2, str(tmp_path), timeout=200, pg_timeout=20)
    except AssertionError as e:
        report = str(e)
    else:
        raise AssertionError("the world finished although rank 1 died")
    assert "ranks [1] of 2 exited without a result (exit codes {1: 3})" in report, report
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    # the survivor fails at once (gloo: "Connection reset by peer"), well within its 20 s collective timeout;
    # gloo's message names the peer's address, not its rank: the launcher names the rank (line above)
    assert rank0["error"] is not None and rank0["seconds"] < 20, rank0
    assert (tmp_path / "step-000001" / "meta.json").is_file(), "the last finished checkpoint is gone"
    assert not (tmp_path / "step-000002").exists(), "an interrupted save appeared under its final name"
    assert sorted(p.name for p in tmp_path.glob("step-*") if not p.name.endswith(".tmp")) == ["step-000001"]
