"""Expert-parallel dispatch on gloo (CPU) or NCCL: the dropless all-to-all dispatcher vs the MoonEP contract.

For routings whose imbalance ``maxvio = max_e load_e / mean_load − 1`` grows from 0 to 5 this prints, per
EP rank (worst rank):

* **all-to-all** (``openk3.dist.dispatch``, measured): rows received (the receive buffer, which follows the
  routing), bytes of token rows sent to other ranks, and the time of one MoE expert forward + backward
  (dispatch, grouped experts, combine) across the world;
* **MoonEP contract** (``openk3.dist.moonep_planner``, computed from the plan; its dispatcher is not built
  yet, so no time): the fixed receive buffer ``S·K``, the rows sent to other ranks without and with the
  same-rank dedupe (a token sends its row once per destination rank), and the planner's time.

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


def moonep_rows(idx_RSK, E):
    """(rows sent to other ranks without dedupe, with dedupe) per rank, and the planner time, from the plan."""
    R, S, K = idx_RSK.shape
    tpe = torch.stack([torch.bincount(idx_RSK[r].flatten(), minlength=E) for r in range(R)])
    start = time.perf_counter()
    plan = plan_moonep(tpe, S * K)
    plan_s = time.perf_counter() - start
    cum = plan.alloc_ER.cumsum(1)  # [E, R]
    before = torch.cumsum(tpe, 0) - tpe  # entries of expert e from lower source ranks
    sent, sent_dedupe = [], []
    for r in range(R):
        flat = idx_RSK[r].flatten()
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        within = torch.arange(flat.numel()) - torch.searchsorted(
            e_sorted, e_sorted
        )  # index among e's entries
        global_rank = before[r, e_sorted] + within
        dest = torch.stack([torch.searchsorted(cum[e], g, right=True) for e, g in zip(e_sorted, global_rank)])
        dest_M = torch.empty_like(dest).index_copy_(0, order, dest).view(S, K)
        remote = dest_M != r
        sent.append(int(remote.sum()))
        pairs = {(s, int(d)) for s in range(S) for d in dest_M[s][remote[s]]}
        sent_dedupe.append(len(pairs))
    return max(sent), max(sent_dedupe), plan_s


def _worker(rank, world, port, backend, args, cases, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from openk3.dist.dispatch import combine, dispatch
    from openk3.model.moe import grouped_expert_ffn

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    E, S, L, F = args.experts, args.tokens, args.width, args.ffn
    P = E // world
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
        times = []
        for it in range(args.iters + 1):
            dist.barrier()
            start = time.perf_counter()
            d = dispatch(z, idx, E, dist.group.WORLD)
            y = combine(
                grouped_expert_ffn(Cfg, d.x_QL, w1, w3, w2, d.offs_P, d.expert_Q), w, d, dist.group.WORLD, S
            )
            y.square().sum().backward()
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.barrier()
            if it:
                times.append(time.perf_counter() - start)
        own = d.send_splits[rank]
        out.append((d.x_QL.shape[0], (sum(d.send_splits) - own) * L * z.element_size(), min(times)))
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
        "| maxvio | a2a recv rows (max rank) | a2a bytes sent (max rank) | a2a fwd+bwd ms | MoonEP recv rows | "
        "MoonEP rows sent (no dedupe / dedupe) | planner ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, idx in enumerate(cases):
        recv = max(got[r][i][0] for r in range(R))
        sent = max(got[r][i][1] for r in range(R))
        ms = max(got[r][i][2] for r in range(R)) * 1e3
        rows, rows_dedupe, plan_s = moonep_rows(idx, E)
        print(
            f"| {maxvio(idx, E):.2f} | {recv} | {sent:,} | {ms:.1f} | {S * K} | {rows} / {rows_dedupe} | "
            f"{plan_s * 1e3:.1f} |"
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
