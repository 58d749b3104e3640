"""A distributed run's checkpoint retention and its resume after a lost rank, on a gloo world of 2.

k3-tiny (FSDP2 over 2 ranks, EP 2) trains 5 of 6 steps saving every 2 steps (and at its last): only the two
newest DCP checkpoints may stay, as in a single-process run. Then the world "loses a rank" after step 5 but
before its save (the step-5 checkpoint is removed, and a half-written ``.tmp`` of a later save is left), and
the run resumes from step 4: ``metrics.jsonl`` must hold each step once, the rows past the checkpoint dropped.
Rank 0 writes ``train_config.json`` (``openk3 eval`` of the run's checkpoints reads its windows from it) and
says where the resume starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

from dist_utils import run_world
from openk3.cli import main
from openk3.dist.train import train_distributed
from openk3.train.trainer import TrainConfig

TEXT = "ROMEO. But soft, what light through yonder window breaks?\nJULIET. O Romeo, Romeo, wherefore art thou Romeo?\n"


def _config(folder: Path, **kw) -> TrainConfig:
    return TrainConfig(
        preset="k3-tiny",
        data=str(folder / "corpus"),
        out=str(folder / "run"),
        steps=6,
        batch_size=2,
        context_schedule=[(0, 16)],
        warmup_steps=0,
        eval_every=100,
        final_eval_batches=1,
        save_every=2,
        sample_prompt=None,
        val_fraction=0.25,
        **kw,
    )


def _steps_logged(folder: Path) -> list[int]:
    lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())


def _retain_then_resume(rank, world, folder):
    import torch.distributed as dist

    folder = Path(folder)
    first = train_distributed(_config(folder, stop_at_step=5), dp_shard=2, ep=2)
    seen = {"first": first["step"], "after_first": _checkpoints(folder), "logged": _steps_logged(folder)}
    seen["train_config"] = json.loads((folder / "run" / "train_config.json").read_text())
    try:  # a fresh start into the run's folder (--resume forgotten) would prune its checkpoints
        train_distributed(_config(folder), dp_shard=2, ep=2)
    except ValueError as e:
        seen["fresh_start"] = str(e)
    seen["after_fresh_start"] = _checkpoints(folder), _steps_logged(folder)
    dist.barrier()
    if rank == 0:  # the rank lost after step 5, before its save finished: a torn .tmp, no step-000005
        ckpts = folder / "run" / "checkpoints"
        shutil.rmtree(ckpts / "step-000005")
        shutil.copytree(ckpts / "step-000004", ckpts / "step-000005.tmp")
    dist.barrier()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        second = train_distributed(_config(folder), dp_shard=2, ep=2, resume=True)
    dist.barrier()
    return {
        **seen,
        "second": second["step"],
        "after_second": _checkpoints(folder),
        "final": _steps_logged(folder),
        "printed": printed.getvalue().splitlines(),
    }


def test_distributed_run_keeps_two_checkpoints_and_resume_drops_rows_past_it(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"work{i}.txt").write_text(TEXT * 20)
    r0, r1 = run_world(_retain_then_resume, 2, str(tmp_path), timeout=400, pg_timeout=120)
    assert r0["first"] == 5 and r0["logged"] == [1, 2, 3, 4, 5]
    # rank 0 wrote the run's train config, as a single-process run does (a distributed one wrote none)
    assert r0["train_config"] == json.loads(json.dumps(dataclasses.asdict(_config(tmp_path, stop_at_step=5))))
    assert r0["after_first"] == ["step-000004", "step-000005"], r0["after_first"]
    # without --resume the world is refused on every rank, before it touches the run
    refusal = (
        f"{tmp_path / 'run'} already holds a run with checkpoints: continue it with --resume and "
        "--nproc-per-node as it was started (a distributed run), or choose another --out"
    )
    assert r0["fresh_start"] == r1["fresh_start"] == refusal
    assert r0["after_fresh_start"] == (r0["after_first"], [1, 2, 3, 4, 5])
    # resumed from step 4 (the .tmp of the lost save is not a checkpoint), each step logged once
    assert r0["second"] == 6
    assert r0["final"] == [1, 2, 3, 4, 5, 6], r0["final"]
    assert r0["after_second"] == ["step-000004", "step-000006"], r0["after_second"]
    # the resume says where it starts, on rank 0 alone (it printed nothing of it)
    run = tmp_path / "run"
    resuming = f"resuming {run} at step 4 from {run / 'checkpoints' / 'step-000004'}"
    assert r0["printed"][0] == resuming, r0["printed"]
    assert not any(line.startswith("resuming") for line in r1["printed"]), r1["printed"]
    # `openk3 eval` of a step or of the final export reads the run's windows (16 tokens, 2 a batch), not
    # its default of 256-token windows
    for ckpt in (run / "checkpoints" / "step-000006", run / "final"):
        assert main(["eval", "--ckpt", str(ckpt), "--max-batches", "1"]) == 0
        assert "(32 tokens, " in capsys.readouterr().out
