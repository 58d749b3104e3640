"""``openk3 train --nproc-per-node N …``: start ``N`` local ranks of ``python -m openk3 train …`` under torch's
elastic agent (what ``torchrun --standalone --nproc_per_node N -m openk3 train …`` starts) and report a failed
world in one line.

torchrun ends a failed world with its own report: the agent's log lines, a traceback of its launcher and a
``ChildFailedError`` table, even when the failure is bad input that rank 0 has already named in one line.
This launcher runs the same agent (:func:`torch.distributed.launcher.api.elastic_launch`, a c10d rendezvous
on a free local port) and turns its ``ChildFailedError`` into the exit status and at most one line. The
ranks it starts print no error line of their own (:data:`LAUNCHER_ENV` is set for them): under plain
torchrun rank 0 prints bad input, but here the agent may stop rank 0 before or after it printed (whichever
rank ends first ends the world), so only the launcher, which sees how the world ended, can print it once:

- a rank ended with 2 (bad input): the message of the first such rank, from the error file every rank
  writes (``TORCHELASTIC_ERROR_FILE``, :func:`openk3.cli.main`), exit status 2;
- any other failure: ``openk3: error: rank R failed (exit code C, SIGNAL): MESSAGE``, exit status 1 (a
  traceback, when there is one, was printed by that rank above). A rank that stopped because another one
  is gone (exit status :data:`PEER_LOST_EXIT`, :mod:`openk3.dist.lost_peer`: its collective lost the
  connection or timed out) printed nothing and is no cause: the line names the rank that failed first
  otherwise (killed, crashed), and only when no such rank ended (one hangs) the lost peer's line, e.g.
  ``openk3: error: rank 0 stopped: another rank did not join a collective in time (...)``. Either line ends
  with what the run can continue from (:func:`resume_note`): its latest finished checkpoint and the command
  that resumes it, or that it has none yet;
- the launcher itself interrupted (Ctrl-C, SIGTERM): the agent passes the signal on to the ranks, which
  finish their step and save a checkpoint (:class:`openk3.dist.train.StopRequest`; rank 0 prints that line),
  and kills those still running after the agent's shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s);
  then one line, exit status 128 + the signal's number.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
import uuid
from pathlib import Path

USER_ERROR_EXIT = 2
"""The exit status of a rank that stopped on bad input (:func:`openk3.cli.main`)."""
PEER_LOST_EXIT = 3
"""The exit status of a rank that stopped because another rank is gone (:mod:`openk3.dist.lost_peer`)."""
LAUNCHER_ENV = "OPENK3_LAUNCHER"
"""Set (to ``1``) for the ranks this launcher starts: they record errors in their error files and print
none (:func:`openk3.cli.main`); the launcher prints the one line."""


def stop_with_launcher() -> None:
    """Ask the kernel to send this rank SIGTERM when the process that started it (the elastic agent: openk3's
    launcher or torchrun) dies, so a launcher ended by ``kill -9`` does not leave its ranks training on,
    orphaned: the signal makes them finish the step and save (:class:`openk3.dist.train.StopRequest`).
    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere, or if the call fails, nothing changes. A parent
    already gone before the request (the rank was adopted by init) is answered at once.

    The "parent" is the launcher's thread that started the rank: when it exits, the kernel hands the rank
    to another live thread of the launcher and sends the signal, and again at each such hand-over while a
    killed launcher's threads exit one by one. A rank can thus get several SIGTERMs for one death, which
    :class:`~openk3.dist.train.StopRequest` takes as one request."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def _message(failure) -> str:
    """The one-line message of a ``ProcessFailure``: the error file's ``TYPE: TEXT`` (the type dropped for
    bad input and a lost peer), else ``<N/A>``."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message")
    lines = str(message or "").strip().splitlines()
    text = lines[0] if lines else "<N/A>"
    if failure.exitcode in (USER_ERROR_EXIT, PEER_LOST_EXIT):
        text = text.split(": ", 1)[-1]
    return text


def resume_command(argv: list[str], given: str | None = None) -> str:
    """The command that continues the run that ``openk3 *argv`` started (``argv`` as typed, ``train`` and
    ``--nproc-per-node N`` included): ``given`` (``--resume-command``), else ``argv`` with ``--resume``
    (added when it is not there), shell-quoted."""
    if given:
        return given
    return "openk3 " + shlex.join(argv + ([] if "--resume" in argv else ["--resume"]))


def resume_note(run_dir: str | os.PathLike, command: str) -> str:
    """What a failed world's run ``run_dir`` can continue from, as the end of the launcher's line:
    ``"; the run's latest checkpoint is step N (PATH); continue with: COMMAND"``, or, when it holds no
    finished DCP checkpoint (:func:`openk3.dist.train.latest_distributed_checkpoint`), that it has none."""
    from openk3.dist.train import latest_distributed_checkpoint

    checkpoint = latest_distributed_checkpoint(Path(run_dir))
    if checkpoint is None:
        return f"; {run_dir} holds no finished checkpoint yet: start the run again (without --resume)"
    step = int(checkpoint.name.removeprefix("step-"))
    return f"; the run's latest checkpoint is step {step} ({checkpoint}); continue with: {command}"


def failure_report(
    failures: dict, run_dir: str | os.PathLike | None = None, resume_with: str = ""
) -> tuple[int, str]:
    """``(exit status, line)`` for the failed ranks ``failures`` (rank → ``ProcessFailure``, as in
    ``ChildFailedError.failures``); see the module docstring. With ``run_dir`` a failure that is not bad
    input ends with :func:`resume_note` of ``run_dir`` and ``resume_with``."""
    bad_input = [f for f in failures.values() if f.exitcode == USER_ERROR_EXIT]
    if bad_input:
        return USER_ERROR_EXIT, f"openk3: error: {_message(min(bad_input, key=lambda f: f.timestamp))}"
    note = "" if run_dir is None else resume_note(run_dir, resume_with)
    # a rank that lost its peer recorded its error before the agent saw the dead rank (whose time is when
    # the agent saw it): by time alone it would look first
    causes = {r: f for r, f in failures.items() if f.exitcode != PEER_LOST_EXIT}
    rank, first = min((causes or failures).items(), key=lambda item: item[1].timestamp)
    if first.exitcode == PEER_LOST_EXIT:
        return 1, f"openk3: error: {_message(first)}{note}"
    signal = first.signal_name()
    how = f"exit code {first.exitcode}" + (f", {signal}" if signal and signal != "<N/A>" else "")
    return 1, f"openk3: error: rank {rank} failed ({how}): {_message(first)}{note}"


def launch(nproc_per_node: int, argv: list[str], run_dir: str | os.PathLike, resume_with: str) -> int:
    """Run ``python -m openk3 *argv`` on ``nproc_per_node`` local ranks; return the exit status (0 when
    every rank succeeded). The agent's own log lines are silenced unless ``LOGLEVEL`` is set. ``run_dir``
    (the run's ``--out``) and ``resume_with`` (:func:`resume_command`) end the line of a failed world
    (:func:`resume_note`)."""
    with tempfile.TemporaryDirectory(prefix="openk3-launch-") as logs:  # the agent's per-rank error files
        return _launch(nproc_per_node, argv, run_dir, resume_with, logs)


def _launch(nproc_per_node: int, argv: list[str], run_dir, resume_with: str, logs: str) -> int:
    """:func:`launch` with the agent's log folder ``logs`` (the ranks' ``error.json`` files, read into the
    failure before the agent returns; left to torch, each launch left a ``torchelastic_*`` folder in the
    temporary directory)."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "LOGLEVEL" not in os.environ:  # the agent's loggers set their level from LOGLEVEL when imported
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )
    previous = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = "1"  # the ranks inherit this process's environment
    try:
        elastic_launch(config, sys.executable)("-m", "openk3", *argv)
    except ChildFailedError as e:
        code, line = failure_report(e.failures, run_dir, resume_with)
        print(line, file=sys.stderr)
        return code
    except SignalException as e:  # Ctrl-C or SIGTERM: the agent passed it on to the ranks and waited for them
        print(
            f"openk3: {e.sigval.name} received: the {nproc_per_node} ranks were stopped (each finishes its step "
            f"and saves; any still running after {config.shutdown_timeout} s was killed)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous
    return 0


def run_bounded(command: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``command`` (a launcher and the ranks it starts) in its own session, stdout and stderr together;
    return ``(exit status, output)``, the status ``None`` when it ran past ``timeout_s`` seconds. On timeout,
    on an exception or when this process gets SIGTERM (``timeout`` stopping a benchmark), the whole session
    gets SIGKILL, so no rank is left holding a device."""
    import signal
    import subprocess

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
