"""GPU speed of the Triton KDA kernels against flash-linear-attention (fla) 0.6.0, measured in one run.

Both sides get the same bf16 inputs and the K3 flags: gate in the kernel with ``lower_bound = −5`` (fla:
``safe_gate=True``), q/k L2 norm in the kernel, β from logits (``use_beta_sigmoid_in_kernel`` on both
sides; before 2026-11-30 ours took ``torch.sigmoid`` inside the timed region instead). Times are CUDA-event
medians.
Decode is one token per sequence on H = 96, D = 128: ours updates a fp32 state pool in place
(``fused_recurrent_kda_decode``); fla is timed both through its public ``fused_recurrent_kda`` (new final
state, the anchor of ``docs/references.md#project-targets``) and through ``fused_recurrent_kda_fwd`` in place
on the pool. Each decode time
is given eagerly (a loop of launches between two events, host overhead included) and replayed from a CUDA
graph (device time only). fla is optional: without it only our numbers are printed.

    python benchmarks/kda.py                               # table on stdout
    python benchmarks/kda.py --out runs/kda                # also kda_h200.json and kda_h200.md there
    python benchmarks/kda.py --sweep                       # also time launch configurations per kernel
    python benchmarks/kda.py --sweep --sweep-shapes 1,3    # ... at B1 T8192 H96 and B1 T32768 H32
    python benchmarks/kda.py --sections breakdown --breakdown-shapes 1,3   # per-launch times at both
    python benchmarks/kda.py --sections chunk --keep-residuals   # ours with KDAOptions(keep_residuals=True)
    python benchmarks/kda.py --autotune-cache runs/autotune   # keep fla's autotuning results between runs

fla autotunes its kernels on first use for each shape; on a fresh H200 machine that took 3 min 43 s for B1
T32768 H32 alone and 6 min 52 s for the first two shapes (compiling every candidate configuration).
``--autotune-cache DIR`` turns on Triton's on-disk autotuning cache (``TRITON_CACHE_AUTOTUNING``), copies the
results kept in ``DIR`` into Triton's cache before fla is imported and copies them back after every section: a
later run on the same GPU, Triton and fla versions then takes fla's configurations from the earlier run's
timings instead of timing them again (Triton keys each result on those versions, the kernel's source, its
configurations and the shapes it is tuned for, so anything else is tuned afresh). DIR is created when needed
and may be Triton's cache directory itself; the results of a section are written to ``--out`` before the copy,
and a result that cannot be copied is reported, not raised. Our kernels are not autotuned: their launch
geometry is a :class:`~openk3.ops.kda.triton.config.LaunchConfig` passed to every call; the sweep times other
ones, ``--tune`` times the chunk rows with the fastest.

The roofline column is the larger of (fewest bytes: each input read once, each output written once, per
pass) / 4.3 TB/s and (chunk-form matmul FLOPs) / 790 TFLOP/s, the copy bandwidth and bf16 matmul rate
measured on this workplace's H200s.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``D`` head dim (K = V = D), ``C`` chunk (64).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from openk3.checkpoint.out_folder import out_dir_problem
from openk3.ops.kda import chunk_kda
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, KDAOptions, LaunchConfig

LOWER_BOUND = -5.0
HBM_BYTES_PER_S = 4.3e12
BF16_FLOP_PER_S = 7.9e14
CHUNK_SHAPES = [
    ("B1 T8192 H96 D128", 1, 8192, 96, 128, None),
    ("B1 T8192 H96 D128 varlen 1024x8", 1, 8192, 96, 128, [1024] * 8),
    ("B1 T32768 H32 D128", 1, 32768, 32, 128, None),
    ("B8 T4096 H32 D128", 8, 4096, 32, 128, None),
]
FIXED_SHAPE_NUMBERS = {str(i) for i, shape in enumerate(CHUNK_SHAPES, 1) if shape[5] is None}
"""Numbers of the fixed-length chunk shapes (no packed documents): where the sweep and breakdown can run."""
SECTIONS = ("decode", "chunk", "breakdown", "sweep")
DECODE_SHAPES = [("decode B1 H96 D128", 1, 96, 128), ("decode B64 H96 D128", 64, 96, 128)]


def directory_argument(text: str) -> Path:
    """A directory option's value as a path (a leading ``~`` or ``~user`` expanded, also after ``--flag=``;
    ``./~`` stays a directory named ``~``); an empty value is refused, since it would name the current
    directory unseen."""
    if not text:
        raise argparse.ArgumentTypeError("give a directory name, not an empty string")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise argparse.ArgumentTypeError(f"{text}: no such user's home directory")
    return Path(expanded)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv`` (default ``sys.argv[1:]``); a bad argument exits with argparse's status 2."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=directory_argument, help="directory for kda_h200.json and kda_h200.md")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per forward measurement")
    parser.add_argument(
        "--sweep", action="store_true", help="also time launch configurations per kernel (adds section sweep)"
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="sweep first, then time everything with the fastest configurations",
    )
    parser.add_argument("--skip-fla", action="store_true", help="time our kernels only")
    parser.add_argument(
        "--autotune-cache",
        type=directory_argument,
        metavar="DIR",
        help="keep Triton's autotuning results (every *.autotune.json in Triton's cache: fla's "
        "configurations) in DIR between runs",
    )
    parser.add_argument(
        "--keep-residuals", action="store_true", help="time ours with KDAOptions(keep_residuals=True)"
    )
    parser.add_argument(
        "--fp32-gated-keys", action="store_true", help="time ours with KDAOptions(fp32_gated_keys=True)"
    )
    parser.add_argument(
        "--fla-passes",
        default="fwd,fwd+bwd",
        help="passes timed for fla (default both); its forward is always timed, fwd+bwd adds forward+backward",
    )
    parser.add_argument(
        "--shapes", default=None, help="comma list of chunk-shape numbers (1-4) to run; default all"
    )
    parser.add_argument(
        "--sections", default="decode,chunk,breakdown", help="comma list of decode, chunk, breakdown, sweep"
    )
    parser.add_argument(
        "--sweep-modules", default="", help="comma list of SWEEP modules for --sections sweep; default all"
    )
    parser.add_argument(
        "--sweep-shapes",
        default=None,
        help="comma list of fixed-length chunk-shape numbers (1, 3, 4) the sweep runs at; default 1",
    )
    parser.add_argument(
        "--breakdown-shapes",
        default=None,
        help="comma list of fixed-length chunk-shape numbers (1, 3, 4) the breakdown runs at; default 1",
    )
    args = parser.parse_args(argv)
    args.options = KDAOptions(keep_residuals=args.keep_residuals, fp32_gated_keys=args.fp32_gated_keys)
    if not 1 <= args.iters <= 1000:
        parser.error(f"--iters must be in [1, 1000]; got {args.iters}")
    # before any GPU work: the results are saved only after the first section
    if args.out is not None and (problem := out_dir_problem(args.out)):
        parser.error(problem)
    if args.autotune_cache is not None and (
        problem := out_dir_problem(args.autotune_cache, "--autotune-cache")
    ):
        parser.error(problem)
    checks = (
        ("--sections", args.sections, set(SECTIONS)),
        ("--shapes", args.shapes or "", {str(i) for i in range(1, len(CHUNK_SHAPES) + 1)}),
        ("--fla-passes", args.fla_passes, {"fwd", "fwd+bwd"}),
        ("--sweep-modules", args.sweep_modules, set(SWEEP)),
        ("--sweep-shapes", args.sweep_shapes or "", FIXED_SHAPE_NUMBERS),
        ("--breakdown-shapes", args.breakdown_shapes or "", FIXED_SHAPE_NUMBERS),
    )
    for flag, value, allowed in checks:
        items = [x for x in value.split(",") if x]
        unknown = [x for x in items if x not in allowed]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; choose from {sorted(allowed)}")
        if len(set(items)) < len(items):
            parser.error(f"{flag}: {value!r} names one twice")
    if not [x for x in args.sections.split(",") if x] and not args.sweep and not args.tune:
        parser.error("--sections: give at least one of " + ", ".join(SECTIONS))
    if args.sweep:
        args.sections += ",sweep"
    for flag, given in (
        ("--sweep-modules", args.sweep_modules),
        ("--sweep-shapes", args.sweep_shapes is not None),
    ):
        if given and "sweep" not in args.sections.split(",") and not args.tune:
            parser.error(f"{flag} needs --sweep, --sections ...,sweep or --tune")
    if args.breakdown_shapes is not None and "breakdown" not in args.sections.split(","):
        parser.error("--breakdown-shapes needs --sections ...,breakdown")
    for flag, value, numbers in (
        ("--shapes", args.shapes, "1-4"),
        ("--sweep-shapes", args.sweep_shapes, "1, 3, 4"),
        ("--breakdown-shapes", args.breakdown_shapes, "1, 3, 4"),
    ):
        if value is not None and not [i for i in value.split(",") if i]:
            parser.error(f"{flag}: give at least one shape number ({numbers})")
    return args


# ------------------------------------------------------------------------------------------------ timing


AUTOTUNE_SUFFIX = ".autotune.json"


def copy_autotune_results(src: Path, dst: Path) -> tuple[int, list[str]]:
    """Copy every Triton autotuning result (a file ``<key>/<kernel>.autotune.json``) under ``src`` to the same
    relative path under ``dst``, each through a temporary file and ``os.replace`` (a run killed mid-copy
    leaves no truncated result for Triton to read).

    Returns:
        ``(copied, problems)``: how many results ``dst`` now holds from ``src``, and one line per result
        that could not be copied (unreadable, or ``dst`` not writable); nothing raises for those. A missing
        ``src`` has none; a result that already is ``dst``'s (``dst`` naming ``src``, or a link to it) counts
        as copied without a copy.
    """
    import shutil
    import tempfile

    copied, problems = 0, []
    try:
        found = sorted(src.glob(f"*/*{AUTOTUNE_SUFFIX}")) if src.is_dir() else []
    except OSError as err:
        return 0, [f"{src}: {err.strerror or err}"]
    for path in found:
        target, tmp = dst / path.relative_to(src), None
        try:
            if not path.is_file():  # a directory of that name, or a link to nothing
                continue
            if target.exists() and target.samefile(path):
                copied += 1
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".", delete=False) as tmp:
                with open(path, "rb") as result:
                    shutil.copyfileobj(result, tmp)
            shutil.copymode(path, tmp.name)  # not the temporary file's 0600
            os.replace(tmp.name, target)
            copied += 1
        except OSError as err:
            problems.append(f"{path} -> {target}: {err.strerror or err}")
            if tmp is not None:  # the temporary file of a failed copy
                with contextlib.suppress(OSError):
                    os.unlink(tmp.name)
    return copied, problems


def triton_cache_dir() -> Path:
    """Triton's on-disk cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def time_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median CUDA-event time of ``fn()`` in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_us_per_call(fn, calls: int = 200, repeats: int = 5) -> dict:
    """Decode-sized work: eager (``calls`` launches between two events) and CUDA-graph replay, µs/call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    eager = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3 / calls)
    out = {"eager_us": statistics.median(eager), "graph_us": None}
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        replays = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            replays.append(start.elapsed_time(end) * 1e3 / 200)
        out["graph_us"] = statistics.median(replays)
    except Exception as err:  # noqa: BLE001 - a call that cannot be captured is reported, not fatal
        out["graph_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


def rel_rmse(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((out - ref).square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------- inputs


def chunk_inputs(B, T, H, D, lens, seed=0) -> dict:
    """bf16 q, k, v, raw gate, β logits; fp32 ``A_log`` (0, K3 init) and ``dt_bias`` (inverse softplus of
    log-uniform [1e-3, 0.1], fla's layer init, ``docs/references.md#kda-layer-initialisation``)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    dt = torch.exp(torch.rand(H * D, generator=gen, device="cuda") * (2.302585 * 2) - 6.907755).clamp_min(
        1e-4
    )
    x = dict(
        q=randn(B, T, H, D).bfloat16(),
        k=randn(B, T, H, D).bfloat16(),
        v=randn(B, T, H, D).bfloat16(),
        g=randn(B, T, H, D).bfloat16(),
        beta=randn(B, T, H).bfloat16(),
        A_log=torch.zeros(H, device="cuda"),
        dt_bias=dt + torch.log(-torch.expm1(-dt)),
    )
    x["cu_seqlens"] = None
    if lens is not None:
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        x["cu_seqlens"] = torch.tensor(offsets, device="cuda", dtype=torch.int64)
    return x


def ours_chunk(x, options: KDAOptions | None = None, launch: LaunchConfig | None = None):
    return chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
        lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        cu_seqlens=x["cu_seqlens"], options=options, launch=launch,
    )[0]  # fmt: skip


def fla_chunk(x):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        safe_gate=True, lower_bound=LOWER_BOUND, cu_seqlens=x["cu_seqlens"],
    )[0]  # fmt: skip


LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def fwd_bwd(op, x, do):
    for name in LEAVES:
        x[name].grad = None
    op(x).backward(do)


# ------------------------------------------------------------------------------------------------ model


def roofline(B, T, H, D, passes: str) -> dict:
    """Fewest bytes, chunk-form matmul FLOPs and the time floor of one call (see the module docstring)."""
    C, tokens = 64, B * T
    chunks = B * -(-T // C) * H
    io_fwd = tokens * H * (5 * D * 2 + 2)  # q, k, v, g, β read; o written (bf16)
    macs_fwd = 3 * C * C * D + 2 * C * C * D + 3 * C * D * D  # Aqk, L, W | U, Aqk·E | W·S, Q̃·S, K̂ᵀE
    macs_bwd = macs_fwd + 6 * C * D * D + 4 * C * C * D + 7 * C * C * D  # recompute, state bwd, WY, intra
    io = io_fwd if passes == "fwd" else io_fwd + tokens * H * (11 * D * 2 + 4)
    flops = 2 * chunks * (macs_fwd if passes == "fwd" else macs_fwd + macs_bwd)
    floor = max(io / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S)
    return {
        "bytes": io,
        "flops": flops,
        "floor_ms": floor * 1e3,
        "bound": "memory" if io / HBM_BYTES_PER_S * BF16_FLOP_PER_S >= flops else "compute",
    }


def decode_roofline(B, H, D) -> dict:
    io = B * H * (2 * D * D * 4 + 4 * D * 2 + 2)  # fp32 state read + written; q, k, v, g read; o written
    return {"bytes": io, "floor_us": io / HBM_BYTES_PER_S * 1e6}


# ------------------------------------------------------------------------------------------- benchmarks


def bench_chunk(
    name, B, T, H, D, lens, iters, use_fla, fla_bwd, rows: list, save, options=None, launch=None
) -> None:
    """Append the forward, then the forward+backward row of one shape to ``rows``, calling ``save()`` after
    each, so a run cut short keeps its forward row. ``options``, ``launch``: ours' trades and geometry."""
    x = chunk_inputs(B, T, H, D, lens)
    ours = functools.partial(ours_chunk, options=options, launch=launch)
    ops = {"ours": ours} | ({"fla": fla_chunk} if use_fla else {})
    fwd_ops = ops
    with torch.no_grad():
        outs = {side: op(x) for side, op in fwd_ops.items()}
        times = {side: time_ms(lambda op=op: op(x), iters) for side, op in fwd_ops.items()}
    rows.append(_row(name, "fwd", times, roofline(B, T, H, D, "fwd")))
    if use_fla:
        rows[-1]["ours_vs_fla_o_rel_rmse"] = rel_rmse(outs["fla"], outs["ours"])
    save()
    del outs
    if not fla_bwd:
        ops.pop("fla", None)
        use_fla = False
    for n in LEAVES:
        x[n].requires_grad_()
    do = torch.randn(
        B, T, H, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)
    ).bfloat16()
    grads = {}
    for side, op in ops.items():
        fwd_bwd(op, x, do)
        grads[side] = {n: x[n].grad.clone() for n in LEAVES}
    times = {side: time_ms(lambda op=op: fwd_bwd(op, x, do), max(iters // 2, 3)) for side, op in ops.items()}
    rows.append(_row(name, "fwd+bwd", times, roofline(B, T, H, D, "fwd+bwd")))
    if use_fla:
        rows[-1]["ours_vs_fla_grad_rel_rmse"] = {
            n: rel_rmse(grads["fla"][n], grads["ours"][n]) for n in LEAVES
        }
    save()


def _row(name, passes, times, roof) -> dict:
    row = {"shape": name, "pass": passes, "ours_ms": times["ours"], "fla_ms": times.get("fla")}
    row["speedup"] = row["fla_ms"] / row["ours_ms"] if row["fla_ms"] else None
    row["roofline"] = roof
    row["ours_over_floor"] = row["ours_ms"] / roof["floor_ms"]
    print(f"{name:<34} {passes:<8} ours {row['ours_ms']:8.3f} ms   fla {row['fla_ms'] or float('nan'):8.3f} ms   "
          f"x{row['speedup'] or float('nan'):5.2f}   floor {roof['floor_ms']:.3f} ms", flush=True)  # fmt: skip
    return row


def bench_decode(name, B, H, D, use_fla) -> dict:
    from openk3.ops.kda.triton import fused_recurrent_kda_decode

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = chunk_inputs(B, 1, H, D, None, seed=3)
    pool = torch.randn(B, H, D, D, generator=gen, device="cuda") * 0.1
    slots = torch.arange(B, device="cuda", dtype=torch.int32)
    tokens = [x[n] for n in ("q", "k", "v", "g", "beta")]
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND)
    out = torch.empty_like(x["v"])

    def ours():
        fused_recurrent_kda_decode(*tokens, pool, slots, **gate, use_beta_sigmoid_in_kernel=True, out=out)

    row = {
        "shape": name,
        "pass": "decode",
        "roofline": decode_roofline(B, H, D),
        "ours": time_us_per_call(ours),
    }
    if use_fla:
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        state = pool.clone()
        pool_fla = pool.clone()

        def fla_public():
            fused_recurrent_kda(*tokens, **gate, initial_state=state, output_final_state=True, **flags)

        def fla_pool():
            fused_recurrent_kda_fwd(*tokens, **gate, initial_state=pool_fla, inplace_final_state=True,
                                    ssm_state_indices=slots, output_final_state=True, **flags)  # fmt: skip

        row["fla_public"] = time_us_per_call(fla_public)
        row["fla_pool"] = time_us_per_call(fla_pool)
        p1, p2 = pool.clone(), pool.clone()
        o1 = fused_recurrent_kda_decode(*tokens, p1, slots, **gate, use_beta_sigmoid_in_kernel=True)
        o2, _ = fused_recurrent_kda_fwd(*tokens, **gate, initial_state=p2, inplace_final_state=True,
                                        ssm_state_indices=slots, output_final_state=True, **flags)  # fmt: skip
        row["ours_vs_fla_o_rel_rmse"] = rel_rmse(o2, o1)
        row["ours_vs_fla_state_rel_rmse"] = rel_rmse(p2, p1)
        row["speedup_eager"] = row["fla_public"]["eager_us"] / row["ours"]["eager_us"]
        if row["fla_public"]["graph_us"] and row["ours"]["graph_us"]:
            row["speedup_graph"] = row["fla_public"]["graph_us"] / row["ours"]["graph_us"]
    print(
        f"{name:<34} ours {row['ours']}  fla {row.get('fla_public')}  fla pool {row.get('fla_pool')}",
        flush=True,
    )
    return row


# -------------------------------------------------------------------------------- per-kernel breakdown


KERNEL_NAMES = (
    "prepare (bwd)",
    "state_fwd (h, E)",
    "state_bwd",
    "state passes (bwd, overlapped)",
    "grad_wy",
    "grad_intra",
    "tile prepare",
    "tile recurrence",
    "tile prepare (for backward)",
    "chunk_from_tiles",
)
"""The keys of :func:`our_launches`, in its order."""


def our_launches(B, T, H, D, launch: LaunchConfig = DEFAULT_GEOMETRY) -> dict:
    """Each launch of our forward and backward as a callable under the geometry ``launch``, its inputs
    prepared once."""
    from openk3.ops.kda.triton.chunk_from_tiles import chunk_from_tiles
    from openk3.ops.kda.triton.chunk_function import backward_state_passes
    from openk3.ops.kda.triton.chunk_grad_intra import chunk_grad_intra
    from openk3.ops.kda.triton.chunk_grad_wy import chunk_grad_wy
    from openk3.ops.kda.triton.chunk_index import fixed_length_index
    from openk3.ops.kda.triton.chunk_prepare import Saved, chunk_prepare
    from openk3.ops.kda.triton.chunk_state import chunk_state_fwd
    from openk3.ops.kda.triton.chunk_state_bwd import chunk_state_bwd
    from openk3.ops.kda.triton.tile_forward import TILE, empty_tile_backward, tile_prepare, tile_recurrence

    x = chunk_inputs(B, T, H, D, None)
    flat = {n: x[n].reshape(B * T, H, -1) if x[n].dim() == 4 else x[n] for n in LEAVES}
    beta = x["beta"].reshape(B * T, H)  # logits, σ in the kernels
    index = fixed_length_index(B, T, x["q"].device)
    opts = dict(scale=D**-0.5, lower_bound=LOWER_BOUND, use_l2norm=True, beta_sigmoid=True)
    args = (flat["q"], flat["k"], flat["v"], flat["g"], beta, x["A_log"], x["dt_bias"])
    do = torch.randn_like(flat["v"])
    tiles = fixed_length_index(B, T, x["q"].device, TILE)
    tile_args = (flat["q"], flat["k"], flat["g"], beta, x["A_log"], x["dt_bias"], tiles)
    tile_pre = tile_prepare(*tile_args, **opts, launch=launch.tile_prepare)
    back = empty_tile_backward(flat["q"], use_l2norm=True)
    tile_pre_bwd = tile_prepare(*tile_args, **opts, for_backward=back, launch=launch.tile_prepare)
    saved = Saved(*chunk_from_tiles(tile_pre_bwd, back, beta, index, tiles, use_l2norm=True, beta_sigmoid=True),
                  back.q_rstd, back.k_rstd)  # fmt: skip
    pre = chunk_prepare(*args, index, saved, **opts, launch=launch.chunk_prepare)
    state = launch.chunk_state
    h, v_new = chunk_state_fwd(pre, None, index, V=D, launch=state)
    dh, dv_new, _ = chunk_state_bwd(pre, do, None, index, launch=state)
    wy = chunk_grad_wy(*args, pre, h, dh, v_new, dv_new, do, index, **opts, launch=launch.chunk_grad_wy)
    intra = (flat["q"], flat["k"], flat["g"], beta, x["A_log"], x["dt_bias"], pre, wy, index)
    launches = {
        "prepare (bwd)": lambda: chunk_prepare(*args, index, saved, **opts, launch=launch.chunk_prepare),
        "state_fwd (h, E)": lambda: chunk_state_fwd(pre, None, index, V=D, launch=state),
        "state_bwd": lambda: chunk_state_bwd(pre, do, None, index, launch=state),
        "state passes (bwd, overlapped)": lambda: backward_state_passes(
            pre, None, do, None, index, None, launch
        ),
        "grad_wy": lambda: chunk_grad_wy(
            *args, pre, h, dh, v_new, dv_new, do, index, **opts, launch=launch.chunk_grad_wy
        ),
        "grad_intra": lambda: chunk_grad_intra(*intra, **opts, launch=launch.chunk_grad_intra),
        "tile prepare": lambda: tile_prepare(*tile_args, **opts, launch=launch.tile_prepare),
        "tile recurrence": lambda: tile_recurrence(
            tile_pre,
            flat["v"],
            None,
            tiles,
            output_final_state=False,
            launch=launch.tile_recurrence,
            state_launch=state,
        ),
        "tile prepare (for backward)": lambda: tile_prepare(
            *tile_args, **opts, for_backward=back, launch=launch.tile_prepare
        ),
        "chunk_from_tiles": lambda: chunk_from_tiles(
            tile_pre_bwd,
            back,
            beta,
            index,
            tiles,
            use_l2norm=True,
            beta_sigmoid=True,
            launch=launch.chunk_from_tiles,
        ),
    }
    assert tuple(launches) == KERNEL_NAMES, "keep KERNEL_NAMES in step with our_launches"
    return launches


def kernel_breakdown(B, T, H, D, iters=5) -> dict:
    """Time each launch of our forward and backward separately (ms)."""
    return {name: time_ms(fn, iters) for name, fn in our_launches(B, T, H, D).items()}


SWEEP = {
    "chunk_prepare": [{}, {"num_warps": 2}, {"key_block": 32}, {"num_warps": 8}],
    "chunk_state": [
        {},
        {"value_block": 32},
        {"few_program_stages": 0},
        {"num_stages": 2, "few_program_stages": 0},
        {"num_stages": 3, "few_program_stages": 0},
        {"few_program_stages": 3},
    ],
    "chunk_grad_wy": [
        {},
        {"num_warps": 8},
        {"key_block": 32},
        {"value_block": 32},
        {"value_block": 32, "num_stages": 1},
        {"key_block": 32, "value_block": 32},
        {"num_warps": 8, "value_block": 32},
    ],
    "chunk_grad_intra": [{}, {"key_block": 16}, {"num_warps": 8}],
    "tile_prepare": [{}, {"num_stages": 2}, {"key_block": 32}, {"num_warps": 2, "key_block": 32}],
    "tile_recurrence": [
        {},
        {"num_stages": 2},
        {"num_stages": 4},
        {"value_block": 64},
        {"value_block": 16},
        {"num_warps": 2},
        {"num_warps": 8},
        {"value_block": 16, "num_warps": 2},
    ],
    "chunk_from_tiles": [
        {},
        {"num_warps": 4, "key_block": 64},
        {"num_warps": 4},
        {"num_warps": 1},
        {"num_warps": 2, "key_block": 64},
    ],
}
"""Launch geometries timed by ``--sweep``/``--tune``, per :class:`~openk3.ops.kda.triton.config.LaunchConfig`
field: each entry replaces those fields of the kernel's default (``{}`` = the default)."""
SWEEP_KERNELS = {
    "chunk_prepare": ["prepare (bwd)"],
    "chunk_state": ["state_fwd (h, E)", "state_bwd", "state passes (bwd, overlapped)"],
    "chunk_grad_wy": ["grad_wy"],
    "chunk_grad_intra": ["grad_intra"],
    "tile_prepare": ["tile prepare", "tile prepare (for backward)"],
    "tile_recurrence": ["tile recurrence"],
    "chunk_from_tiles": ["chunk_from_tiles"],
}


def swept(picks: dict[str, dict], base: LaunchConfig = DEFAULT_GEOMETRY) -> LaunchConfig:
    """``base`` with, for each kernel field named in ``picks``, the given entries replaced (``{"chunk_grad_wy":
    {"key_block": 32}}``). Raises ``ValueError`` for an unknown kernel or entry, or a geometry the config
    refuses (:mod:`~openk3.ops.kda.triton.config`)."""
    changes = {}
    for kernel, entries in picks.items():
        if kernel not in SWEEP_KERNELS:
            raise ValueError(f"no kernel {kernel!r}; choose from {sorted(SWEEP_KERNELS)}")
        try:
            changes[kernel] = dataclasses.replace(getattr(base, kernel), **entries)
        except TypeError as err:
            raise ValueError(f"{kernel}: {err}") from None
    return dataclasses.replace(base, **changes)


def sweep(shapes, modules: list[str] | None = None) -> list[dict]:
    """Time the launches of each kernel (all of ``SWEEP`` or ``modules``) under each of its geometries in
    ``SWEEP``, each passed as a :class:`~openk3.ops.kda.triton.config.LaunchConfig`."""
    unknown = sorted(set(modules or []) - set(SWEEP))
    if unknown:
        raise SystemExit(f"--sweep-modules: unknown {unknown}; choose from {sorted(SWEEP)}")
    rows = []
    for B, T, H, D in shapes:
        for module, configs in SWEEP.items():
            if modules and module not in modules:
                continue
            for config in configs:
                try:
                    launches = our_launches(B, T, H, D, swept({module: config}))
                    result = {k: time_ms(launches[k], 3, warmup=1) for k in SWEEP_KERNELS[module]}
                    del launches
                except Exception as err:  # noqa: BLE001 - a config that fails to compile is reported
                    result = {"error": f"{type(err).__name__}: {err}"[:200]}
                rows.append(
                    {"module": module, "config": config, "shape": f"B{B} T{T} H{H} D{D}", "ms": result}
                )
                print(f"sweep {module} {config} B{B} T{T} H{H}: {result}", flush=True)
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------- report


def fixed_shapes(numbers: str | None) -> list[tuple[int, int, int, int]]:
    """``(B, T, H, D)`` of the fixed-length chunk shapes named by ``--sweep-shapes``/``--breakdown-shapes``
    (a comma list of :data:`CHUNK_SHAPES` numbers; None: shape 1)."""
    return [CHUNK_SHAPES[int(i) - 1][1:5] for i in (numbers or "1").split(",") if i]


def tune(rows: list[dict]) -> dict:
    """Each kernel's fastest swept geometry (``{kernel: entries}``, for :func:`swept`). A configuration's time
    is its kernels' times summed over the swept shapes; one that failed, timed nothing, or lacks a shape the
    module was swept at is out."""
    best = {}
    for module in SWEEP:
        mine = [r for r in rows if r["module"] == module]
        shapes = {r["shape"] for r in mine}
        by_config: dict[str, list[dict]] = {}
        for r in mine:
            by_config.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
        timed = {
            key: sum(sum(r["ms"].values()) for r in runs)
            for key, runs in by_config.items()
            if {r["shape"] for r in runs} == shapes and all(r["ms"] and "error" not in r["ms"] for r in runs)
        }
        if timed:
            best[module] = json.loads(min(timed, key=timed.get))
    print("tuned launch configurations:", best, flush=True)
    return best


def environment(use_fla: bool) -> dict:
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(sys.argv),
    }
    if use_fla:
        import fla

        env["fla"] = getattr(fla, "__version__", "?")
    with contextlib.suppress(Exception):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# KDA kernels: openk3 Triton vs flash-linear-attention 0.6.0",
        "",
        f"Command: `{env['command']}`",
        "",
        f"GPU: {env['gpu']} ({env.get('nvidia_smi', '')}); torch {env['torch']}, triton {env['triton']}, "
        f"CUDA {env['cuda']}, fla {env.get('fla', 'not installed')}; {env['date']}.",
        "",
        "bf16, gate in kernel with lower bound −5 (fla `safe_gate=True`), q/k L2 norm in kernel, β from logits; "
        "CUDA-event medians. Floor = max(fewest bytes / 4.3 TB/s, chunk-form FLOPs / 790 TFLOP/s).",
        "",
        "| shape | pass | fla ms | ours ms | speed-up | floor ms (bound) | ours / floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["chunk"]:
        fla = f"{r['fla_ms']:.3f}" if r["fla_ms"] else "—"
        sp = f"{r['speedup']:.2f}×" if r["speedup"] else "—"
        roof = r["roofline"]
        lines.append(f"| {r['shape']} | {r['pass']} | {fla} | {r['ours_ms']:.3f} | {sp} | "
                     f"{roof['floor_ms']:.3f} ({roof['bound']}) | {r['ours_over_floor']:.1f} |")  # fmt: skip
    if report["decode"]:  # a run of --sections chunk has no decode rows
        lines += [
            "",
            "| decode (1 token) | fla public µs eager / graph | fla in-place pool µs eager / graph | "
            "ours µs eager / graph | speed-up vs fla public eager / graph | floor µs |",
            "|---|---:|---:|---:|---:|---:|",
        ]

    def fmt(t):
        if not t:
            return "—"
        graph = f"{t['graph_us']:.1f}" if t.get("graph_us") else "n/a"
        return f"{t['eager_us']:.1f} / {graph}"

    for r in report["decode"]:
        sp = (
            f"{r['speedup_eager']:.2f}× / {r.get('speedup_graph', float('nan')):.2f}×"
            if "speedup_eager" in r
            else "—"
        )
        lines.append(f"| {r['shape']} | {fmt(r.get('fla_public'))} | {fmt(r.get('fla_pool'))} | {fmt(r['ours'])} | "
                     f"{sp} | {r['roofline']['floor_us']:.1f} |")  # fmt: skip
    for shape, times in report.get("breakdown", {}).items():
        lines += ["", f"Our launches, {shape} (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in times.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda.py needs a CUDA GPU (the chunk kernels are Triton GPU kernels)")
    use_fla = not args.skip_fla
    if args.autotune_cache is not None:
        # before fla's import: its autotuners read the switch when they are built
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
        found, problems = copy_autotune_results(args.autotune_cache, triton_cache_dir())
        print(f"--autotune-cache: {found} autotuning results from {args.autotune_cache}", flush=True)
        for line in problems:
            print(f"--autotune-cache: not restored: {line}", flush=True)
        if args.skip_fla:
            print("--autotune-cache: with --skip-fla nothing is autotuned (our kernels are not)", flush=True)
    if use_fla:
        try:
            import fla.ops.kda  # noqa: F401
        except ImportError as err:
            print(f"fla not importable ({err}); timing ours only", flush=True)
            use_fla = False
    report = {"environment": environment(use_fla), "chunk": [], "decode": []}
    report["environment"]["options"] = dataclasses.asdict(args.options)
    launch = DEFAULT_GEOMETRY

    def save() -> None:  # after every section, so a run cut short keeps what it measured
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "kda_h200.json").write_text(json.dumps(report, indent=1))
            (args.out / "kda_h200.md").write_text(markdown(report))
        if args.autotune_cache is not None:  # after the results: a cache that cannot be written loses nothing
            try:
                _, problems = copy_autotune_results(triton_cache_dir(), args.autotune_cache)
            except OSError as err:
                problems = [f"{args.autotune_cache}: {err.strerror or err}"]
            for line in problems:
                print(f"--autotune-cache: not kept: {line}", flush=True)

    sections = args.sections.split(",")

    def run_sweep() -> None:
        report["sweep"] = sweep(
            fixed_shapes(args.sweep_shapes), [m for m in args.sweep_modules.split(",") if m]
        )

    if args.tune:
        run_sweep()
        report["tuned"] = tune(report["sweep"])
        launch = swept(report["tuned"])
        save()
    if "breakdown" in sections:
        report["breakdown"] = {}
        for B, T, H, D in fixed_shapes(args.breakdown_shapes):
            shape = f"B{B} T{T} H{H} D{D}"
            report["breakdown"][shape] = kernel_breakdown(B, T, H, D)
            print(f"breakdown {shape}", report["breakdown"][shape], flush=True)
        save()
    if "decode" in sections:
        for name, B, H, D in DECODE_SHAPES:
            report["decode"].append(bench_decode(name, B, H, D, use_fla))
        save()
    if "chunk" in sections:
        picked = [int(i) for i in (args.shapes or "").split(",") if i] or range(1, len(CHUNK_SHAPES) + 1)
        for name, B, T, H, D, lens in (CHUNK_SHAPES[i - 1] for i in picked):
            fla_bwd = "fwd+bwd" in args.fla_passes.split(",")
            bench_chunk(
                name,
                B,
                T,
                H,
                D,
                lens,
                args.iters,
                use_fla,
                fla_bwd,
                report["chunk"],
                save,
                args.options,
                launch,
            )
            torch.cuda.empty_cache()
    if "sweep" in sections and not args.tune:
        run_sweep()
        save()
    print(markdown(report))


if __name__ == "__main__":
    main()
