"""Where the Triton KDA chunk kernels spend their time, one kernel at a time, for Nsight Compute.

``benchmarks/kda.py`` gives each launch's time; this script gives the reasons. It prepares the inputs of one
B1 T8192 H96 D128 training step once (bf16, K3 gate, lower bound −5, L2 norm in the kernel), runs the chosen
launches twice (the first compiles), and prints each Triton kernel's registers per thread, spilled bytes,
shared memory and warps, so a profile can be read against the occupancy they allow. Run it under ``ncu`` to
read the hardware counters of the second launch (on a machine whose runtime lets ncu read them; leave the
clocks alone with ``--clock-control none``)::

    python benchmarks/kda_profile.py                                   # registers / spills / smem / time
    ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:chunk_grad_intra_kernel \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python benchmarks/kda_profile.py --launch grad_intra

``--launch`` names one of ``benchmarks/kda.py``'s launches (``KERNEL_NAMES``: ``prepare (bwd)``,
``state_fwd (h, E)``, ``state_bwd``, ``grad_wy``, ``grad_intra``, ``tile prepare``, ``tile recurrence``, ...;
default all). ``--kernels-of fla`` instead lists the CUDA kernels of one flash-linear-attention ``chunk_kda``
forward and forward+backward on the same inputs, with each kernel's time from ``torch.profiler`` (the peer's
split, to compare launch by launch) and the wall time per call; ``--kernels-of ours`` does the same for our
public ``chunk_kda`` (its forward without autograd runs on 16-token tiles).

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from openk3.ops.kda.triton.dispatch import SUPPORTED_DIMS

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the benchmark's own inputs and launches
from kda import (  # noqa: E402
    KERNEL_NAMES,
    LEAVES,
    chunk_inputs,
    fla_chunk,
    fwd_bwd,
    our_launches,
    ours_chunk,
    time_ms,
)

KERNELS = {
    "openk3.ops.kda.triton.chunk_prepare": ["chunk_prepare_kernel"],
    "openk3.ops.kda.triton.chunk_state": ["chunk_state_fwd_kernel"],
    "openk3.ops.kda.triton.chunk_state_bwd": ["chunk_state_bwd_kernel"],
    "openk3.ops.kda.triton.chunk_grad_wy": ["chunk_grad_wy_value_kernel", "chunk_grad_wy_key_kernel"],
    "openk3.ops.kda.triton.chunk_grad_intra": ["chunk_grad_intra_kernel"],
    "openk3.ops.kda.triton.tile_forward": ["tile_prepare_kernel", "tile_recurrence_kernel"],
    "openk3.ops.kda.triton.chunk_from_tiles": ["chunk_from_tiles_kernel"],
}
"""Modules and the ``@triton.jit`` kernels whose compiled variants are reported."""


def compiled_variants(jit_fn) -> list:
    """The compiled kernels a ``@triton.jit`` function holds (Triton 3.x keeps them per device in
    ``device_caches``; older versions in ``cache``); empty when neither attribute exists."""
    found = []
    for caches in getattr(jit_fn, "device_caches", {}).values():
        table = caches[0] if isinstance(caches, tuple) else caches
        found += list(table.values())
    for table in getattr(jit_fn, "cache", {}).values():
        found += list(table.values())
    return found


def kernel_resources() -> list[dict]:
    """Registers, spills, shared memory and warps of every compiled variant of :data:`KERNELS`."""
    import importlib

    rows = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            jit_fn = getattr(module, name, None)
            if jit_fn is None:
                continue
            for kernel in compiled_variants(jit_fn):
                meta = getattr(kernel, "metadata", None)
                rows.append(
                    {
                        "kernel": name,
                        "registers": getattr(kernel, "n_regs", None),
                        "spilled_bytes": getattr(kernel, "n_spills", None),
                        "shared_bytes": getattr(meta, "shared", None),
                        "warps": getattr(meta, "num_warps", None),
                        "stages": getattr(meta, "num_stages", None),
                    }
                )
    return rows


def op_kernels(op_name: str, B: int, T: int, H: int, D: int, repeats: int = 3) -> None:
    """Print each CUDA kernel of one public ``chunk_kda`` forward (without autograd, as ``benchmarks/kda.py``
    times it) and forward+backward with its mean time (ms per call, from ``torch.profiler`` over ``repeats``
    calls after one warm-up), and the wall time per call (CUDA events), whose excess over the kernels is launch
    gaps. ``op_name``: ``fla`` or ``ours`` (as called: the forward on 16-token tiles, forward+backward the
    training path)."""
    from torch.profiler import ProfilerActivity, profile

    op = {"fla": fla_chunk, "ours": ours_chunk}[op_name]
    x = chunk_inputs(B, T, H, D, None)
    for name in LEAVES:
        x[name].requires_grad_(True)
    do = torch.randn_like(x["v"])

    def forward():
        with torch.no_grad():
            op(x)

    passes = [("fwd", forward), ("fwd+bwd", lambda: fwd_bwd(op, x, do))]
    for label, fn in passes:
        fn()
        torch.cuda.synchronize()
        wall = time_ms(fn, repeats, warmup=1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        rows.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in rows) / repeats / 1e3
        print(f"{op_name} chunk_kda {label}: {total:.3f} ms of kernels, {wall:.3f} ms wall per call")
        for e in rows:
            print(f"  {e.device_time_total / repeats / 1e3:8.3f} ms  x{e.count // repeats:<3} {e.key[:90]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv`` (default ``sys.argv[1:]``); adds ``args.dims = (B, T, H, D)``. A bad argument
    exits with argparse's status 2."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", default=None, help="one launch name (default: all)")
    parser.add_argument("--shape", default="1,8192,96,128", help="B,T,H,D (default 1,8192,96,128)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--kernels-of",
        choices=["fla", "ours"],
        help="instead list the CUDA kernels and times of one public chunk_kda call: fla's or ours",
    )
    which.add_argument(
        "--fla", dest="kernels_of", action="store_const", const="fla", help="same as --kernels-of fla"
    )
    args = parser.parse_args(argv)
    if args.launch is not None and args.launch not in KERNEL_NAMES:
        parser.error(f"--launch must be one of {list(KERNEL_NAMES)}; got {args.launch!r}")
    if args.launch is not None and args.kernels_of:
        parser.error("--launch times one of our launches; --kernels-of/--fla lists a whole call: give one")
    try:
        B, T, H, D = (int(x) for x in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape must be four integers B,T,H,D; got {args.shape!r}")
    if min(B, T, H, D) < 1:
        parser.error(f"--shape needs positive sizes; got {args.shape!r}")
    if D not in SUPPORTED_DIMS:
        parser.error(f"--shape: the head dim D must be one of {SUPPORTED_DIMS} (the kernels' tiles); got {D}")
    args.dims = (B, T, H, D)
    return args


def main() -> None:
    args = parse_args()
    B, T, H, D = args.dims
    if not torch.cuda.is_available():
        sys.exit("kda_profile.py needs a CUDA GPU")
    if args.kernels_of:
        op_kernels(args.kernels_of, B, T, H, D)
        return
    launches = our_launches(B, T, H, D)
    names = [args.launch] if args.launch else list(launches)
    for name in names:
        launches[name]()  # compile (the profiled launch is the second)
        torch.cuda.synchronize()
        print(f"{name}: {time_ms(launches[name], 3, warmup=0):.3f} ms", flush=True)
    print("kernel                         regs  spill B  smem B  warps  stages")
    for row in kernel_resources():
        print(
            f"{row['kernel']:<30} {row['registers']!s:>4} {row['spilled_bytes']!s:>8} "
            f"{row['shared_bytes']!s:>7} {row['warps']!s:>6} {row['stages']!s:>7}"
        )


if __name__ == "__main__":
    main()
