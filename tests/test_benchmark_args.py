"""The GPU benchmark scripts refuse bad arguments on any machine, before they ask for a GPU or time anything.

``benchmarks/kda.py`` and ``benchmarks/kda_profile.py`` need CUDA to measure; their argument checks run first,
so a typo costs no device time. Each case runs the script as a user would and reads argparse's exit status (2)
and message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sections", "chunks"], "--sections: unknown ['chunks']"),
        (["--shapes", "0"], "--shapes: unknown ['0']"),
        (["--shapes", "1,5"], "--shapes: unknown ['5']"),
        (["--fla-passes", "bwd"], "--fla-passes: unknown ['bwd']"),
        (["--sweep", "--sweep-modules", "tile"], "--sweep-modules: unknown ['tile']"),
        (["--sweep-modules", "tile_forward"], "--sweep-modules needs --sweep"),
        (["--iters", "0"], "--iters must be >= 1"),
    ],
)
def test_kda_benchmark_refuses_bad_arguments(args, message):
    result = run_script("kda.py", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernels-of", "ours", "--fla"], "not allowed with argument"),
        (["--launch", "prep"], "--launch must be one of"),
        (["--launch", "prepare", "--kernels-of", "fla"], "give one"),
        (["--shape", "1,2"], "--shape must be four integers"),
        (["--shape", "1,0,4,64"], "--shape needs positive sizes"),
    ],
)
def test_kda_profile_refuses_bad_arguments(args, message):
    result = run_script("kda_profile.py", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
