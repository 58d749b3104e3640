"""A rank that dies mid-step: the launcher names it, the survivor fails within the collective timeout
instead of hanging, and the last checkpoint stays intact (the interrupted save never appears under its
final name). Under ``openk3 train --nproc-per-node`` a rank killed with SIGKILL is reported in the launcher's
one line, with what the run can continue from, and the survivor, whose collective lost its connection,
prints no traceback of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import openk3
from dist_utils import run_world
from openk3.dist.checkpoint import save_checkpoint
from openk3.dist.fsdp import build_sharded_model
from openk3.dist.lost_peer import lost_peer_line, lost_peer_reason
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


GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19352. "
    "This is typically caused by a remote worker crashing. Check the logs of the remote worker before "
    "reporting an error. GLHF!"
)


def test_a_lost_peer_is_told_from_other_errors():
    """gloo's messages of a dropped connection or a timeout, raised or wrapped (DCP's CheckpointException
    holds each rank's exception, an error raised while handling one keeps it as its context), and nothing
    else: a bug's RuntimeError or bad input keep their traceback."""
    closed = ("lost", "Connection closed by peer [127.0.0.1]:19352")
    assert lost_peer_reason(RuntimeError(GLOO_CLOSED)) == closed
    reset = RuntimeError("[pair.cc:598] Read error [127.0.0.1]:20359: Connection reset by peer")
    assert lost_peer_reason(reset) == ("lost", "Read error [127.0.0.1]:20359: Connection reset by peer")
    timeout = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 300000ms for recv operation to complete")
    assert lost_peer_reason(timeout) == (
        "timeout",
        "Timed out waiting 300000ms for recv operation to complete",
    )
    wrapped = CheckpointException("save failed", {0: (RuntimeError(GLOO_CLOSED), None)})
    assert lost_peer_reason(wrapped) == closed
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError:
            raise RuntimeError("unshard failed") from None  # context kept, though not shown
    except RuntimeError as e:
        assert lost_peer_reason(e) == closed
    assert lost_peer_reason(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer_reason(ValueError(GLOO_CLOSED)) is None  # bad input is reported as such
    assert lost_peer_reason(KeyboardInterrupt()) is None
    assert lost_peer_line(0, "timeout", "Timed out waiting 300000ms") == (
        "rank 0 stopped: another rank did not join a collective in time (Timed out waiting 300000ms)"
    )


def _rank_pids(parent: int) -> dict[int, int]:
    """``{RANK: pid}`` of the children of ``parent`` (the launcher's ranks), from ``/proc``."""
    pids = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:  # stat: "pid (name) state ppid ..."
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().decode().split("\0") if ppid == parent else []
        except OSError:  # the process ended meanwhile
            continue
        rank = [v.removeprefix("RANK=") for v in environ if v.startswith("RANK=")]
        if rank:
            pids[int(rank[0])] = int(proc.name)
    return pids


def _two_rank_run(tmp_path: Path, run: Path) -> tuple[list[str], dict]:
    """``(command, environment)`` of a 2-rank launcher run of k3-tiny into ``run`` on a small corpus written
    under ``tmp_path``: 1,000 steps, far more than a test waits for, and no save before the end."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(f"line {i}: a small corpus for two ranks.\n" for i in range(400)))
    env = {**os.environ, "PYTHONPATH": str(Path(openk3.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "openk3", "train", "--nproc-per-node", "2", "--preset", "k3-tiny",
           "--out", str(run), "--data", str(corpus), "--dp-shard", "2", "--batch-size", "2",
           "--context-schedule", "0:16", "--steps", "1000", "--save-every", "1000", "--no-sample"]  # fmt: skip
    return cmd, env


def _start(cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """``cmd`` started in a session of its own, its output piped."""
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _until_step_2(proc: subprocess.Popen) -> None:
    """Read ``proc``'s output until rank 0 has printed step 2's line (it prints one after each step)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("step 2 "):
            return
        assert line or proc.poll() is None, proc.stderr.read()


@pytest.mark.slow  # two ranks of torch imports and two steps on 2 cores: 20-30 s
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds the ranks' pids in /proc")
def test_a_killed_rank_is_one_line_and_the_survivor_prints_no_traceback(tmp_path):
    run = tmp_path / "run"
    cmd, env = _two_rank_run(tmp_path, run)
    proc = _start(cmd, env, tmp_path)
    try:
        _until_step_2(proc)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err
    assert "Traceback" not in out + err, err  # rank 0's collective lost its connection: no traceback
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert errors == [  # and what the run can continue from: nothing, its first save is at step 1000
        f"openk3: error: rank 1 failed (exit code -9, SIGKILL): Signal 9 (SIGKILL) received by PID {ranks[1]}; "
        f"{run} holds no finished checkpoint yet: start the run again (without --resume)"
    ], err


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (an ended one left unreaped by its new parent is a zombie: not running)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # three launchers' worth of torch imports and a few steps on 2 cores: 40-70 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ranks' parent-death signal is Linux's")
def test_a_run_folder_takes_one_world_and_the_ranks_of_a_killed_launcher_save_and_stop(tmp_path):
    """A second world started into a folder a world trains in is refused (rank 0 holds the run lock); a
    launcher ended by ``kill -9`` does not leave its ranks training on, orphaned: they get SIGTERM (often
    more than one, :class:`~openk3.dist.train.StopRequest`), finish their step, save and exit, and the lock
    is given back."""
    run = tmp_path / "run"
    cmd, env = _two_rank_run(tmp_path, run)
    proc = _start(cmd, env, tmp_path)
    ranks = {}
    try:
        _until_step_2(proc)
        second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert second.returncode == 2, second.stderr
        assert "is in use by another training" in second.stderr, second.stderr
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(map(_running, ranks.values())):
            time.sleep(0.5)
        alive = [pid for pid in ranks.values() if _running(pid)]
        assert not alive, f"ranks {alive} still run after their launcher was killed"
    finally:
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = proc.stdout.read()  # every writer (the launcher, its ranks) has ended: read to the end
    saved = [p.name for p in (run / "checkpoints").glob("step-*") if (p / "meta.json").is_file()]
    assert len(saved) == 1, f"the ranks stopped without saving: {saved}\n{out}"
    assert f"received: stopped after step {int(saved[0].removeprefix('step-'))}, checkpoint saved" in out, out
    assert not (run / "train.lock").exists()


def test_a_repeated_sigterm_asks_again_and_a_second_ctrl_c_aborts():
    """One stop request can reach a rank as several SIGTERMs (the parent-death signal comes once per thread
    of a dying launcher): they set the flag once and never raise; a SIGINT after any request does."""
    from openk3.dist.train import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    try:
        try:  # the handler runs before os.kill returns (main thread)
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:  # not left to end the whole pytest session
            pytest.fail("a repeated SIGTERM aborted the rank (KeyboardInterrupt): its step was not saved")
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_lost_peer_gives_the_run_lock_back_before_its_exit(tmp_path, monkeypatch):
    """The lost peer's exit skips ``finally`` blocks (``os._exit``): rank 0's lock is released before it."""
    import openk3.dist.train as dist_train
    from openk3.train.run_lock import acquire_run_lock

    def lose_the_peer(*args):
        args[-1].append(acquire_run_lock(tmp_path))  # rank 0 took the lock, as _train_distributed does
        raise RuntimeError(GLOO_CLOSED)

    def exit_lost_peer(line):
        seen.append((line, (tmp_path / "train.lock").exists()))
        raise SystemExit(3)  # stands in for os._exit

    seen = []
    monkeypatch.setattr(dist_train, "_train_distributed", lose_the_peer)
    monkeypatch.setattr(dist_train, "exit_lost_peer", exit_lost_peer)
    monkeypatch.setattr(dist_train.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist_train.dist, "get_rank", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        dist_train.train_distributed(config=None)
    assert seen == [(lost_peer_line(0, "lost", "Connection closed by peer [127.0.0.1]:19352"), False)]
