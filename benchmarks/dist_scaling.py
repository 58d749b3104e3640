"""Weak scaling of the distributed trainer, and the longest sequence context parallelism trains, per world size.

Both run the trainer's own pieces (:func:`openk3.dist.train.build_training` and
:func:`~openk3.dist.train.train_step`: FSDP2, Per-Head Muon + AdamW, Quantile Balancing, gradient clipping)
on random tokens, one ``torch.distributed.run`` launch per world size ``N`` (1, 2, 4, … up to ``--world``),
each under ``--launch-timeout``:

* **weak scaling**: FSDP2 over ``N`` ranks (``--ep``: experts over ``N`` ranks too, where ``N`` divides the
  experts), ``--batch-per-gpu`` rows of ``--seq-len`` tokens per rank, so the global batch grows with ``N``.
  ``--warmup`` steps, then the median of ``--steps`` timed steps (each ends in the trainer's host reads of
  the loss and gradient norm, so the device is idle at the clock). Reported: tokens/s of the world and per
  device, MFU per device = 6 · active parameters · tokens/s per device / ``--peak-tflops`` (as
  ``benchmarks/train_throughput.py``: attention score FLOPs not counted; active parameters from
  :func:`openk3.accounting.closed_form_counts`), the efficiency against ``N = 1`` and the peak memory of
  the worst rank.
* **KCP**: one sequence (batch 1) split over ``cp = N`` ranks (``N = 1``: no CP), its length doubled from
  ``--kcp-start × N`` until a step fails (out of memory) or ``--kcp-max`` is reached; each length trains
  one warm-up step and one timed step. A rank that runs out of memory ends its launch (torch's agent stops
  the others); the lengths that trained before are kept. Reported: the longest length that trained, its
  step time and peak memory, and the error of the next one.

The trainer has no activation checkpointing and computes the full-vocabulary logits in fp32, so on a GPU
the longest sequence is bounded by those, not by KCP's traffic.

CPU smoke run (gloo, k3-tiny, world 2, about a minute; the numbers mean nothing)::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/dist_scaling.py --world 2 --preset k3-tiny \\
        --batch-per-gpu 1 --seq-len 32 --steps 2 --warmup 1 --kcp-start 32 --kcp-max 128 --out /tmp/scaling

GPUs (NCCL, one GPU per rank, bf16 parameters)::

    python benchmarks/dist_scaling.py --nccl --world 8 --preset k3-1b --batch-per-gpu 4 --seq-len 2048 \\
        --kcp-start 8192 --kcp-max 1048576 --out $OUT/dist_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from openk3.dist.launch import run_bounded

PEAK_TFLOPS = 989.0
"""H200 SXM dense bf16 datasheet value, as ``benchmarks/train_throughput.py``."""


def model_config(args):
    from openk3.presets import get_preset, k3_shaped

    return k3_shaped(args.depth) if args.depth else get_preset(args.preset)


def model_name(args) -> str:
    return f"k3_shaped({args.depth})" if args.depth else args.preset


def worlds(world: int) -> list[int]:
    """1, 2, 4, … below ``world``, then ``world``."""
    out, n = [], 1
    while n < world:
        out.append(n)
        n *= 2
    return [*out, world]


def _batch(vocab: int, rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _peak_bytes(device: torch.device) -> int | None:
    """The largest ``max_memory_allocated`` over the world (``None`` on the CPU)."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated(device), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def worker(args) -> None:
    """One rank of a launch: build the trainer's pieces, then time steps (``--mode weak``) or try doubling
    sequence lengths (``--mode kcp``); rank 0 appends one JSON line per measurement to ``--result``."""
    import torch.distributed as dist

    from openk3.config import text_config_of
    from openk3.dist.mesh import ParallelDims
    from openk3.dist.train import build_training, init_from_env, train_step
    from openk3.train.trainer import TrainConfig

    device_type = "cuda" if args.nccl else "cpu"
    init_from_env(device_type)
    if device_type == "cpu":
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TrainConfig(preset=args.preset, device=device_type, seed=0, lr=1e-3, sample_prompt=None)
    cfg = model_config(args)
    text = text_config_of(cfg)
    cp = world if args.mode == "kcp" else 1
    ep = world if args.ep and args.mode == "weak" and text.num_experts % world == 0 else 1
    dims = ParallelDims(world_size=world, dp_shard=world // cp, ep=ep, cp=cp)
    device = torch.device("cuda", torch.cuda.current_device()) if args.nccl else torch.device("cpu")
    run = build_training(config, cfg, dims, device)
    data_rank = rank // cp

    def emit(row: dict) -> None:
        if rank == 0:
            with open(args.result, "a") as f:
                f.write(json.dumps(row) + "\n")

    if args.mode == "weak":
        times, loss = [], None
        for step in range(args.warmup + args.steps):
            x, y = _batch(text.vocab_size, args.batch_per_gpu, args.seq_len, 1000 * step + data_rank)
            start = time.perf_counter()
            loss, _, _ = train_step(run, x, y, 1, config.grad_clip)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        emit({"world": world, "ep": ep, "step_s": statistics.median(times), "first_loss": loss,
              "peak_bytes": _peak_bytes(device)})  # fmt: skip
        return
    T = args.kcp_start * world
    while T <= args.kcp_max * (world if args.kcp_max_per_rank else 1):
        try:
            times = []
            for step in range(2):
                x, y = _batch(text.vocab_size, 1, T, step)
                start = time.perf_counter()
                train_step(run, x, y, 1, config.grad_clip)
                times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as err:  # the launch ends here; the agent stops the other ranks
            Path(f"{args.result}.rank{rank}").write_text(
                json.dumps({"world": world, "seq_len": T, "error": str(err).splitlines()[0][:200]})
            )
            os._exit(3)
        emit({"world": world, "seq_len": T, "step_s": times[-1], "peak_bytes": _peak_bytes(device)})
        T *= 2


def launch(mode: str, n: int, args, scratch: Path) -> tuple[list[dict], str | None]:
    """Run the worker on ``n`` ranks under ``--launch-timeout``; its JSON lines and the error, if any."""
    result = scratch / f"{mode}-{n}.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
        __file__, "--worker", "--mode", mode, "--result", str(result),
        *args.forward,
    ]  # fmt: skip
    status, log = run_bounded(command, args.launch_timeout)
    error = {0: None, None: f"timed out after {args.launch_timeout} s"}.get(status, f"exit status {status}")
    rows = [json.loads(line) for line in result.read_text().splitlines()] if result.is_file() else []
    for rank_file in sorted(scratch.glob(f"{result.name}.rank*")):
        error = json.loads(rank_file.read_text())["error"]
        break
    if error and error.startswith(("exit", "timed")):
        error += ": " + " | ".join(line for line in log.strip().splitlines()[-3:])
    print(f"{mode} N={n}: {len(rows)} rows" + (f", {error}" if error else ""), flush=True)
    return rows, error


def markdown(report: dict) -> str:
    gb = lambda b: "–" if b is None else f"{b / 1e9:.1f}"  # noqa: E731
    lines = [
        f"# Distributed scaling ({report['backend']}, {report['model']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['device']}; torch {report['torch']}, Python {report['python']}. Active parameters "
        f"{report['active_params']:,} of {report['params']:,}; MFU = 6 · active · tokens/s per device / "
        f"{report['peak_tflops']:g} TFLOP/s.",
        "",
        f"## Weak scaling: {report['batch_per_gpu']} × {report['seq_len']} tokens per device",
        "",
        "| N | ep | step s | tokens/s | tokens/s per device | MFU per device | efficiency vs N=1 | peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["weak"]:
        if "error" in r:
            lines.append(f"| {r['world']} | – | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['world']} | {r['ep']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s_per_device']:,.0f} | {r['mfu'] * 100:.2f}% | {r['efficiency']:.2f} "
            f"| {gb(r['peak_bytes'])} |"
        )
    lines += [
        "",
        "## KCP: longest sequence that trains (batch 1, split over cp = N ranks)",
        "",
        "| N | longest T | tokens per rank | step s | peak GB | next length |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["kcp"]:
        best = r["longest"]
        if best is None:
            lines.append(f"| {r['world']} | none | | | | {r['next']} |")
            continue
        lines.append(
            f"| {r['world']} | {best['seq_len']:,} | {best['seq_len'] // r['world']:,} | {best['step_s']:.3f} "
            f"| {gb(best['peak_bytes'])} | {r['next']} |"
        )
    return "\n".join(lines) + "\n"


def summarise(args, weak_rows: dict, kcp_rows: dict) -> dict:
    from openk3.accounting import closed_form_counts
    from openk3.config import text_config_of

    counts = closed_form_counts(text_config_of(model_config(args)))
    weak = []
    for n, (rows, error) in weak_rows.items():
        if not rows:
            weak.append({"world": n, "error": error})
            continue
        r = dict(rows[0])
        r["tokens"] = n * args.batch_per_gpu * args.seq_len
        r["tokens_per_s"] = r["tokens"] / r["step_s"]
        r["tokens_per_s_per_device"] = r["tokens_per_s"] / n
        r["mfu"] = 6 * counts["active"] * r["tokens_per_s_per_device"] / (args.peak_tflops * 1e12)
        weak.append(r)
    base = next((r for r in weak if r["world"] == 1 and "error" not in r), None)
    for r in weak:
        if "error" not in r:
            r["efficiency"] = r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"] if base else None
    kcp = []
    for n, (rows, error) in sorted(kcp_rows.items()):
        longest = max(rows, key=lambda r: r["seq_len"], default=None)
        reached = longest is not None and longest["seq_len"] * 2 > args.kcp_max * (
            n if args.kcp_max_per_rank else 1
        )
        kcp.append({"world": n, "trained": rows, "longest": longest,
                    "next": "--kcp-max reached" if reached and not error else (error or "–")})  # fmt: skip
    return {
        "params": counts["total"], "active_params": counts["active"], "weak": weak, "kcp": kcp,
    }  # fmt: skip


def write_report(args, command: str, weak: dict, kcp: dict) -> dict:
    """The report of the launches so far, written to ``OUT.json`` and ``OUT.md``."""
    report = {
        "command": command,
        "backend": "nccl" if args.nccl else "gloo",
        "device": f"{args.world} × {torch.cuda.get_device_name()}" if args.nccl else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": model_name(args),
        "batch_per_gpu": args.batch_per_gpu,
        "seq_len": args.seq_len,
        "peak_tflops": args.peak_tflops,
        **summarise(args, weak, kcp),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="largest N")
    parser.add_argument("--nccl", action="store_true", help="CUDA, one GPU per rank (default: CPU gloo)")
    parser.add_argument("--preset", default="k3-1b")
    parser.add_argument("--depth", type=int, help="k3_shaped(DEPTH) instead of --preset")
    parser.add_argument("--batch-per-gpu", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per N")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ep", action="store_true", help="weak scaling with experts over the N ranks too")
    parser.add_argument("--kcp-start", type=int, default=8192, help="tokens per rank of the first length")
    parser.add_argument("--kcp-max", type=int, default=1 << 20, help="longest sequence tried")
    parser.add_argument(
        "--kcp-max-per-rank", action="store_true", help="--kcp-max counts tokens per rank (× N in all)"
    )
    parser.add_argument("--no-weak", action="store_true")
    parser.add_argument("--no-kcp", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    parser.add_argument(
        "--launch-timeout", type=int, default=240, help="seconds per launch before it is killed"
    )
    parser.add_argument("--out", help="output prefix: OUT.json and OUT.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("weak", "kcp"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.out:
        parser.error("--out is required")
    if args.world < 1 or args.kcp_start < 1:
        parser.error("--world and --kcp-start must be positive")
    if args.nccl and torch.cuda.device_count() < args.world:
        parser.error(
            f"--nccl --world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()}"
        )
    keep = ("--preset", "--depth", "--batch-per-gpu", "--seq-len", "--steps", "--warmup", "--kcp-start",
            "--kcp-max")  # fmt: skip
    args.forward = [
        *(f"{flag}={getattr(args, flag[2:].replace('-', '_'))}" for flag in keep
          if getattr(args, flag[2:].replace("-", "_")) is not None),
        *(["--nccl"] if args.nccl else []), *(["--ep"] if args.ep else []),
        *(["--kcp-max-per-rank"] if args.kcp_max_per_rank else []),
    ]  # fmt: skip
    command = "python benchmarks/dist_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    weak: dict[int, tuple] = {}
    kcp: dict[int, tuple] = {}
    report = write_report(args, command, weak, kcp)
    with tempfile.TemporaryDirectory(prefix="dist_scaling_") as scratch:
        # the files are rewritten after each launch; KCP from the largest world down, the one that matters most
        # when a time budget stops the run
        for mode, rows, order in (("weak", weak, 1), ("kcp", kcp, -1)):
            if not getattr(args, f"no_{mode}"):
                for n in worlds(args.world)[::order]:
                    rows[n] = launch(mode, n, args, Path(scratch))
                    report = write_report(args, command, weak, kcp)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
