"""Expert-parallel dispatch on gloo (CPU) or NCCL: the dropless all-to-all dispatcher vs the MoonEP contract.

For routings whose imbalance ``maxvio = max_e load_e / mean_load − 1`` grows from 0 to 5 this measures, per
EP rank (worst rank), both dispatchers behind the same call (``openk3.dist.expert_parallel.DISPATCHERS``):

* **all-to-all** (``openk3.dist.dispatch``): rows received (the receive buffer, which follows the
  routing), bytes of token rows sent to other ranks, and the time of one routed-experts forward + backward
  (dispatch, grouped experts, combine) across the world;
* **MoonEP contract** (``openk3.dist.moonep``): rows computed (fixed at ``S·K``), entries sent to other
  ranks and the distinct rows actually sent after the same-rank dedupe, bytes sent (token rows plus the
  redundant experts' weights), the forward + backward time, and the time of its routing step alone
  (counts all-gather, host sync, planner, dedupe count exchange and the second host sync).

Then the planner's time at the official scale (E = 896, R = 64, S = 4096, K = 16).

    PYTHONPATH=src python benchmarks/ep.py --world 2            # gloo on the CPU
    PYTHONPATH=src python benchmarks/ep.py --world 8 --nccl     # one GPU per rank
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk3.dist.moonep_planner import plan_moonep

MAXVIO_TARGETS = (0.0, 0.5, 1.0, 2.0, 3.0, 5.0)


def routing(R, E, S, K, target, seed=0):
    """``indices [R, S, K]`` with realised maxvio near ``target``: lognormal(σ) expert popularity, σ bisected;
    target 0 is a round-robin routing (exactly balanced)."""
    if target == 0:
        base = torch.arange(R * S * K).view(R, S, K)
        return (base + torch.arange(R * S).view(R, S, 1) // (E // K)) % E
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(E, generator=g)
    lo, hi = 0.0, 8.0
    for _ in range(30):
        sigma = (lo + hi) / 2
        p = torch.softmax(z * sigma, 0)
        idx = torch.multinomial(
            p.expand(R * S, E), K, replacement=False, generator=torch.Generator().manual_seed(seed)
        )
        loads = torch.bincount(idx.flatten(), minlength=E).double()
        mv = float(loads.max() / loads.mean() - 1)
        if abs(mv - target) < 0.02 * max(target, 0.1):
            break
        lo, hi = (sigma, hi) if mv < target else (lo, sigma)
    return idx.view(R, S, K)


def maxvio(idx, E):
    loads = torch.bincount(idx.flatten(), minlength=E).double()
    return float(loads.max() / loads.mean() - 1)


def _timed(fn, iters, nccl):
    """``(best wall s across the world, best CPU s of this process)`` of ``iters`` runs of ``fn()`` (after
    one warm-up), and its last result. The CPU time (``time.process_time``: this rank's threads, gloo's
    included, not time spent waiting) is the fairer number on a shared machine."""
    walls, cpus = [], []
    for it in range(iters + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        result = fn()
        if nccl:
            torch.cuda.synchronize()
        cpu = time.process_time() - cpu
        dist.barrier()
        if it:
            walls.append(time.perf_counter() - start)
            cpus.append(cpu)
    return (min(walls), min(cpus)), result


def _worker(rank, world, port, backend, args, cases, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from openk3.dist.dispatch import dispatch
    from openk3.dist.expert_parallel import DISPATCHERS
    from openk3.dist.moonep import route

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    E, S, L, F = args.experts, args.tokens, args.width, args.ffn
    P = E // world
    group = dist.group.WORLD
    nccl = backend == "nccl"
    g = torch.Generator().manual_seed(rank)
    w1, w3 = (torch.randn(P, F, L, generator=g).to(device).requires_grad_() for _ in range(2))
    w2 = torch.randn(P, L, F, generator=g).to(device).requires_grad_()

    class Cfg:
        hidden_act, activation_situ_beta, activation_situ_linear_beta = "silu", 4.0, 25.0

    out = []
    for idx_RSK in cases:
        idx = idx_RSK[rank].to(device)
        z = torch.randn(S, L, generator=g).to(device).requires_grad_()
        w = torch.rand(S, idx.shape[1], generator=g).to(device)
        row = {}
        for name, run in DISPATCHERS.items():

            def step(run=run, z=z, w=w, idx=idx):
                run(Cfg, z, w, idx, w1, w3, w2, E, group).square().sum().backward()

            row[name], _ = _timed(step, args.iters, nccl)
        d = dispatch(z, idx, E, group)
        row["a2a_rows"] = d.x_QL.shape[0]
        row["a2a_bytes"] = (sum(d.send_splits) - d.send_splits[rank]) * L * z.element_size()
        row["route"], r = _timed(lambda idx=idx: route(idx, E, group), args.iters, nccl)
        row["moon_rows"] = sum(r.slot_sizes)
        row["moon_entries"] = sum(r.send_entries) - r.send_entries[rank]
        row["moon_sent"] = r.rows_sent_remote(rank)
        copies = sum(r.copy_send) * 3 * F * L * w1.element_size()
        row["moon_bytes"] = r.rows_sent_remote(rank) * L * z.element_size() + copies
        out.append(row)
    results.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank (S)")
    ap.add_argument("--width", type=int, default=256, help="dispatch width L (the latent width)")
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    R, E, S, K = args.world, args.experts, args.tokens, args.topk
    cases = [routing(R, E, S, K, t) for t in MAXVIO_TARGETS]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    backend = "nccl" if args.nccl else "gloo"
    procs = [ctx.Process(target=_worker, args=(r, R, port, backend, args, cases, results)) for r in range(R)]
    for p in procs:
        p.start()
    got = {}
    while len(got) < R:
        try:
            rank, out = results.get(timeout=5)
            got[rank] = out
        except Exception:  # noqa: BLE001 - queue.Empty: check that the workers still live
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join()
    print(f"torch {torch.__version__}, {backend}, {platform.processor() or platform.machine()}, world {R}")
    print(f"E={E} K={K} S={S} tokens/rank, L={args.width} (fp32 rows of {args.width * 4} B), F={args.ffn}\n")
    print(
        "| maxvio | a2a recv rows | a2a bytes sent | a2a fwd+bwd ms wall / CPU | MoonEP rows computed | "
        "MoonEP entries / rows sent (dedupe) | MoonEP bytes sent (rows + expert copies) | "
        "MoonEP fwd+bwd ms wall / CPU | MoonEP routing ms wall / CPU (2 host syncs + planner) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, idx in enumerate(cases):
        rows = [got[r][i] for r in range(R)]

        def worst(key, rows=rows):
            return max(row[key] for row in rows)

        def ms(key, rows=rows):
            return " / ".join(f"{max(row[key][j] for row in rows) * 1e3:.1f}" for j in (0, 1))

        print(
            f"| {maxvio(idx, E):.2f} | {worst('a2a_rows')} | {worst('a2a_bytes'):,} | {ms('alltoall')} "
            f"| {worst('moon_rows')} | {worst('moon_entries')} / {worst('moon_sent')} | {worst('moon_bytes'):,} "
            f"| {ms('moonep')} | {ms('route')} |"
        )
    tpe = torch.stack(
        [
            torch.bincount(routing(1, 896, 4096, 16, 1.0, seed=r)[0].flatten(), minlength=896)
            for r in range(64)
        ]
    )
    start = time.perf_counter()
    plan_moonep(tpe, 4096 * 16)
    print(
        f"\nplanner at E=896, R=64, S=4096, K=16 (σ for maxvio≈1): {(time.perf_counter() - start) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
