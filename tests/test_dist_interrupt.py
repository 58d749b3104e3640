"""Ctrl-C under ``openk3 train --nproc-per-node 2``: the ranks finish their step, save a checkpoint and stop.

The launcher runs in its own session and gets SIGINT alone, as from a terminal (the ranks it starts are in
sessions of their own, so only the agent's forwarded signal reaches them). The run must end with exit status
130, a finished DCP checkpoint of the step it stopped after (not the periodic one: ``--save-every`` is past
the run), rank 0's line naming it, and a resume that continues from that step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openk3

ENV = {**os.environ, "PYTHONPATH": str(Path(openk3.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
TEXT = "ROMEO. But soft, what light through yonder window breaks?\nJULIET. O Romeo, Romeo, wherefore art thou Romeo?\n"


def test_ctrl_c_under_the_launcher_saves_the_step_and_resumes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT * 40)
    run = tmp_path / "run"
    args = ["--preset", "k3-tiny", "--out", str(run), "--data", str(corpus), "--dp-shard", "2",
            "--batch-size", "2", "--context-schedule", "0:16", "--save-every", "1000", "--no-sample"]  # fmt: skip
    cmd = [sys.executable, "-m", "openk3", "train", "--nproc-per-node", "2", *args]
    proc = subprocess.Popen(
        [*cmd, "--steps", "1000"], env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # rank 0 prints "step N ..." after each step
            line = proc.stdout.readline()
            if line.startswith("step 2 "):
                break
            assert line or proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "SIGINT received: the 2 ranks were stopped" in err
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and (run / "checkpoints" / saved[0] / "meta.json").is_file(), saved
    step = int(saved[0].removeprefix("step-"))
    assert step >= 2 and f"stopped after step {step}, checkpoint saved" in out, out
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))
    # the same command with --resume continues from that step
    resumed = subprocess.run(
        [*cmd, "--steps", str(step + 1), "--resume"], env=ENV, cwd=tmp_path, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 2))
