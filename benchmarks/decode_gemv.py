"""What one normed projection of a one-token decode step costs on a GPU, in the two forms Inductor can take.

A decode step of a small model at one stream is a chain of several hundred kernels, most of them a GEMV of a
few microseconds or the glue around it (the RMSNorm before it, casts). This benchmark times a chain of
``--layers`` blocks, each ``x ← x + W_o · split(W_in · RMSNorm(x))[0]``, compiled by ``torch.compile`` and
replayed from one CUDA graph, with the projections in two forms:

* ``linear``: ``F.linear`` (Inductor calls cuBLAS; the norm is its own kernel);
* ``reduction``: ``(x[:, None, :] · W).sum(-1)`` in fp32 (Inductor emits one Triton reduction, into which it
  fuses the norm and the casts, as the router's few-token path does).

It reports µs per block and kernels per block (from a profiled replay), and the bytes each block reads over
the device's bandwidth (the physical limit of this chain). Shapes default to ``k3-small``'s KDA layer
(``D`` 512, packed input rows 2,120, output 512).

    python benchmarks/decode_gemv.py          # batch 1, 2, 4; writes decode_gemv_h200.{md,json} under --out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def chain(form: str, layers: int, D: int, rows: int, out: int, dtype, device) -> tuple:
    """The compiled chain and its inputs: ``(fn, x, weights)``."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device, dtype)

    ws = [(torch.ones(D, device=device, dtype=dtype), rand(rows, D), rand(D, out)) for _ in range(layers)]

    def proj(x, w):
        if form == "linear":
            return F.linear(x, w)
        return (x.float()[:, None, :] * w.float()).sum(-1).to(x.dtype)

    def step(x):
        for gain, w_in, w_o in ws:
            h = F.rms_norm(x, (D,), gain, 1e-5)
            y = proj(h, w_in)[:, :out]
            x = x + proj(y, w_o)
        return x

    return torch.compile(step, fullgraph=True, dynamic=False), ws


def time_form(form: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    fn, ws = chain(form, args.layers, args.width, args.rows, args.width, dtype, args.device)
    x = torch.randn(args.batch, args.width, device=args.device, dtype=dtype)
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.repeats
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    eager = y.clone()
    ref = x
    for gain, w_in, w_o in ws:  # fp32 reference of the same chain
        h = F.rms_norm(ref.float(), (args.width,), gain.float(), 1e-5)
        ref = ref.float() + (h @ w_in.float().t())[:, : args.width] @ w_o.float().t()
    err = ((eager.float() - ref).norm() / ref.norm()).item()
    bytes_per_block = (args.rows * args.width + args.width * args.width) * dtype.itemsize
    return {
        "form": form,
        "us_per_block": us / args.layers,
        "kernels_per_block": len(kernels) / args.layers,
        "kernel_names": sorted({e.name[:60] for e in kernels}),
        "bandwidth_us_per_block": bytes_per_block / 4.8e12 * 1e6,
        "rel_err_vs_fp32": err,
    }


def markdown(report: dict) -> str:
    """The result file: command, machine, and one row per batch size and form."""
    env = report["env"]
    lines = [
        "# One decode projection block: `F.linear` against a fused fp32 reduction",
        "",
        f"Command: `{report['command']}`",
        "",
        f"GPU: {env['gpu']}; torch {env['torch']}, triton {env['triton']}. Chain of {report['layers']} blocks "
        f"`x ← x + W_o·split(W_in·RMSNorm(x))[0]`, D {report['width']}, {report['rows']} input rows, "
        "compiled and replayed from one CUDA graph.",
        "",
        "| batch | form | µs per block | kernels per block | bytes-bound µs | rel. error vs fp32 |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows_by_batch"]:
        lines.append(
            f"| {r['batch']} | {r['form']} | {r['us_per_block']:.2f} | {r['kernels_per_block']:.2f} "
            f"| {r['bandwidth_us_per_block']:.2f} | {r['rel_err_vs_fp32']:.4f} |"
        )
    lines += [
        "",
        "Bytes-bound: the block's weights at the H200's 4.8 TB/s (the physical limit of the chain).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=2120)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4], help="rows of x (decode streams)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument(
        "--out", default=os.environ.get("OUT", "benchmarks/results"), help="folder of the result files"
    )
    args = p.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        sys.exit("decode_gemv.py times CUDA graphs: it needs --device cuda on a machine with a GPU")
    rows = []
    for batch in args.batch:
        for form in ("linear", "reduction"):
            rows.append(
                {"batch": batch, **time_form(form, argparse.Namespace(**{**vars(args), "batch": batch}))}
            )
            print(json.dumps(rows[-1]), flush=True)
    import triton

    report = {
        "command": "python benchmarks/decode_gemv.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "layers": args.layers,
        "width": args.width,
        "rows": args.rows,
        "rows_by_batch": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_gemv_h200.json").write_text(json.dumps(report, indent=1))
    (out / "decode_gemv_h200.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
