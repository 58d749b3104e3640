"""MoonViT-V2 encoder throughput: images per second through the K3 vision tower and projector.

    python benchmarks/vision.py [--sizes 448,1792] [--batch 8,1] [--dtype bfloat16] [--iters 10]
        [--device cuda] [--json out.json]

Builds the released tower (27 blocks, width 1024, 401,214,464 parameters) and projector (46,144,512) with
random weights, packs ``batch`` square images of ``size`` pixels into one forward (``cu_seqlens``, no padding)
and times forward passes under ``torch.no_grad`` after two warm-up passes (CUDA events). Prints, per size, the
patches per image, the text tokens per image, ms per forward, images/s and patches/s; ``--out`` writes them as
a Markdown table with the command, device and torch version, ``--json`` as rows. CUDA is the target (on an
H200 the default run takes well under a minute); ``--device cpu`` runs it anywhere (slowly: use ``--sizes 448
--batch 1 --iters 1``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_ints, default=[448, 1792], help="image sides in pixels (multiples of 28)")
    p.add_argument("--batch", type=_ints, default=[8, 1], help="images per forward, one per size")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=10, help="timed forwards per size")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", help="write the Markdown table to this file")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if len(args.batch) != len(args.sizes):
        p.error(f"--batch needs one value per size ({len(args.sizes)}), got {len(args.batch)}")
    bad = [s for s in args.sizes if s % 28 or s > 3584]
    if bad:
        p.error(f"--sizes must be multiples of 28 up to 3584 (14-pixel patches merged 2 × 2), got {bad}")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --device cpu")
    from openk3.config import KimiK3VisionConfig
    from openk3.model.init import init_weights
    from openk3.model.vision import MoonViT, PatchMergerProjector, merge_patches

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = KimiK3VisionConfig(text_hidden_size=7168)
    with torch.device("meta"):
        tower, projector = MoonViT(cfg), PatchMergerProjector(cfg)
    tower, projector = tower.to_empty(device=device), projector.to_empty(device=device)
    for m in (tower, projector):
        init_weights(m, SimpleNamespace(initializer_range=0.02), seed=0)
        m.to(dtype).eval()
    rows = []
    for size, batch in zip(args.sizes, args.batch):
        side = size // 14
        grid = torch.tensor([[1, side, side]] * batch)
        pixels = torch.randn(batch * side * side, 3, 14, 14, device=device, dtype=dtype)

        def forward(pixels=pixels, grid=grid):
            with torch.no_grad():
                x = tower(pixels, grid)
                return projector(merge_patches(x, grid, cfg.merge_kernel_size))

        for _ in range(2):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                forward()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.iters
        else:
            t = time.perf_counter()
            for _ in range(args.iters):
                forward()
            ms = (time.perf_counter() - t) * 1e3 / args.iters
        row = {
            "size": size,
            "batch": batch,
            "patches_per_image": side * side,
            "tokens_per_image": (side // 2) ** 2,
            "ms_per_forward": round(ms, 3),
            "images_per_s": round(batch * 1e3 / ms, 2),
            "patches_per_s": round(batch * side * side * 1e3 / ms),
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        }
        rows.append(row)
        print(
            f"{size}×{size}: {row['patches_per_image']} patches → {row['tokens_per_image']} tokens per image, "
            f"batch {batch}: {ms:.2f} ms per forward, {row['images_per_s']} images/s, "
            f"{row['patches_per_s']:,} patches/s ({args.dtype}, {row['device']})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.out:
        Path(args.out).write_text(markdown(rows, argv))


def markdown(rows: list[dict], argv: list[str] | None) -> str:
    """The rows as a Markdown table headed by the command, device, dtype and torch version."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# MoonViT-V2 encoder throughput (tower + projector, random weights)",
        "",
        f"`python benchmarks/vision.py {command}` on {rows[0]['device']}, {rows[0]['dtype']}, torch "
        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| image | images per forward | patches / image | text tokens / image | ms per forward | images/s "
        "| patches/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']}×{r['size']} | {r['batch']} | {r['patches_per_image']:,} | "
            f"{r['tokens_per_image']:,} | {r['ms_per_forward']:.2f} | {r['images_per_s']:,} | "
            f"{r['patches_per_s']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
