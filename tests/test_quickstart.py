"""scripts/quickstart.sh run a second time: it samples from the run it finds instead of failing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path):
    """A copy of the scripts with ``openk3`` and the installer's python replaced by recorders."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("openk3", "fakepython"):
        tool = bin_ / name
        tool.write_text(
            f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls"\n'
            f'echo "{name} OMP_WAIT_POLICY=${{OMP_WAIT_POLICY-unset}}" >> "{tmp_path}/env"\n'
        )
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _quickstart(repo: Path, *args: str, omp_wait_policy: str | None = "PASSIVE") -> tuple[str, list[str]]:
    env = {**os.environ, "PATH": f"{repo / 'bin'}:{os.environ['PATH']}", "PYTHON": "fakepython"}
    env.pop("OMP_WAIT_POLICY", None)
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    out = subprocess.run(
        ["bash", str(repo / "scripts" / "quickstart.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    calls = (repo / "calls").read_text().splitlines()
    (repo / "calls").unlink()
    return out, [c for c in calls if c.startswith("openk3")]


def test_quickstart_trains_then_on_a_second_run_only_samples(repo):
    """Training is told the Quickstart's own resume command (which also samples), for the line a Ctrl-C prints."""
    _, calls = _quickstart(repo)
    assert calls[0] == "openk3 train --resume-command bash scripts/quickstart.sh --resume"
    assert calls[1].startswith("openk3 generate --ckpt runs/k3-tiny ")
    (repo / "runs" / "k3-tiny" / "checkpoints").mkdir(parents=True)
    (repo / "runs" / "k3-tiny" / "checkpoints" / "latest").write_text("step-000200\n")
    out, calls = _quickstart(repo)
    assert [c.split()[1] for c in calls] == ["generate"]
    assert "runs/k3-tiny already holds a trained run: skipping training, sampling from it." in out
    assert "start fresh: rm -r runs/k3-tiny (or pass --out runs/NEW)" in out
    _, calls = _quickstart(repo, "--resume", "--steps", "300")  # an explicit resume still trains
    assert (
        calls[0] == "openk3 train --resume-command bash scripts/quickstart.sh --resume --resume --steps 300"
    )
    _, calls = _quickstart(
        repo, "--out", "runs/my other", "--steps", "20"
    )  # another folder: trained, sampled
    resume = r"bash scripts/quickstart.sh --out runs/my\ other --resume"  # a shell word, quoted
    assert calls == [
        f"openk3 train --resume-command {resume} --out runs/my other --steps 20",
        calls[1],
    ] and calls[1].startswith("openk3 generate --ckpt runs/my other ")


@pytest.mark.parametrize("load_at_launch", ["quiet", "busy"])
def test_quickstart_threads_sleep_whatever_the_load_at_launch(repo, load_at_launch):
    """``OMP_WAIT_POLICY=PASSIVE`` for training and sampling unless the user set it: a job that starts after
    launch made spinning threads take 94 s a step (docs/LOG.md, 2026-12-03). An ``awk`` on the ``PATH`` answers
    a load check as a quiet (below 1) or busy machine would; the answer must not matter."""
    awk = repo / "bin" / "awk"
    awk.write_text(f"#!/bin/sh\nexit {1 if load_at_launch == 'quiet' else 0}\n")
    awk.chmod(awk.stat().st_mode | stat.S_IEXEC)
    _quickstart(repo, omp_wait_policy=None)
    seen = [line for line in (repo / "env").read_text().splitlines() if line.startswith("openk3")]
    assert seen == ["openk3 OMP_WAIT_POLICY=PASSIVE"] * 2
    (repo / "env").unlink()
    _quickstart(repo, "--out", "runs/active", omp_wait_policy="ACTIVE")  # the user's choice is kept
    seen = [line for line in (repo / "env").read_text().splitlines() if line.startswith("openk3")]
    assert seen == ["openk3 OMP_WAIT_POLICY=ACTIVE"] * 2
