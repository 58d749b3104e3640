"""Context parallelism on the CPU: bytes moved, the summary + merge against the local chunk op, peak memory.

Three tables:

1. **bytes per rank per layer and direction** (from the shapes, :func:`openk3.dist.kcp.summary_bytes`): the
   KCP summaries (independent of T), the conv halo and the MLA latents (which grow with T), for K3
   (96 heads of 128, conv width 4, 576-number latent) and for the measured model below;
2. **time** on one process, fp32, one document through the rank (the worst case: the whole local row is one
   summarised piece): the forward of the local ``chunk_kda``, of :func:`segment_summaries` over the same row,
   and of the fold of ``W − 1`` predecessors (the merge), and forward + backward of op and summary;
3. **peak memory per rank** (peak resident set of the process, MiB, lengths run in ascending order) of a
   k3-tiny KDA layer's forward + backward under CP at world ``--world`` (gloo) as T grows, against the
   unsharded layer in one process; the first row is the process before any forward (torch, the model).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/context_parallel.py   # ~2 min on 2 cores

Legend: ``T`` global tokens, ``L`` local tokens, ``H`` heads, ``K`` = ``V`` head dim, ``W`` ranks.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk3.dist.kcp import summary_bytes
from openk3.ops.kda import chunk_kda
from openk3.ops.kda.summary import fold_from_zero, segment_summaries
from openk3.presets import get_preset

MIB = 2**20


def bytes_table(H: int, K: int, conv_width: int, latent: int, T: int, W: int, name: str) -> list[str]:
    L = T // W
    kcp = summary_bytes(H, K, K)
    halo = (conv_width - 1) * 3 * H * K * 4
    mla = L * latent * 4
    return [f"| {name} | {H}×{K} | {T:,} / {W} | {kcp / MIB:.3f} | {halo / MIB:.4f} | {mla / MIB:.2f} |"]


def _inputs(L: int, H: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(1, L, H, K), k=r(1, L, H, K), v=r(1, L, H, K), g=r(1, L, H, K), beta=r(1, L, H))
    gate = dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), lower_bound=-5.0)
    return x, dict(gate, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _jobs(x: dict, kw: dict, W: int):
    """The five timed calls on one local row: op fwd, summary fwd, merge, op fwd+bwd, summary fwd+bwd."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    chain = segment_summaries(*x.values(), **kw).detach().expand(W - 1, -1, -1, -1).contiguous()

    def op_fwd():
        with torch.no_grad():
            chunk_kda(*x.values(), **kw)

    def summary_fwd():
        with torch.no_grad():
            segment_summaries(*x.values(), **kw)

    def op_fwd_bwd():
        chunk_kda(*leaves.values(), **kw)[0].sum().backward()

    def summary_fwd_bwd():
        segment_summaries(*leaves.values(), **kw).sum().backward()

    return op_fwd, summary_fwd, lambda: fold_from_zero(chain), op_fwd_bwd, summary_fwd_bwd


def time_table(lengths, H: int, K: int, W: int) -> list[str]:
    rows = []
    for L in lengths:
        x, kw = _inputs(L, H, K)
        t = [_best(f) * 1e3 for f in _jobs(x, kw, W)]
        rows.append(
            f"| {L:,} | {t[0]:.1f} | {t[1]:.1f} ({t[1] / t[0]:.2f}×) | {t[2]:.2f} | {t[3]:.1f} | "
            f"{t[4]:.1f} ({t[4] / t[3]:.2f}×) |"
        )
    return rows


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _layer_and_input(T: int, seed: int = 0):
    from openk3.model.modeling import build_model
    from openk3.presets import k3_shaped

    model = build_model(k3_shaped(8, vocab_size=256), device="cpu", seed=seed)
    layer = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    D = model.language_model.model.config.hidden_size
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1))
    return layer, x


def _memory_rank(rank: int, world: int, port: int, lengths, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    from openk3.dist.context_parallel import apply_context_parallel

    _layer_and_input(lengths[0])
    out = [_rss_mib()]
    for T in lengths:
        layer, x = _layer_and_input(T)
        plan = apply_context_parallel(torch.nn.ModuleDict({"a": layer})).begin([0, T])
        layer(plan.shard(x).requires_grad_()).sum().backward()
        out.append(_rss_mib())
    queue.put((rank, out))
    dist.destroy_process_group()


def _memory_single(lengths, queue) -> None:
    torch.set_num_threads(1)
    _layer_and_input(lengths[0])
    out = [_rss_mib()]
    for T in lengths:
        layer, x = _layer_and_input(T)
        x = x.requires_grad_()
        layer(x).sum().backward()
        out.append(_rss_mib())
    queue.put((-1, out))


def memory_table(lengths, W: int) -> list[str]:
    """Peak RSS (MiB) per process after running each length in turn (lengths ascending: the peak of a run is
    its longest length's so far)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_memory_rank, args=(r, W, port, lengths, queue)) for r in range(W)]
    procs.append(ctx.Process(target=_memory_single, args=(lengths, queue)))
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    rows = [
        f"| before the first forward | {results[-1][0]:.0f} | {max(results[r][0] for r in range(W)):.0f} |"
    ]
    for i, T in enumerate(lengths, start=1):
        per_rank = max(results[r][i] for r in range(W))
        rows.append(f"| {T:,} | {results[-1][i]:.0f} | {per_rank:.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    args = parser.parse_args()
    torch.set_num_threads(1)
    H, K = 4, 64
    print(
        f"# context parallelism on the CPU ({platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread)\n"
    )
    print("## Bytes one rank sends per layer, each direction (fp32)\n")
    print("| model | heads × dim | T / W | KCP summaries (MiB) | conv halo (MiB) | MLA latents (MiB) |")
    print("|---|---|---|---|---|---|")
    for T in (131072, 1048576):
        print(*bytes_table(96, 128, 4, 576, T, 8, "K3"), sep="\n")
    tiny = get_preset("k3-tiny").text_config
    tiny_latent = tiny.kv_lora_rank + tiny.qk_rope_head_dim
    print(*bytes_table(H, K, 4, tiny_latent, 8192, args.world, "k3-tiny (below)"), sep="\n")
    print(
        f"\n## Time on one rank: local chunk op vs summary and merge (H={H}, K=V={K}, fp32, ms, best of 3)\n"
    )
    print(
        f"| L (local tokens) | chunk_kda fwd | summary fwd | merge of {args.world - 1} | chunk_kda fwd+bwd | summary fwd+bwd |"
    )
    print("|---|---|---|---|---|---|")
    print(*time_table(args.lengths, H, K, args.world), sep="\n")
    print(
        "\n## Peak resident memory (MiB) of a k3-tiny KDA layer, forward + backward, one document of T tokens\n"
    )
    print(f"| T | one process, unsharded | per rank, CP over {args.world} (gloo) |")
    print("|---|---|---|")
    print(*memory_table(args.memory_lengths, args.world), sep="\n")


if __name__ == "__main__":
    main()
