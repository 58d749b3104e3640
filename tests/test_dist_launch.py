"""Bad input under torch's elastic agent: one ``openk3: error:`` line from rank 0, not one per rank, no rank
left waiting in a collective, exit status 2 (under ``openk3 train --nproc-per-node`` the launcher prints that
line, its ranks none, whichever rank the agent saw end first), while plain torchrun's own report carries the
message instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import openk3
from dist_utils import run_world
from openk3 import cli
from openk3.cli import main
from openk3.dist.launch import PEER_LOST_EXIT, failure_report
from openk3.dist.rank_zero import on_rank_zero

ENV = {**os.environ, "PYTHONPATH": str(Path(openk3.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
TINY = ["--preset", "k3-tiny", "--dp-shard", "2", "--steps", "2", "--no-sample"]


def _run(cmd: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    # a rank left waiting would hang the world: the timeout turns that into a failure
    return subprocess.run(cmd, env={**ENV, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # two ranks of torch imports on 2 cores: 15-30 s
def test_launcher_reports_a_missing_data_folder_in_one_line(tmp_path):
    """One line, exit status 2, and nothing left in the temporary directory (the agent's log folder)."""
    missing, tmp = tmp_path / "no-such-corpus", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "openk3", "train", "--nproc-per-node", "2", "--out", str(tmp_path / "run"),
           "--data", str(missing), *TINY]  # fmt: skip
    done = _run(cmd, tmp_path, TMPDIR=str(tmp))
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"openk3: error: input path does not exist: {str(missing)!r}\n", done.stderr
    assert done.stdout == ""
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "openk3-launch-"))]
    assert left == []  # (torch's own compile cache, torchinductor_USER, is not the launcher's)


@pytest.mark.slow  # two ranks of torch imports on 2 cores: 15-30 s
def test_torchrun_prints_a_bad_config_value_once(tmp_path):
    """``--batch-size 3`` over 2 data ranks is refused by every rank: one rank prints it, no rank prints
    a traceback, and torchrun's report shows the message (from the ranks' error files)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: a small corpus for two ranks.\n" for i in range(400)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "openk3", "train",
           "--out", str(tmp_path / "run"), "--data", str(corpus), "--batch-size", "3", *TINY]  # fmt: skip
    done = _run(cmd, tmp_path)
    text = (
        "--batch-size 3 (global sequences per micro-batch) is not divisible by the 2 data ranks (world_size=2 "
        "/ cp=1)"
    )
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("openk3: error:")]
    assert lines == [f"openk3: error: {text}"], done.stderr
    assert f"traceback : ValueError: {text}" in done.stderr, done.stderr  # torchrun's root cause
    assert "[rank0]" not in done.stderr and "[rank1]" not in done.stderr, done.stderr  # no rank's traceback
    assert not (tmp_path / "run" / "data").exists()  # refused before the corpus was prepared


def test_the_first_rank_to_fail_prints_bad_input_and_the_others_record_it(tmp_path, monkeypatch, capsys):
    """Under the agent the first rank of a node to fail prints argparse's line or a command's error, whichever
    rank it is (torchrun may stop rank 0 before it prints); the later ranks print nothing. Every rank records
    the error in its own error file, where the launcher reads it; under openk3's own launcher no rank
    prints."""
    attempt = tmp_path / "run-id" / "attempt_0"  # torchrun's layout: attempt_N/<local rank>/error.json
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")

    def as_rank(rank: int) -> Path:
        (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(rank) / "error.json"))
        return attempt / str(rank) / "error.json"

    as_rank(1)  # rank 1 fails first: it prints
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--lr", "nan"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("openk3 train: error: argument --lr")
    error_file = as_rank(0)  # rank 0 fails second: silent, its error in its file
    assert main(["train", "--nproc-per-node", "2"]) == 2  # a ValueError: the launcher under the agent
    assert capsys.readouterr().err == ""
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == (
        "ValueError: --nproc-per-node starts the ranks itself: run it without torchrun"
    )
    assert "Traceback" not in message["extraInfo"]["py_callstack"]

    def ctrl_c(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", ctrl_c)  # Ctrl-C reaches every rank: the first to stop says so
    attempt = tmp_path / "run-id" / "attempt_1"  # a restarted attempt starts with no marker
    as_rank(0)
    assert main(["info"]) == 130 and capsys.readouterr().err == "openk3: interrupted\n"
    as_rank(1)
    assert main(["info"]) == 130 and capsys.readouterr().err == ""
    attempt = tmp_path / "run-id" / "attempt_2"
    as_rank(0)
    monkeypatch.setenv("OPENK3_LAUNCHER", "1")  # started by `openk3 train --nproc-per-node`: nobody prints
    assert main(["train", "--nproc-per-node", "2"]) == 2 and capsys.readouterr().err == ""
    assert main(["info"]) == 130 and capsys.readouterr().err == ""
    monkeypatch.delenv("OPENK3_LAUNCHER")  # plain torchrun: the first rank prints
    assert main(["train", "--nproc-per-node", "2"]) == 2
    assert capsys.readouterr().err == (
        "openk3: error: --nproc-per-node starts the ranks itself: run it without torchrun\n"
    )
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # no error file: rank 0 alone prints
    monkeypatch.setenv("RANK", "1")
    assert main(["info"]) == 130 and capsys.readouterr().err == ""


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, timestamp: int) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    if message is not None:
        body = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(timestamp)}}
        error_file.write_text(json.dumps({"message": body}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_failure_report_prints_the_first_bad_input_once(tmp_path):
    bad = "FileNotFoundError: input path does not exist: 'x'"
    line = "openk3: error: input path does not exist: 'x'"  # the message without the type
    stopped_by_agent = _failure(tmp_path, 1, -15, None, 11)
    # rank 0 stopped on bad input; rank 1 was stopped by the agent
    assert failure_report({0: _failure(tmp_path, 0, 2, bad, 10), 1: stopped_by_agent}) == (2, line)
    # rank 1 ended first on the same input, rank 0 was stopped before it got there
    only_rank_1 = {1: _failure(tmp_path, 1, 2, bad, 10), 0: _failure(tmp_path, 0, -15, None, 12)}
    assert failure_report(only_rank_1) == (2, line)
    # both ended on it: one line, the first rank's
    other = "ValueError: --batch-size 3 is not divisible"
    both = {0: _failure(tmp_path, 0, 2, other, 12), 1: _failure(tmp_path, 1, 2, bad, 10)}
    assert failure_report(both) == (2, line)
    # a crash: which rank, how, and its message
    code, line = failure_report({1: _failure(tmp_path, 1, 1, "RuntimeError: boom", 10)})
    assert (code, line) == (1, "openk3: error: rank 1 failed (exit code 1): RuntimeError: boom")
    code, line = failure_report({0: _failure(tmp_path, 0, -9, None, 10)})
    assert code == 1 and line.startswith("openk3: error: rank 0 failed (exit code -9, SIGKILL): "), line


def test_failure_report_names_the_dead_rank_not_the_one_that_lost_it(tmp_path):
    """A rank whose collective lost its peer records its line before the agent sees the dead rank (a failure
    without an error file is dated when the agent sees it): the report still names the dead rank. With no
    other failure (a peer that hangs until the collective timeout), the lost peer's own line."""
    text = (
        "rank 0 stopped: it lost its connection to another rank, which died or was killed (Connection reset)"
    )
    survivor = _failure(tmp_path, 0, PEER_LOST_EXIT, f"LostPeerError: {text}", 10)
    killed = _failure(tmp_path, 1, -9, None, 0)  # dated now, long after the survivor's 10
    assert failure_report({0: survivor, 1: killed}) == (
        1, "openk3: error: rank 1 failed (exit code -9, SIGKILL): Signal 9 (SIGKILL) received by PID 101"
    )  # fmt: skip
    assert failure_report({0: survivor}) == (1, f"openk3: error: {text}")


def test_a_failed_worlds_line_names_the_latest_checkpoint_and_the_resume_command(tmp_path, monkeypatch):
    """A rank killed mid-run: the launcher's line named the dead rank but not what the run can continue from,
    as rank 0's Ctrl-C line does. It now ends with the newest finished DCP checkpoint (a save the kill cut,
    a ``.tmp`` folder, is none) and the command typed with ``--resume``, or says that there is none yet."""
    import openk3.dist.launch as launch

    run = tmp_path / "my run"
    argv = ["train", "--nproc-per-node", "2", "--out", str(run), "--dp-shard", "2"]
    command = launch.resume_command(argv)
    assert command == f"openk3 train --nproc-per-node 2 --out '{run}' --dp-shard 2 --resume"
    assert launch.resume_command([*argv, "--resume"]) == command  # a failed resume: the same command
    assert launch.resume_command(argv, "make resume") == "make resume"  # --resume-command
    killed = {1: _failure(tmp_path, 1, -9, None, 0)}
    head = "openk3: error: rank 1 failed (exit code -9, SIGKILL): Signal 9 (SIGKILL) received by PID 101"
    assert launch.failure_report(killed, run, command) == (
        1, f"{head}; {run} holds no finished checkpoint yet: start the run again (without --resume)"
    )  # fmt: skip
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step:06d}" / "meta.json").write_text("{}")
    (run / "checkpoints" / "step-000006.tmp").mkdir()  # the save the kill cut
    note = f"; the run's latest checkpoint is step 4 ({run / 'checkpoints' / 'step-000004'}); continue with: "
    assert launch.failure_report(killed, run, command) == (1, f"{head}{note}{command}")
    text = "rank 0 stopped: another rank did not join a collective in time (Timed out)"
    hung = {0: _failure(tmp_path, 0, PEER_LOST_EXIT, f"LostPeerError: {text}", 10)}
    assert launch.failure_report(hung, run, command) == (1, f"openk3: error: {text}{note}{command}")
    bad = {0: _failure(tmp_path, 0, 2, "ValueError: --batch-size 3 is not divisible", 10)}
    assert launch.failure_report(bad, run, command) == (2, "openk3: error: --batch-size 3 is not divisible")
    # the CLI passes the run folder (--out, else the default) and the command as typed
    seen = []
    monkeypatch.setattr(launch, "launch", lambda *a: seen.append(a) or 0)
    assert main(argv) == 0 and main(["train", "--nproc-per-node", "2"]) == 0
    assert seen == [
        (2, ["train", "--out", str(run), "--dp-shard", "2"], str(run), command),
        (2, ["train"], "runs/k3-tiny", "openk3 train --nproc-per-node 2 --resume"),
    ]


def _rank_zero_fails(rank, world, folder):
    """Rank 0's work raises; every rank reports what it raised (none may wait in a collective)."""
    outcomes = []
    for work in (lambda: Path(folder, "missing").read_text(), lambda: 1 / 0, lambda: None):
        try:
            on_rank_zero(work)
            outcomes.append(None)
        except Exception as e:  # noqa: BLE001 - the type and text are what the test checks
            outcomes.append((type(e).__name__, str(e)))
    return outcomes


def test_a_failure_of_rank_zeros_work_is_raised_on_every_rank(tmp_path):
    missing = f"[Errno 2] No such file or directory: '{tmp_path / 'missing'}'"
    rank0, rank1 = run_world(_rank_zero_fails, 2, str(tmp_path), timeout=60, pg_timeout=20)
    assert rank0 == [("FileNotFoundError", missing), ("ZeroDivisionError", "division by zero"), None]
    assert rank1 == [
        ("FileNotFoundError", missing),
        ("RuntimeError", "rank 0 failed: ZeroDivisionError: division by zero"),
        None,
    ]


@pytest.mark.slow  # two ranks of torch imports and a 2-step run on 2 cores: 20-30 s
def test_a_run_with_expert_parallelism_prints_no_dtensor_warnings(tmp_path):
    """FSDP2 + EP 2: the routed experts' gradient norm, partial over ``efsdp`` and ``ep``, is reduced in one
    all-reduce (the mesh flattens the two dimensions), and the export's two-step gather of each expert is
    known and quiet, so no rank logs DTensor's "While redistributing ..." warning (one per rank each)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: a small corpus for two ranks.\n" for i in range(400)))
    cmd = [sys.executable, "-m", "openk3", "train", "--nproc-per-node", "2", "--out", str(tmp_path / "run"),
           "--data", str(corpus), "--ep", "2", "--batch-size", "2", "--context-schedule", "0:16", *TINY]  # fmt: skip
    done = _run(cmd, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "redistributing" not in done.stderr and "[rank" not in done.stderr, done.stderr
    assert (tmp_path / "run" / "final" / "config.json").is_file()  # the export ran
