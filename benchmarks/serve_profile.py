"""Where a serving step spends its time: a ``torch.profiler`` profile of single engine steps, prefill and
decode, with per-step host time, device kernel time, kernel launches, host syncs and device→host copies.

Engine-level, random weights (seed 0), greedy. Each profiled step is one ``LLMEngine.step()`` (schedule →
execute → update) between two device synchronisations:

* **prefill**: one request of ``--prefill`` tokens (``--max-num-batched-tokens`` and
  ``--long-prefill-token-threshold`` set the chunk sizes); every step until its first token is profiled.
* **decode**: for each ``--streams`` ``n``, ``n`` requests of 32-token prompts are prefilled and run a few
  decode steps unprofiled, then ``--steps`` decode steps (``n`` tokens each) are profiled.

Per step, counting only what happens inside ``engine.step()`` (a ``record_function`` range; the harness's own
synchronisation after it and the profiler's are left out): ``step_ms`` (wall time of the step's call),
``wait_ms`` (time blocked in the step's ``syncs``, below), ``host_ms`` (``step_ms − wait_ms``: the host's own
work, inflated by the profiler's per-op cost), ``kernel_ms`` (sum of the device kernels' durations; 0 on a
CPU), ``kernels`` (device kernels run, those inside a CUDA graph included), ``launches`` (kernel launches and
CUDA-graph launches issued by the host), ``syncs`` (host waits on the device: ``cuda*Synchronize``, a blocking
``cudaMemcpy`` and ``aten::_local_scalar_dense``, i.e. ``.item()``/``.tolist()`` of a device tensor; not
counted on a CPU, where the latter only reads memory — CPU ``grouped_mm`` calls it per expert), ``d2h_copies``
(``Memcpy DtoH`` on the device), ``ops`` (``aten::`` calls). The report gives the median step of each setting,
the median wall time of ``--steps`` further decode steps run without the profiler (``unprofiled_ms``: what a
step costs), the decode step's kernels by family (:data:`KERNEL_FAMILIES`: GEMMs, Inductor's Triton kernels,
sort/top-k, ...; on a GPU), and the operators with the most self time over all profiled decode steps.

    python benchmarks/serve_profile.py --preset k3-small --device cuda --prefill 32768 --streams 1 64 \\
        --out OUT_DIR        # GPU: 16384-token chunks (a first chunk, then one continuing a cached prefix)
    python benchmarks/serve_profile.py --prefill 512 --streams 1 8 --out /tmp/p   # CPU, k3-tiny

``--out`` is a folder; it receives ``serve_profile_<device>.md`` and ``.json``. Every argument, ``--out``
included, is checked before a model is built (a bad one: one line and exit status 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from kda import directory_argument
from serve import (
    DTYPES,
    check_engine_args,
    check_positions,
    device_tag,
    environment,
    fill_engine_sizes,
    sync,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import openk3
from openk3.checkpoint.out_folder import out_dir_problem
from openk3.presets import PRESETS
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.serve.config import default_by_device
from openk3.train.step_profile import annotation_names, is_device_annotation

PROMPT = 32
"""Prompt tokens of each decode stream."""
WARM_DECODE_STEPS = 3
"""Decode steps run unprofiled before the profiled ones (first-call costs: Triton compilation, caching)."""
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)
SYNC_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
)
STEP = "openk3.engine_step"
"""The ``record_function`` range around the profiled ``engine.step()``."""
KERNEL_FAMILIES = (
    ("grouped-GEMM set-up", ("prepare_grouped_gemm",)),
    ("GEMM / GEMV", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas")),
    ("sort / top-k", ("sort", "topk", "TopK")),
    ("KDA op", ("kda", "recurrence")),
    ("attention", ("fmha", "attention", "flash")),
    ("Inductor (Triton)", ("triton_",)),
    ("copy / fill", ("copy", "Memcpy", "Memset", "fill")),
    ("ATen elementwise / reduce", ("elementwise", "reduce_kernel", "CatArray", "gather", "index", "norm")),
)
"""Kernel families of the decode breakdown: the first family one of whose substrings (case-insensitive) a
kernel's name holds; ``other (ATen)`` for the rest."""


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in KERNEL_FAMILIES if any(k.lower() in low for k in keys)), "other (ATen)")


def prefill_model_len(args: argparse.Namespace) -> int:
    """``max_model_len`` of the prefill profile's engine: the ``--prefill`` prompt and its one token."""
    return args.prefill + 2


def decode_model_len(args: argparse.Namespace) -> int:
    """``max_model_len`` of a decode profile's engine: a prompt and every warm-up, profiled and timed step."""
    return PROMPT + WARM_DECODE_STEPS + 2 * args.steps + 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv`` (default ``sys.argv[1:]``); a bad argument exits with argparse's status 2 and
    one line, before a model is built."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny", choices=sorted(PRESETS))
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights; default bfloat16 on CUDA, else float32")
    p.add_argument(
        "--prefill",
        type=int,
        default=512,
        help="prompt tokens of the prefill profile (512; at most max_position_embeddings - 2)",
    )
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="decode batch sizes (1 8)")
    p.add_argument("--steps", type=int, default=5, help="profiled decode steps per batch size (5)")
    p.add_argument("--block-size", type=int, help=f"default {default_by_device('block_size')}")
    p.add_argument("--max-num-batched-tokens", type=int, help="step budget; default two prefill chunks")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help="prompt tokens per prefill chunk, >= 1 (0 is refused, as by the engine's SchedulerConfig); "
        f"default {default_by_device('long_prefill_token_threshold')}",
    )
    p.add_argument("--pool-mib", type=float, help=f"paged pool size; default {default_by_device('pool_mib')}")
    p.add_argument("--top", type=int, default=15, help="operators listed in the report (15)")
    p.add_argument("--threads", type=int, help="torch CPU threads, >= 1; default torch's")
    p.add_argument(
        "--eager", action="store_true", help="no static decode step / CUDA graphs (the paged path)"
    )
    p.add_argument(
        "--out",
        type=directory_argument,
        help="a folder for serve_profile_<device>.md and .json (default: the report to stdout only)",
    )
    args = p.parse_args(argv)
    if min(args.streams) < 1:
        p.error("every --streams value must be at least 1")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    fill_engine_sizes(args, max(args.streams))  # only those not given: a given 0 is checked, not replaced
    counts = ("prefill", "steps", "top", "block_size", "long_prefill_token_threshold")
    check_engine_args(p, args, (*counts, "max_num_batched_tokens"))  # the budget's default follows the chunk
    check_positions(p, args.preset, {"--prefill": args.prefill}, prefill_model_len(args) - args.prefill)
    limit = openk3.config.text_config_of(openk3.get_preset(args.preset)).max_position_embeddings
    if decode_model_len(args) > limit:
        p.error(f"--steps {args.steps}: the decode streams would outgrow {args.preset}'s {limit} positions")
    if args.out is not None and (problem := out_dir_problem(args.out)):
        p.error(problem)
    return args


def make_engine(model, args, max_model_len: int, num_seqs: int) -> LLMEngine:
    cache = CacheConfig(
        block_size=args.block_size, pool_mib=args.pool_mib, checkpoint_interval=args.checkpoint_interval
    )
    # the budget must exceed max_num_seqs: a full decode batch leaves room for a prefill
    sched = SchedulerConfig(
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs + 1),
        max_num_seqs=num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=max_model_len,
        max_waiting=num_seqs,
    )
    return LLMEngine(model, EngineConfig(cache, sched, static_decode=False if args.eager else None))


def step_summary(prof, tokens: int, cuda: bool) -> dict:
    """The numbers of one profiled step (see the module docstring); ``syncs`` is None on a CPU."""
    events = list(prof.events())
    step = next(e for e in events if e.name == STEP and e.device_type == DeviceType.CPU)
    lo, hi = step.time_range.start, step.time_range.end
    kernel_us, kernels, launches, d2h, ops, waits = 0.0, 0, 0, 0, 0, []
    families: dict[str, list[float]] = {}  # family -> [kernels, µs]
    # the device-side mirrors of host ranges are not kernels: counted, they would count their kernels twice
    mirrored = annotation_names(events)
    for e in events:
        if e.device_type == DeviceType.CUDA and is_device_annotation(e, mirrored):
            continue
        if e.device_type == DeviceType.CUDA:
            kernel_us += e.time_range.elapsed_us()
            fam = families.setdefault(kernel_family(e.name), [0, 0.0])
            fam[0] += 1
            fam[1] += e.time_range.elapsed_us()
            d2h += "Memcpy DtoH" in e.name
            kernels += not e.name.startswith(("Memcpy", "Memset"))
        elif lo <= e.time_range.start and e.time_range.end <= hi:
            launches += e.name in LAUNCH_CALLS
            ops += e.name.startswith("aten::")
            if e.name in SYNC_CALLS:
                waits.append(e.time_range)
    outer = []  # an .item()'s _local_scalar_dense holds its cudaStreamSynchronize: one wait, timed once
    for r in sorted(waits, key=lambda r: (r.start, -r.end)):
        if not outer or r.start >= outer[-1].end:
            outer.append(r)
    step_us = step.time_range.elapsed_us()
    wait_us = sum(r.elapsed_us() for r in outer) if cuda else 0.0
    syncs = len(outer)
    return {
        "tokens": tokens,
        "step_ms": step_us / 1e3,
        "wait_ms": wait_us / 1e3,
        "host_ms": (step_us - wait_us) / 1e3,
        "kernel_ms": kernel_us / 1e3,
        "kernels": kernels,
        "launches": launches,
        "syncs": syncs if cuda else None,
        "d2h_copies": d2h,
        "ops": ops,
        "families": families,
    }


def kernel_sequence(prof) -> list[tuple[str, float, float]]:
    """The device kernels (and copies) of one profiled step in launch order, as ``(name, start µs from the
    first, duration µs)``: where the graph's kernels sit and the gaps between them (device idle time)."""
    events = list(prof.events())
    mirrored = annotation_names(events)
    kernels = sorted(
        (e for e in events if e.device_type == DeviceType.CUDA and not is_device_annotation(e, mirrored)),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return []
    t0 = kernels[0].time_range.start
    return [(e.name, e.time_range.start - t0, e.time_range.elapsed_us()) for e in kernels]


def profiled_step(engine: LLMEngine, device: str, activities, keep: list) -> dict:
    """One ``engine.step()`` under the profiler, between device synchronisations."""
    scheduled_tokens = sum(len(r.all_token_ids) - r.num_computed_tokens for r in engine.scheduler.running)
    sync(device)
    with profile(activities=activities) as prof:
        with record_function(STEP):
            engine.step()
        sync(device)
    keep.append(prof)
    return step_summary(prof, scheduled_tokens, device.startswith("cuda"))


def profile_prefill(model, args, tokens, activities, keep: list) -> list[dict]:
    """Every step of one ``--prefill``-token prompt's prefill under the profiler (profiles appended to
    ``keep``)."""
    engine = make_engine(model, args, prefill_model_len(args), 1)
    request = Request("prefill", tokens(args.prefill), SamplingParams(max_tokens=1))
    engine.add_request(request)
    steps: list[dict] = []
    while engine.has_unfinished_requests():
        start = request.num_computed_tokens
        steps.append(profiled_step(engine, args.device, activities, keep))
        steps[-1]["top_ops"] = step_top_ops(keep[-1], args.device.startswith("cuda"))
        steps[-1]["tokens"] = request.num_computed_tokens - start or args.prefill - start
    return steps


def profile_decode(model, args, tokens, n: int, activities, keep: list) -> tuple[list[dict], float]:
    """``--steps`` profiled decode steps of ``n`` streams, then the median wall time in ms of ``--steps`` more
    run without the profiler."""
    engine = make_engine(model, args, decode_model_len(args), n)
    max_tokens = WARM_DECODE_STEPS + 2 * args.steps + 2
    reqs = [Request(f"s{i}", tokens(PROMPT), SamplingParams(max_tokens=max_tokens)) for i in range(n)]
    for r in reqs:
        engine.add_request(r)
    while min(len(r.output_token_ids) for r in reqs) < WARM_DECODE_STEPS:
        engine.step()
    steps = [profiled_step(engine, args.device, activities, keep) for _ in range(args.steps)]
    for s in steps:
        s["tokens"] = n
    walls = []
    for _ in range(args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        walls.append(time.perf_counter() - t0)
    return steps, statistics.median(walls) * 1e3


def step_top_ops(prof, cuda: bool, n: int = 4) -> list[tuple[str, float]]:
    """The ``n`` operators (host-side calls, not kernels) with the most self time of one profiled step, as
    ``(name, ms)``: device time on CUDA, host time on a CPU; what sets one prefill step apart from another."""
    key = "self_device_ms" if cuda else "self_cpu_ms"
    ops = [t for t in top_ops([prof], 10**6, cuda) if t["self_cpu_ms"] > 0]
    return [(t["name"], t[key]) for t in ops[:n]]


def median_step(steps: list[dict]) -> dict:
    """The median of each number over ``steps``; ``families`` taken from the step of median kernel time."""
    numbers = [k for k in steps[0] if k != "families"]
    med = {k: None if steps[0][k] is None else statistics.median(s[k] for s in steps) for k in numbers}
    med["families"] = sorted(steps, key=lambda s: s["kernel_ms"])[len(steps) // 2]["families"]
    return med


def top_ops(profs: list, n: int, cuda: bool) -> list[dict]:
    """Operators with the most self time (device time on CUDA, host time on a CPU) over ``profs``."""
    totals: dict[str, dict] = {}
    for prof in profs:
        for a in prof.key_averages():
            if a.key == STEP:
                continue
            t = totals.setdefault(
                a.key, {"name": a.key, "calls": 0, "self_cpu_ms": 0.0, "self_device_ms": 0.0}
            )
            t["calls"] += a.count
            t["self_cpu_ms"] += a.self_cpu_time_total / 1e3
            t["self_device_ms"] += getattr(a, "self_device_time_total", 0.0) / 1e3
    key = "self_device_ms" if cuda else "self_cpu_ms"
    return sorted(totals.values(), key=lambda t: -t[key])[:n]


def timeline_lines(decode: list[dict]) -> list[str]:
    """One line on the device timeline of each batch size's median step (from ``kernel_sequence``): the span
    from its first kernel's start to its last kernel's end, and how much of it no kernel ran (launch gaps)."""
    parts = []
    for d in decode:
        seq = d.get("kernel_sequence") or []
        if seq:
            span = max(start + dur for _, start, dur in seq)
            busy = sum(dur for _, _, dur in seq)
            parts.append(
                f"{d['streams']} streams: {len(seq)} kernels over {span:.0f} µs, idle {span - busy:.0f} µs"
            )
    if not parts:
        return []
    return [
        "Device timeline of the median profiled step (first kernel to last): " + "; ".join(parts) + ".",
        "",
    ]


def markdown(report: dict) -> str:
    a, env = report["args"], report["env"]
    machine = f"GPU: {env['gpu']}, CUDA {env['cuda']}" if "gpu" in env else f"CPU: {env['cpu']}"
    head = (
        "| step | tokens | step ms | host ms | wait ms | kernel ms | kernels | launches | syncs | D→H copies "
        "| aten ops |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"

    def row(name: str, s: dict) -> str:
        syncs = "—" if s["syncs"] is None else f"{s['syncs']:.0f}"
        return (
            f"| {name} | {s['tokens']:.0f} | {s['step_ms']:.2f} | {s['host_ms']:.2f} | {s['wait_ms']:.2f} "
            f"| {s['kernel_ms']:.2f} | {s['kernels']:.0f} | {s['launches']:.0f} "
            f"| {syncs} | {s['d2h_copies']:.0f} | {s['ops']:.0f} |"
        )

    lines = [
        f"# Serving step profile ({a['preset']}, {a['device']}, {a['dtype']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{machine}; torch {env['torch']}, triton {env['triton'] or 'not installed'}, Python {env['python']}. "
        f"block_size {a['block_size']}, prefill chunks ≤ {a['long_prefill_token_threshold']} tokens, step "
        f"budget {a['max_num_batched_tokens']} tokens. Wall time of the run: {report['wall_s']:.0f} s.",
        "",
        f"## Prefill of {a['prefill']} tokens, every step",
        "",
        head,
        rule,
        *(row(str(i), s) for i, s in enumerate(report["prefill"])),
        "",
        "Operators with the most self time in each prefill step (ms): "
        + "; ".join(
            f"{i}: " + ", ".join(f"`{name[:60]}` {ms:.1f}" for name, ms in s.get("top_ops", []))
            for i, s in enumerate(report["prefill"])
        ),
        "",
        f"## Decode, median of {a['steps']} steps per batch size ({PROMPT}-token prompts)",
        "",
        head.replace("| step |", "| streams |"),
        rule,
        *(row(str(d["streams"]), d["median"]) for d in report["decode"]),
        "",
        "Without the profiler (median wall time of a decode step, its device work included): "
        + ", ".join(f"{d['streams']} streams {d['unprofiled_ms']:.2f} ms" for d in report["decode"])
        + ".",
        "",
        *timeline_lines(report["decode"]),
    ]
    names = sorted({f for d in report["decode"] for f in d["median"]["families"]})
    lines += (
        []
        if not names
        else [
            "",
            "## Decode kernels by family (the profiled step of median kernel time: kernels, kernel µs)",
            "",
            "| family | " + " | ".join(f"{d['streams']} streams" for d in report["decode"]) + " |",
            "|---|" + "---:|" * len(report["decode"]),
            *(
                f"| {f} | "
                + " | ".join(
                    "{:.0f}, {:.0f} µs".format(*d["median"]["families"].get(f, (0, 0.0)))
                    for d in report["decode"]
                )
                + " |"
                for f in names
            ),
        ]
    )
    self_time = "device" if "gpu" in env else "host"
    for d in report["decode"]:  # per step: what one decode step of this batch runs
        lines += [
            "",
            f"## Decode of {d['streams']} streams: operators with the most self {self_time} time, per step",
            "",
            "| operator | calls | self host µs | self device µs |",
            "|---|---:|---:|---:|",
            *(
                f"| `{t['name'][:160]}` | {t['calls'] / a['steps']:g} | {1e3 * t['self_cpu_ms'] / a['steps']:.1f} "
                f"| {1e3 * t['self_device_ms'] / a['steps']:.1f} |"
                for t in d["top_ops"]
            ),
        ]
    lines += [
        "",
        f"## Operators with the most self {self_time} time, the prefill's steps",
        "",
        "| operator | calls | self host ms | self device ms |",
        "|---|---:|---:|---:|",
        *(
            f"| `{t['name'][:160]}` | {t['calls']} | {t['self_cpu_ms']:.2f} | {t['self_device_ms']:.2f} |"
            for t in report["prefill_top_ops"]
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment(args)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    config = openk3.get_preset(args.preset)
    model = openk3.build_model(config, device=args.device, dtype=DTYPES[args.dtype], seed=0).eval()
    vocab = openk3.config.text_config_of(config).vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    profile_prefill(model, args, tokens, activities, [])  # warm-up: compile and cache every prefill shape
    prefill_profs: list = []
    prefill = profile_prefill(model, args, tokens, activities, prefill_profs)
    decode = []
    for n in args.streams:
        profs: list = []
        steps, unprofiled_ms = profile_decode(model, args, tokens, n, activities, profs)
        median_prof = profs[sorted(range(len(steps)), key=lambda i: steps[i]["kernel_ms"])[len(steps) // 2]]
        sequence = kernel_sequence(median_prof)
        decode.append(
            {
                "streams": n,
                "steps": steps,
                "median": median_step(steps),
                "unprofiled_ms": unprofiled_ms,
                "top_ops": top_ops(profs, args.top, cuda),
                "kernel_sequence": sequence,
            }
        )
        print(f"decode {n} streams: {decode[-1]['median']}", file=sys.stderr, flush=True)
    report = {
        "command": "python " + " ".join(sys.argv if argv is None else ["benchmarks/serve_profile.py", *argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "prefill": prefill,
        "decode": decode,
        "prefill_top_ops": top_ops(prefill_profs, args.top, cuda),
        "wall_s": time.perf_counter() - t_start,
    }
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"serve_profile_{device_tag(env)}"
        (args.out / f"{name}.md").write_text(text)
        (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
