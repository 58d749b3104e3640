"""Every Triton KDA launch compiles for the H200 (``sm_90``) on any machine, GPU or not.

Triton's CPU interpreter (``test_kda_triton.py``) runs the kernels' arithmetic but not the GPU compiler, so a
kernel can pass there and still fail to compile on the device. ``benchmarks/kda_compile.py`` records the
launches of a chunked forward+backward, a tile forward, a pair forward and a decode step and compiles each with
``triton.compile`` for
``sm_90``; it runs in a subprocess because ``test_kda_triton.py`` puts the process in interpreter mode.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    "tile_prepare_kernel": 2,  # the training forward (with its backward outputs), the forward without autograd
    "tile_recurrence_kernel": 3,  # the two tile forwards, and the pair forward's 32-token steps
    "pair_prepare_kernel": 1,
    "chunk_from_tiles_kernel": 1,
    "chunk_prepare_kernel": 1,
    "chunk_state_fwd_kernel": 1,
    "chunk_state_bwd_kernel": 1,
    "chunk_grad_wy_value_kernel": 1,
    "chunk_grad_wy_key_kernel": 1,
    "chunk_grad_intra_kernel": 1,
    "kda_decode_kernel": 1,
}


def _has_nvidia_backend() -> bool:
    """Whether triton and its NVIDIA backend are installed, found without importing triton here (importing it
    before ``test_kda_triton.py`` sets ``TRITON_INTERPRET`` would keep the kernels out of interpreter mode)."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends" / "nvidia").is_dir()


@pytest.mark.skipif(
    not _has_nvidia_backend(), reason="needs triton with its NVIDIA backend (pip install triton)"
)
@pytest.mark.slow  # over 30 s on a 2-core CPU (Triton's interpreter or compiler)
def test_every_kda_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kda_compile.py"), "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in KERNELS
    ]
    counts = {name: sum(row[0] == name for row in rows) for name in KERNELS}
    assert counts == KERNELS, proc.stdout
    for name, _warps, regs, stack, shared in rows:
        assert 0 < int(regs) <= 255, f"{name}: {regs} registers"
        assert int(stack) >= 0 and int(shared) > 0, f"{name}: stack {stack}, shared {shared}"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)")
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("tile_prepare.num_warps=3", "KernelLaunch.num_warps must be an int in (1, 2, 4, 8, 16); got 3"),
        ("chunk_grad_wy.value_block=256", "value_block (256) must be less than 4 x key_block (64)"),
        ("nonesuch.num_warps=4", "no kernel 'nonesuch'"),
        ("chunk_prepare.key_blok=32", "chunk_prepare: "),
        ("chunk_prepare.key_block=yes", "'yes' is not an int"),
    ],
)
def test_kda_compile_refuses_bad_geometry(setting, message):
    """``kda_compile.py --geometry`` builds its launch config with the config's own checks before it compiles
    anything: one line naming the problem, exit status 1, no table."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kda_compile.py"), "--geometry", setting],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and message in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "kernel" not in proc.stdout
