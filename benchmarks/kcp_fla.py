"""openk3's KCP op against flash-linear-attention's context parallelism (``chunk_kda(cp_context=...)``) on N GPUs.

Run under torchrun, one GPU per rank (NCCL); fla's CP refuses the CPU, so there is no CPU mode::

    torchrun --standalone --nproc_per_node N benchmarks/kcp_fla.py --out $OUT/kcp_fla

For each global length ``T`` (``--lengths``, one document spanning every rank, then ``--docs`` documents of
random lengths), the same bf16 inputs on every rank (``H`` heads of ``K = V = D``, the Kimi-Linear softplus
gate computed in the kernels from ``A_log`` and ``dt_bias``, L2-normalised q and k, sigmoid β), split by the
layout (``--layout``): each rank runs its shard through

* openk3: :func:`openk3.dist.kcp.context_parallel_kda` with the plan of the same ``cu_seqlens``;
* fla: ``fla.ops.kda.chunk_kda(..., use_gate_in_kernel=True, cp_context=build_cp_context(cu_seqlens, group,
  layout=...))``.

Reported per length: the relative RMSE of the two outputs and of ``dq`` (the same math with other kernels
and another cross-rank algorithm, so they agree to bf16 rounding, not bitwise), the median forward + backward
time of each (``--repeats`` after two warm-up calls, CUDA events, the slowest rank), and openk3 / fla.
Rank 0 writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GATE = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def inputs(T: int, H: int, D: int, device) -> dict[str, torch.Tensor]:
    """bf16 ``q, k, v, g`` ``[1, T, H, D]``, ``beta`` ``[1, T, H]`` and fp32 ``A_log [H]``, ``dt_bias [H·D]``,
    the same on every rank (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, T, H, D, generator=gen) for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T, H, generator=gen)
    x = {n: t.to(device, torch.bfloat16) for n, t in x.items()}
    x["A_log"] = torch.linspace(-1, 1, H).to(device)
    x["dt_bias"] = torch.full((H * D,), -2.0).to(device)
    return x


def documents(T: int, count: int) -> list[int]:
    """``cu_seqlens`` of ``count`` documents of random lengths summing to ``T`` (seed 1)."""
    if count == 1:
        return [0, T]
    gen = torch.Generator().manual_seed(1)
    cuts = sorted(torch.randperm(T - 1, generator=gen)[: count - 1].add(1).tolist())
    return [0, *cuts, T]


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after two warm-up calls, the slowest rank."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    worst = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def compare(T: int, docs: int, args, group) -> dict:
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from openk3.dist.cp_plan import ContextParallelPlan
    from openk3.dist.kcp import context_parallel_kda

    device = torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    cu = documents(T, docs)
    x = inputs(T, args.heads, args.dim, device)
    plan = ContextParallelPlan(tuple(cu), world, rank, args.layout)
    mine = {n: plan.shard(x[n]).contiguous() for n in ("q", "k", "v", "g", "beta")}
    dO = plan.shard(torch.randn(1, T, args.heads, args.dim, generator=torch.Generator().manual_seed(2)))
    dO = dO.to(device, torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    context = build_cp_context(cu_t, group, layout=args.layout)
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **GATE)

    def run_openk3():
        leaves = {n: t.detach().requires_grad_() for n, t in mine.items()}
        o = context_parallel_kda(*leaves.values(), plan=plan, group=group, **gate)
        o.backward(dO)
        return o, leaves["q"].grad

    def run_fla():
        leaves = {n: t.detach().requires_grad_() for n, t in mine.items()}
        o = fla_chunk_kda(*leaves.values(), use_gate_in_kernel=True, cp_context=context, **gate)[0]
        o.backward(dO)
        return o, leaves["q"].grad

    def rmse(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    (o_k, dq_k), (o_f, dq_f) = run_openk3(), run_fla()
    row = {"T": T, "docs": len(cu) - 1, "o_rel_rmse": rmse(o_k, o_f), "dq_rel_rmse": rmse(dq_k, dq_f)}
    row["openk3_ms"] = timed(run_openk3, args.repeats)
    row["fla_ms"] = timed(run_fla, args.repeats)
    row["ratio"] = row["openk3_ms"] / row["fla_ms"]
    return row


def markdown(report: dict) -> str:
    lines = [
        f"# KCP (openk3) vs fla `cp_context`: {report['world']} × {report['gpu']}",
        "",
        f"torch {report['torch']}, fla {report['fla']}, Python {report['python']}; {report['heads']} heads of "
        f"K = V = {report['dim']}, bf16, {report['layout']} layout; forward + backward, median ms, slowest rank.",
        "",
        "| T | documents | openk3 ms | fla ms | openk3 / fla | o rel. RMSE | dq rel. RMSE |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['T']:,} | {r['docs']} | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['T']:,} | {r['docs']} | {r['openk3_ms']:.2f} | {r['fla_ms']:.2f} | {r['ratio']:.2f} "
            f"| {r['o_rel_rmse']:.1e} | {r['dq_rel_rmse']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--docs", type=int, default=8, help="documents of the second row per length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="output prefix: OUT.json and OUT.md (rank 0)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("fla's context parallelism needs CUDA GPUs: run under torchrun on a GPU host")
    import fla

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=timedelta(seconds=300))
    group = dist.group.WORLD
    rows = []
    for T in args.lengths:
        for docs in (1, args.docs):
            try:
                rows.append(compare(T, docs, args, group))
            except torch.OutOfMemoryError as err:  # every rank holds the same shapes: all of them stop here
                rows.append({"T": T, "docs": docs, "error": str(err).splitlines()[0][:120]})
                torch.cuda.empty_cache()
            report = {
                "world": dist.get_world_size(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "fla": fla.__version__, "python": platform.python_version(), "heads": args.heads,
                "dim": args.dim, "layout": args.layout, "rows": rows,
            }  # fmt: skip
            if dist.get_rank() == 0:
                out = Path(args.out)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
                out.with_suffix(".md").write_text(markdown(report))
                print(markdown(report).splitlines()[-1], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
