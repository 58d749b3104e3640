"""CPU speed of the KDA ops: forward + backward of ``chunk_kda`` against ``naive_recurrent_kda``.

Prints a Markdown table (shape, naive ms, chunk ms, speed-up) with the torch version and CPU; ``--json``
also writes the numbers. Inputs follow the model: q, k L2-normalised in the op, the gate applied in the op
(K3 ``lb = −5`` by default), β = σ(N(0, 1)), fp32, a zero initial state and the final state returned.

    python benchmarks/kda_cpu.py                       # B=1 T=1024 H=4, K=V ∈ {64, 128}
    python benchmarks/kda_cpu.py --shapes 1x4096x4x128 --repeats 3 --json /tmp/kda.json

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim (= K here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from openk3.ops.kda import chunk_kda, naive_recurrent_kda

GATES = {"k3": -5.0, "softplus": None}
"""``--gate`` → ``lower_bound`` of the in-op gate."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x1024x4x64", "1x1024x4x128"], help="BxTxHxK, V = K")
    parser.add_argument("--gate", choices=GATES, default="k3", help="in-op gate (default: k3, lb = -5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of chunk_kda (best is reported)")
    parser.add_argument("--naive-repeats", type=int, default=2, help="timed runs of the slow reference")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for flag, value in (("--repeats", args.repeats), ("--naive-repeats", args.naive_repeats)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    for shape in args.shapes:
        dims = shape.lower().split("x")
        if len(dims) != 4 or not all(d.isdigit() and int(d) > 0 for d in dims):
            parser.error(f"--shapes: {shape!r} is not BxTxHxK with four positive integers (e.g. 1x1024x4x64)")
    return args


def make_inputs(B: int, T: int, H: int, K: int, seed: int = 0) -> dict:
    """Leaf tensors that require grad, as the layer would feed them (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    leaves = dict(
        q=torch.randn(B, T, H, K, generator=gen),
        k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, H, K, generator=gen),
        g=torch.randn(B, T, H, K, generator=gen),
        beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)),
        A_log=torch.log(torch.empty(H).uniform_(1, 16, generator=gen)),
        dt_bias=torch.empty(H * K).uniform_(-6.9, -2.25, generator=gen),
    )
    return {name: t.requires_grad_() for name, t in leaves.items()}


def fwd_bwd(op: Callable, inputs: dict, lower_bound: float | None) -> None:
    """One training step of the op: forward with the final state, backward of a sum."""
    for t in inputs.values():
        t.grad = None
    o, state = op(**inputs, lower_bound=lower_bound, use_qk_l2norm_in_kernel=True, output_final_state=True)
    (o.sum() + state.sum()).backward()


def best_ms(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(best, median) wall time in ms over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lower_bound = GATES[args.gate]
    load_before = os.getloadavg()[0]
    rows = []
    for shape in args.shapes:
        B, T, H, K = (int(x) for x in shape.lower().split("x"))
        inputs = make_inputs(B, T, H, K)
        naive_step = partial(fwd_bwd, naive_recurrent_kda, inputs, lower_bound)
        naive, naive_med = best_ms(naive_step, args.naive_repeats)
        chunk, chunk_med = best_ms(partial(fwd_bwd, chunk_kda, inputs, lower_bound), args.repeats)
        rows.append(dict(B=B, T=T, H=H, K=K, V=K, naive_ms=naive, naive_median_ms=naive_med,
                         chunk_ms=chunk, chunk_median_ms=chunk_med, speedup=naive / chunk))  # fmt: skip
    env = dict(
        torch=torch.__version__,
        cpu=cpu_name(),
        cpus=os.cpu_count(),
        threads=torch.get_num_threads(),
        gate=args.gate,
        load_avg_1min=[load_before, os.getloadavg()[0]],
    )
    print(f"torch {env['torch']} · {env['cpu']} ({env['cpus']} CPUs) · {env['threads']} thread(s) · fp32 · "
          f"gate {args.gate} · best of {args.repeats} (naive: {args.naive_repeats}) after one warm-up · "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")  # fmt: skip
    print("| B×T×H×K (V = K) | naive fwd+bwd ms | chunk fwd+bwd ms | speed-up |")
    print("|---|---:|---:|---:|")
    for r in rows:
        shape = f"{r['B']}×{r['T']}×{r['H']}×{r['K']}"
        print(f"| {shape} | {r['naive_ms']:.1f} | {r['chunk_ms']:.1f} | {r['speedup']:.1f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, results=rows), f, indent=2)


if __name__ == "__main__":
    main()
