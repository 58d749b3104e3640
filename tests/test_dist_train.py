"""The distributed training loop's final evaluation against the single-process evaluation of the same weights.

A gloo world of 2 trains k3-tiny for 2 steps (FSDP2 over 2 ranks, EP 2) on a small corpus, evaluating a
val subset after step 1 (``val_loss_subset``) and drawing ``loss.png``; the validation loss it reports
after the last step must be the one :func:`openk3.train.trainer.validation_loss` gives for
the final weights on one process, on the same windows. The weights are the Hugging Face folder the loop
exports for the end-of-run sample (``<out>/final``, with the run's tokenizer), cross-checked against the
last DCP checkpoint gathered into one model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import run_world
from openk3.checkpoint import checkpoint_with_tokenizer, from_pretrained
from openk3.data import TokenDataset
from openk3.dist.checkpoint import export_hf, load_checkpoint
from openk3.dist.fsdp import build_sharded_model
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.dist.muon import build_sharded_optimizer
from openk3.dist.train import train_distributed
from openk3.presets import get_preset
from openk3.train.trainer import TrainConfig, validation_loss

TEXT = "ROMEO. But soft, what light through yonder window breaks?\nJULIET. O Romeo, Romeo, wherefore art thou Romeo?\n"


def _train_world(rank, world, folder):
    folder = Path(folder)

    config = TrainConfig(
        preset="k3-tiny",
        data=str(folder / "corpus"),
        out=str(folder / "run"),
        steps=2,
        batch_size=2,
        context_schedule=[(0, 32)],
        warmup_steps=0,
        eval_every=1,
        eval_batches=1,
        final_eval_batches=2,
        save_every=2,
        sample_prompt="ROMEO",
        val_fraction=0.25,
    )
    summary = train_distributed(config, dp_shard=2, ep=2)
    # the last checkpoint, gathered into one single-device model on rank 0
    meshes = build_meshes(ParallelDims(world_size=world, ep=2))
    model = build_sharded_model(get_preset("k3-tiny"), meshes, seed=1, param_dtype=torch.float32)
    load_checkpoint(summary["checkpoint"], model, build_sharded_optimizer(model))
    export_hf(model, folder / "hf")
    if rank:
        return summary
    final = from_pretrained(checkpoint_with_tokenizer(summary["export"])).eval()
    same = all(
        torch.equal(p, q)
        for p, q in zip(final.parameters(), from_pretrained(folder / "hf").parameters(), strict=True)
    )
    loss, tokens = validation_loss(final, TokenDataset(folder / "run" / "data" / "val.bin"), 2, 32, 2)
    return {**summary, "ref_loss": loss, "ref_tokens": tokens, "export_is_checkpoint": same}


@pytest.mark.slow
def test_distributed_final_eval_equals_one_process(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"work{i}.txt").write_text(TEXT * 30)
    results = run_world(_train_world, 2, str(tmp_path), timeout=400, pg_timeout=120)
    r0, r1 = results
    assert r0["val_loss"] == r1["val_loss"], "ranks report different validation losses"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (
        rows[0]["val_subset_tokens"] == 1 * 2 * 32 and rows[0]["val_loss_subset"] > 0
    )  # periodic eval, step 1
    assert rows[-1]["val_loss"] == r0["val_loss"] and "val_loss_subset" not in rows[-1]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert r0["export_is_checkpoint"], "the exported final weights differ from the last checkpoint"
    assert r0["val_tokens"] == r0["ref_tokens"] == 2 * 2 * 32
    assert abs(r0["val_loss"] - r0["ref_loss"]) < 1e-5 * r0["ref_loss"], (r0["val_loss"], r0["ref_loss"])
