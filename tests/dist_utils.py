"""A small multi-process harness: run one function on every rank of a gloo (or NCCL) world, with timeouts.

``run_world(fn, world_size, *args)`` spawns ``world_size`` processes, initialises the default process group
on a free local port with a bounded collective timeout, calls ``fn(rank, world_size, *args)`` on each and
returns the per-rank results in rank order. A rank that raises fails the call with its traceback; a world
that does not finish within ``timeout`` seconds is killed and fails naming the ranks still running, so a
bug fails rather than hangs. Put several checks into one ``fn``: each launch costs seconds of imports.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, pg_timeout, results, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn, world_size: int, *args, timeout: float = 120, backend: str = "gloo", pg_timeout: float = 60
):
    """``[fn(0, W, *args), …, fn(W-1, W, *args)]`` run in ``W`` spawned processes (see module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, port, backend, pg_timeout, results, args), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[bool, object]] = {}
    while len(got) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, out = results.get(timeout=0.5)
            got[rank] = (ok, out)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    failed = {r: out for r, (ok, out) in got.items() if not ok}
    if failed:
        r = min(failed)
        raise AssertionError(f"rank {r} of {world_size} failed:\n{failed[r]}")
    died = {
        r: procs[r].exitcode
        for r in range(world_size)
        if r not in got and procs[r].exitcode not in (None, -9)
    }
    if died:
        raise AssertionError(
            f"ranks {sorted(died)} of {world_size} exited without a result (exit codes {died})"
        )
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        raise AssertionError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
    return [got[r][1] for r in range(world_size)]


def nccl_world_available(world_size: int) -> str | None:
    """``None`` when ``world_size`` CUDA devices and NCCL are present, else the reason to skip."""
    if not torch.cuda.is_available():
        return "NCCL variant: no CUDA device"
    if torch.cuda.device_count() < world_size:
        return f"NCCL variant: needs {world_size} GPUs, found {torch.cuda.device_count()}"
    if not dist.is_nccl_available():
        return "NCCL variant: torch built without NCCL"
    return None
