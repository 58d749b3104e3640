"""Host time of a steady decode step: the engine's Python around the device work, per phase.

On a GPU a decode step is one CUDA-graph replay (:mod:`openk3.serve.decode_graph`) plus the host's work
around it: ``schedule`` (which requests run, block tables), ``execute`` (the step's inputs, the launch,
reading the sampled tokens back) and ``update`` (appending tokens, caching full blocks, checkpoints,
outputs). That work is the same on every device, so it is measured here on the CPU with the static step's
device work replaced by a stand-in that writes token 1 for every row (what a replay costs the host is one
launch call): the times are the host's alone, not the model's. ``--real`` runs the model's forward instead
(the eager twin of the graph, on the CPU) for comparison.

``n`` streams of 32-token prompts are prefilled, run ``WARM`` decode steps, then ``--steps`` timed decode
steps; each phase's median over those steps is reported in microseconds, and ``--cprofile K`` lists the
``K`` functions with the most own time over the timed steps.

``--count-ops`` instead runs one real static decode step of one stream (eagerly, on the CPU) and counts the
ATen operators it dispatches that write memory (views left out), listed per innermost module. On a GPU
nearly each is one kernel of the captured graph; two calls are one kernel there and several operators on the
CPU: ``F.rms_norm`` (torch's fused CUDA kernel, its composite ops here) and the KDA state-pool decode (one
Triton kernel, plus the slots' ``arange``). The ``cuda`` column counts each such call as one kernel: an
estimate of the graph's kernels (the H200 profile, ``benchmarks/results/serve_profile_h200.md``, counts them).

    python benchmarks/serve_host.py --streams 1 64 --block-size 512
    python benchmarks/serve_host.py --preset k3-small --dtype bfloat16 --count-ops
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.model import kda
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.serve.decode_graph import StaticDecode

PROMPT = 32
WARM = 5
PHASES = ("schedule", "execute", "update")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per batch size")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--real", action="store_true", help="run the model's forward, not the stand-in")
    p.add_argument("--cprofile", type=int, default=0, help="list this many functions by own time")
    p.add_argument("--count-ops", action="store_true", help="count a real step's operators per module")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's weights")
    args = p.parse_args(argv)
    if args.steps < 1 or args.block_size < 1 or min(args.streams) < 1:
        p.error("--steps, --block-size and every --streams value must be at least 1")
    return args


def stand_in(step: StaticDecode, states) -> None:
    """The device work of a static step, replaced: token 1 for every row."""
    step.next_B.fill_(1)


def timed(fn, into: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return result

    return wrapper


def measure(model, args, n: int) -> dict:
    """Median microseconds per phase (and the whole step) over ``--steps`` steady decode steps of ``n``."""
    cache = CacheConfig(block_size=args.block_size, pool_mib=256)
    sched = SchedulerConfig(
        max_num_batched_tokens=max(512, 2 * n),
        max_num_seqs=max(n, 2),
        long_prefill_token_threshold=256,
        max_model_len=PROMPT + WARM + args.steps + 4,
    )
    engine = LLMEngine(model, EngineConfig(cache, sched, static_decode=True))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=WARM + args.steps + 2)
    for i in range(n):
        engine.add_request(
            Request(f"s{i}", torch.randint(2, vocab, (PROMPT,), generator=gen).tolist(), params)
        )
    for _ in range(WARM):
        engine.step()
    times: dict[str, list[float]] = {k: [] for k in (*PHASES, "step")}
    sched_, runner = engine.scheduler, engine.runner
    with (
        mock.patch.object(sched_, "schedule", timed(sched_.schedule, times["schedule"])),
        mock.patch.object(sched_, "update", timed(sched_.update, times["update"])),
        mock.patch.object(runner, "execute", timed(runner.execute, times["execute"])),
    ):
        profiler = cProfile.Profile() if args.cprofile else None
        for _ in range(args.steps):
            if profiler is not None:
                profiler.enable()
            t0 = time.perf_counter()
            engine.step()
            times["step"].append(time.perf_counter() - t0)
            if profiler is not None:
                profiler.disable()
    result = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        result["cprofile"] = text.getvalue()
    return result


class OpCounter(TorchDispatchMode):
    """Counts dispatched ATen operators that write memory (not views), by the innermost running module;
    ``cuda_by_module`` counts a call wrapped by :meth:`fused` as one kernel instead of its operators."""

    NO_KERNEL = (
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.detach.default,
        torch.ops.aten.promote_types.default,  # a dtype, computed on the host
    )

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = ["(outside modules)"]
        self.by_module: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.cuda_by_module: collections.Counter = collections.Counter()
        self.inside_fused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in self.NO_KERNEL:
            self.by_module[self.stack[-1]] += 1
            self.by_op[str(func.overloadpacket)] += 1
            self.cuda_by_module[self.stack[-1]] += self.inside_fused == 0
        return func(*args, **(kwargs or {}))

    def fused(self, fn):
        """``fn`` counted as one CUDA kernel (its operators still count in ``by_module``)."""

        def call(*args, **kwargs):
            self.cuda_by_module[self.stack[-1]] += 1
            self.inside_fused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_fused -= 1

        return call


def count_ops(model: nn.Module, args) -> OpCounter:
    """The operators of one static decode step of one stream (see the module docstring)."""
    counter = OpCounter()
    cache = CacheConfig(block_size=args.block_size, pool_mib=256)
    engine = LLMEngine(model, EngineConfig(cache, SchedulerConfig(max_model_len=64), static_decode=True))
    engine.add_request(Request("s", list(range(2, 2 + PROMPT)), SamplingParams(max_tokens=4)))
    for _ in range(2):  # the prefill, a decode
        engine.step()
    pre = nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: counter.stack.append(type(m).__name__)
    )
    post = nn.modules.module.register_module_forward_hook(lambda m, a, o: counter.stack.pop() and None)
    real = StaticDecode.forward

    def counted(self, states):
        with counter:
            real(self, states)

    try:
        with (
            mock.patch.object(StaticDecode, "forward", counted),
            mock.patch.object(F, "rms_norm", counter.fused(F.rms_norm)),
            mock.patch.object(kda, "fused_recurrent_kda_pool", counter.fused(kda.fused_recurrent_kda_pool)),
        ):
            engine.step()
    finally:
        pre.remove()
        post.remove()
    return counter


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = openk3.build_model(openk3.get_preset(args.preset), dtype=dtype, seed=0).eval()
    if args.count_ops:
        counter = count_ops(model, args)
        total, cuda = sum(counter.by_op.values()), sum(counter.cuda_by_module.values())
        print(
            f"{total} operators that write memory (about {cuda} CUDA kernels), one decode step of "
            f"{args.preset} ({args.dtype})"
        )
        print("\n| module | operators | cuda |\n|---|---:|---:|")
        for name, n in counter.by_module.most_common():
            print(f"| {name} | {n} | {counter.cuda_by_module[name]} |")
        print("\n| operator | calls |\n|---|---:|")
        for name, n in counter.by_op.most_common(15):
            print(f"| {name} | {n} |")
        return []
    print(f"| streams | {' | '.join(PHASES)} | step (µs, median of {args.steps}) |")
    print("|---:|" + "---:|" * (len(PHASES) + 1))
    rows = []
    with mock.patch.object(StaticDecode, "forward", StaticDecode.forward if args.real else stand_in):
        for n in args.streams:
            r = measure(model, args, n)
            rows.append({"streams": n, **r})
            print(f"| {n} | " + " | ".join(f"{r[k]:.1f}" for k in (*PHASES, "step")) + " |", flush=True)
            if "cprofile" in r:
                print(r["cprofile"], file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
