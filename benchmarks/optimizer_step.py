"""The optimizer step alone: Per-Head Muon + AdamW (``openk3.train.optim.build_optimizer``) on a preset's
parameters with random gradients, timed and profiled.

What it measures, for ``--preset`` (default ``k3-1b``, fp32 parameters as ``openk3 train`` keeps them):

* ``optimizer.step()`` wall time with CUDA events: 3 warm-up steps, then ``--steps`` (10) timed ones (median,
  min, max), the same grads each step (the step never reads them back on the host);
* the Newton–Schulz work: one batched NS per matrix shape, its shapes and batch sizes, and its GEMM FLOPs
  (per NS step and matrix, with ``m = min(M, N)``, ``n = max(M, N)``: ``2m²n`` for the Gram matrix, ``2m³``
  for ``A²``, ``2m²n`` for the product with ``X``);
* one step under ``torch.profiler`` (:func:`openk3.train.step_profile.profile_step`): kernels, device time,
  the top kernels, and device time per class (GEMM, multi-tensor ``_foreach``/fused AdamW, copies and casts,
  norms and other elementwise);
* the peak memory the step adds (``torch.cuda.max_memory_allocated`` above the resident state).

Writes ``optimizer_step_<device>.json`` and ``.md`` under ``$OUT`` (or ``--out``; default
``benchmarks/results``). GPU (about 1–2 minutes on an H200, most of it building 1.2 B parameters)::

    python benchmarks/optimizer_step.py

CPU smoke run (``k3-tiny``, 2 timed steps; the numbers mean nothing)::

    python benchmarks/optimizer_step.py --preset k3-tiny --steps 2 --out /tmp/opt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import openk3
from openk3.train.optim import KimiMuon, build_optimizer, partition_parameters
from openk3.train.step_profile import profile_step

CLASSES = (
    ("GEMM (Newton–Schulz)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere_", "Kernel2")),
    ("multi-tensor (_foreach, fused AdamW)", ("multi_tensor_apply",)),
    ("copies and casts", ("Memcpy", "copy_kernel", "CatArray")),
    ("norms and reductions", ("reduce_kernel", "norm")),
)


def kernel_class(name: str) -> str:
    for label, keys in CLASSES:
        if any(k in name for k in keys):
            return label
    return "other elementwise"


def ns_buckets(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    """``{(M, N): matrices}`` of the batched Newton–Schulz calls of one step (all Muon groups together)."""
    buckets: dict[tuple[int, int], int] = {}
    for role in partition_parameters(model):
        if role.kind == "adamw":
            continue
        count = 1
        for d in role.shape[:-2]:
            count *= d
        buckets[role.matrix] = buckets.get(role.matrix, 0) + count * role.heads
    return buckets


def ns_flops(buckets: dict[tuple[int, int], int], steps: int) -> float:
    total = 0.0
    for (M, N), b in buckets.items():
        m, n = min(M, N), max(M, N)
        total += steps * b * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="k3-1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = openk3.build_model(openk3.get_preset(args.preset), device=device, init=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
            p.grad = torch.randn_like(p).mul_(1e-3)
    optimizer: KimiMuon = build_optimizer(model, lr=1e-3)
    build_s = time.perf_counter() - t0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        optimizer.step()
    sync()
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            optimizer.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - t)
    peak_extra = (torch.cuda.max_memory_allocated() - resident) if device.type == "cuda" else 0

    def one_step(mark) -> None:
        mark("optimizer")
        optimizer.step()

    prof = profile_step(one_step, device)
    classes: dict[str, list[float]] = {}
    for name, count, seconds in prof.top_kernels:
        c = classes.setdefault(kernel_class(name), [0, 0.0])
        c[0] += count
        c[1] += seconds
    buckets = ns_buckets(model)
    flops = ns_flops(buckets, optimizer.defaults["ns_steps"])
    gemm_s = classes.get(CLASSES[0][0], [0, 0.0])[1]
    median = statistics.median(times)
    params = {k: 0 for k in ("muon", "muon_per_head", "adamw")}
    for role in partition_parameters(model):
        n = 1
        for d in role.shape:
            n *= d
        params[role.kind] += n
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "parameters": params,
        "build_s": build_s,
        "step_ms": {
            "median": median * 1e3,
            "min": min(times) * 1e3,
            "max": max(times) * 1e3,
            "n": len(times),
        },
        "peak_extra_gb": peak_extra / 1e9,
        "ns_buckets": {f"{M}x{N}": b for (M, N), b in sorted(buckets.items(), key=lambda kv: -kv[1])},
        "ns_tflop": flops / 1e12,
        "ns_gemm_tflops": (flops / gemm_s / 1e12) if gemm_s else None,
        "profile": {
            **prof.to_dict(),
            "classes": {k: {"kernels": v[0], "ms": v[1] * 1e3} for k, v in classes.items()},
        },
    }
    lines = [
        f"# Optimizer step alone: {args.preset} on {result['device']}",
        "",
        "Command: `python benchmarks/optimizer_step.py"
        + (f" --preset {args.preset}" if args.preset != "k3-1b" else "")
        + "`",
        "",
        f"torch {torch.__version__}; parameters: Muon {params['muon']:,}, per-head Muon {params['muon_per_head']:,}, "
        f"AdamW {params['adamw']:,} (fp32).",
        "",
        f"**optimizer.step(): {median * 1e3:.1f} ms** (median of {len(times)}; min {min(times) * 1e3:.1f}, max "
        f"{max(times) * 1e3:.1f}); peak memory above the resident state {peak_extra / 1e9:.2f} GB.",
        "",
        f"Newton–Schulz: {len(buckets)} batched calls (one per matrix shape), {flops / 1e12:.2f} TFLOP of GEMMs"
        + (f", {flops / gemm_s / 1e12:.0f} TFLOP/s over the GEMM kernels' time." if gemm_s else "."),
        "",
        "| class | kernels | ms |",
        "|---|---|---|",
        *(
            f"| {k} | {v[0]} | {v[1] * 1e3:.2f} |"
            for k, v in sorted(classes.items(), key=lambda kv: -kv[1][1])
        ),
        "",
        *prof.markdown(),
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in result["device"] else device.type
    (out / f"optimizer_step_{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"optimizer_step_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
