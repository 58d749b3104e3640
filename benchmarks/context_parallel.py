"""Context parallelism: bytes moved, the summary + merge against the local chunk op, peak memory.

Three tables:

1. **bytes per rank per layer and direction** (from the shapes, :func:`openk3.dist.kcp.summary_bytes`): the
   KCP summaries (forward) and entry-state cotangents (backward), both independent of T, the conv halo and
   the MLA latents (which grow with T), for K3
   (96 heads of 128, conv width 4, 576-number latent) and for the measured model below;
2. **time** on one process, one document through the rank (the worst case: the whole local row is one
   summarised piece), as KCP runs them in a training step: the local ``chunk_kda`` forward (inputs requiring
   grad) and forward + backward, :func:`segment_summaries` over the same row without a graph, and the fold
   of ``W − 1`` predecessors (the merge). KCP's extra work per step (:mod:`openk3.dist.kcp`) is the summary,
   the merge and a second local backward (the exit-state cotangents): the last column, against the op's
   forward + backward (the two small all-gathers are not included). ``--device cpu``: fp32, the torch
   summaries from the chunk factors;
   ``--device cuda``: bf16 inputs, the Triton op and the Triton summaries (the augmented-value calls of
   :func:`~openk3.ops.kda.summary.kernel_summaries`), timed after a warm-up (compilation) with the device
   synchronised, best of ``--repeats``;
3. **peak memory per rank** (CPU only: peak resident set of the process, MiB, lengths run in ascending order)
   of a k3-tiny KDA layer's forward + backward under CP at world ``--world`` (gloo) as T grows, against the
   unsharded layer in one process; the first row is the process before any forward (torch, the model).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/context_parallel.py   # ~2 min on 2 cores
    PYTHONPATH=src python benchmarks/context_parallel.py --device cuda      # H200: ~1 min, most of it compiling

Legend: ``T`` global tokens, ``L`` local tokens, ``H`` heads, ``K`` = ``V`` head dim, ``W`` ranks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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


def bytes_table(H: int, K: int, conv_width: int, latent: int | None, T: int, W: int, name: str) -> list[str]:
    """One row; ``latent`` None (a bare KDA op, no MLA layer) prints a dash for the latents."""
    L = T // W
    kcp = summary_bytes(H, K, K)
    reverse = H * K * K * 4  # the backward's entry-state cotangents F, K×V per head
    halo = (conv_width - 1) * 3 * H * K * 4
    mla = "—" if latent is None else f"{L * latent * 4 / MIB:.2f}"
    return [
        f"| {name} | {H}×{K} | {T:,} / {W} | {kcp / MIB:.3f} | {reverse / MIB:.3f} | {halo / MIB:.4f} | {mla} |"
    ]


def _inputs(L: int, H: int, K: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    x = dict(q=r(1, L, H, K), k=r(1, L, H, K), v=r(1, L, H, K), g=r(1, L, H, K), beta=r(1, L, H))
    gate = dict(
        A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * K, device=device), lower_bound=-5.0
    )
    return x, dict(gate, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _best(fn, device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls after one warm-up call (the device synchronised)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _jobs(x: dict, kw: dict, W: int):
    """The four timed calls on one local row as a training step under KCP runs them: op fwd and op fwd+bwd
    (inputs requiring grad), summary fwd (no graph), merge."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    chain = segment_summaries(*x.values(), **kw).expand(W - 1, -1, -1, -1).contiguous()

    def op_fwd():
        chunk_kda(*leaves.values(), **kw)

    def op_fwd_bwd():
        chunk_kda(*leaves.values(), **kw)[0].float().sum().backward()

    def summary_fwd():
        with torch.no_grad():
            segment_summaries(*x.values(), **kw)

    return op_fwd, op_fwd_bwd, summary_fwd, lambda: fold_from_zero(chain)


def time_table(lengths, H: int, K: int, W: int, device: torch.device, dtype, repeats: int) -> list[str]:
    rows = []
    for L in lengths:
        x, kw = _inputs(L, H, K, device, dtype)
        fwd, fwd_bwd, summary, merge = (_best(f, device, repeats) * 1e3 for f in _jobs(x, kw, W))
        del x
        extra = summary + merge + (fwd_bwd - fwd)
        rows.append(
            f"| {L:,} | {fwd:.2f} | {fwd_bwd:.2f} | {summary:.2f} ({summary / fwd:.2f}×) | {merge:.3f} | "
            f"{extra:.2f} ({extra / fwd_bwd:.2f}×) |"
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="local tokens L (default: 1K–4K CPU, 8K–128K CUDA)"
    )
    parser.add_argument("--heads", type=int, help="H of the timed op (default: 4 CPU, 16 CUDA)")
    parser.add_argument("--dim", type=int, help="K = V of the timed op (default: 64 CPU, 128 CUDA)")
    parser.add_argument(
        "--repeats", type=int, help="timed calls per job, best kept (default: 3 CPU, 10 CUDA)"
    )
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    lengths = args.lengths or ([8192, 32768, 131072] if cuda else [1024, 2048, 4096])
    H = args.heads or (16 if cuda else 4)
    K = args.dim or (128 if cuda else 64)
    repeats = args.repeats or (10 if cuda else 3)
    torch.set_num_threads(1)
    where = (
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton "
        f"{importlib.metadata.version('triton')}"
        if cuda
        else f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread"
    )
    print(f"# context parallelism on {args.device} ({where})\n")
    print("## Bytes one rank sends per layer, each direction (fp32)\n")
    print(
        "| model | heads × dim | T / W | KCP summaries, forward (MiB) | KCP cotangents F, backward (MiB) | "
        "conv halo (MiB) | MLA latents (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for T in (131072, 1048576):
        print(*bytes_table(96, 128, 4, 576, T, 8, "K3"), sep="\n")
    tiny = get_preset("k3-tiny").text_config
    tiny_latent = tiny.kv_lora_rank + tiny.qk_rope_head_dim
    print(*bytes_table(4, 64, 4, tiny_latent, 8192, args.world, "k3-tiny (memory table)"), sep="\n")
    print(*bytes_table(H, K, 4, None, max(lengths) * args.world, args.world, "timed op"), sep="\n")
    summaries = "Triton kernels" if cuda else "torch chunk factors"
    print(
        f"\n## Time on one rank: local chunk op vs summary ({summaries}) and merge "
        f"(H={H}, K=V={K}, {str(dtype)[6:]}, ms, best of {repeats})\n"
    )
    print(
        f"| L (local tokens) | chunk_kda fwd | chunk_kda fwd+bwd | summary (no graph; × op fwd) | "
        f"merge of {args.world - 1} | KCP extra per step (× op fwd+bwd) |"
    )
    print("|---|---|---|---|---|---|")
    print(*time_table(lengths, H, K, args.world, device, dtype, repeats), sep="\n")
    if cuda:
        return
    print(
        "\n## Peak resident memory (MiB) of a k3-tiny KDA layer, forward + backward, one document of T tokens\n"
    )
    print(f"| T | one process, unsharded | per rank, CP over {args.world} (gloo) |")
    print("|---|---|---|")
    print(*memory_table(args.memory_lengths, args.world), sep="\n")


if __name__ == "__main__":
    main()
