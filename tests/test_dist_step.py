"""The distributed loop's step, audited on a gloo world of one: its collectives and host reads.

A step all-reduces its loss once and reads it on the host once; whether any rank got Ctrl-C/SIGTERM rides
on that same tensor (``[loss, flag]``), so asking costs the step no collective and no host read of its own.
Each ``dist.all_reduce`` and each host read (:class:`~openk3.train.host_syncs.HostSyncAudit`) is recorded
with the openk3 line that made it, over the whole of step 2 (from the start of step 2 to the start of step
3: the loop's step, log line and stop check; no evaluation or save falls in it). A SIGINT sent at the start
of step 3 must then stop the run after that step with a checkpoint.
"""

from __future__ import annotations

import collections
import os
import signal
import traceback
from pathlib import Path

from dist_utils import run_world
from openk3.train.trainer import TrainConfig

TEXT = "ROMEO. But soft, what light through yonder window breaks?\nJULIET. O Romeo, Romeo, wherefore art thou Romeo?\n"


def _caller() -> str:
    """``file:function`` of the innermost openk3 frame of the current stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/openk3/" in path:
            return f"openk3/{path.rsplit('/openk3/', 1)[1]}:{frame.name}"
    return "?"


def _audited_run(rank, world, folder):
    import torch.distributed as dist

    from openk3.dist import train as dist_train
    from openk3.train.host_syncs import HostSyncAudit

    folder = Path(folder)
    config = TrainConfig(
        preset="k3-tiny", data=str(folder / "corpus"), out=str(folder / "run"), steps=6, batch_size=2,
        context_schedule=[(0, 16)], warmup_steps=0, eval_every=100, final_eval_batches=1, save_every=100,
        sample_prompt=None, val_fraction=0.25,
    )  # fmt: skip
    reduces: list[tuple[int, str]] = []
    steps_started = [0]
    audit = HostSyncAudit()
    all_reduce, lr_factor = dist.all_reduce, dist_train.lr_factor

    def counted_all_reduce(*args, **kwargs):
        reduces.append((steps_started[0], _caller()))
        return all_reduce(*args, **kwargs)

    def step_starts(*args, **kwargs):  # the loop calls lr_factor once, first thing in each step
        steps_started[0] += 1
        if steps_started[0] == 2:
            audit.__enter__()
        elif steps_started[0] == 3:
            audit.__exit__(None, None, None)
            os.kill(os.getpid(), signal.SIGINT)  # noted by the handler; step 3 finishes and saves
        return lr_factor(*args, **kwargs)

    dist.all_reduce, dist_train.lr_factor = counted_all_reduce, step_starts
    try:
        summary = dist_train.train_distributed(config)
    finally:
        dist.all_reduce, dist_train.lr_factor = all_reduce, lr_factor
    reads = collections.Counter(where.rsplit(":", 1)[0] for _, where in audit.events)
    return {
        "summary": summary,
        "step2_reduces": collections.Counter(where for step, where in reduces if step == 2),
        "step2_reads": reads["openk3/dist/train.py"],
        "saved": sorted(p.name for p in (folder / "run" / "checkpoints").iterdir()),
    }


def test_the_step_asks_about_a_stop_in_its_loss_all_reduce(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT * 20)
    (out,) = run_world(_audited_run, 1, str(tmp_path), timeout=180, pg_timeout=60)
    # one all-reduce of the loop's own (the step's [loss, flag]); none from StopRequest
    own = {where: n for where, n in out["step2_reduces"].items() if where.startswith("openk3/dist/train.py")}
    assert own == {"openk3/dist/train.py:train_step": 1}, out["step2_reduces"]
    assert out["step2_reads"] == 2, out  # the gradient norm, and the loss with the flags
    # the SIGINT noted at the start of step 3 stopped the run after step 3, saved
    assert out["summary"]["interrupted"] and out["summary"]["step"] == 3, out["summary"]
    assert out["saved"] == ["step-000003"], out["saved"]
