"""Where an eager prefill step's host operators come from: ATen calls of single engine steps, attributed to the
module (or part of the runner) that issued them.

A prefill step on a GPU is host-bound when its fixed cost — Python and ATen dispatch per operator, whatever the
chunk length — exceeds its kernels' time; the count of ATen operators per step is a device-independent proxy
for that cost. This script builds an :class:`~openk3.serve.LLMEngine` (``static_decode=False``) over a
random-weight preset (seed 0), sends one ``--prompt``-token request prefilled in ``--chunk``-token chunks, and
profiles each prefill step (``torch.profiler``, CPU activity) until the first token. The first chunk runs the
model's packed forward (:meth:`~openk3.serve.model_runner.ModelRunner.prefill_packed`), later ones the paged
forward (:class:`~openk3.serve.decode_forward.PagedForward`).

Attribution: forward hooks open a ``record_function`` range around every decoder layer's parts — the sequence
mixer (``kda`` / ``mla``; the KDA layer's chunked op on its own, ``kda op``, whose CPU form is a torch loop
over chunks and whose CUDA form is Triton kernels, so its CPU count is no proxy), the router, the routed
experts, the rest of the MoE block or the dense MLP, the RMSNorms, the AttnRes mixes — and around the runner's
own parts (the scheduler, the cache storage's gathers and writes, embedding, ``lm_head``, sampling). Each ATen
call counts for the innermost range holding it; calls in no range are ``runner (other)``. ``ops`` counts
every ATen call (nested ones too, as ``serve_profile.py`` counts them); ``top`` counts only calls not inside
another ATen call (what Python dispatches); ``ms`` is host time of the top calls (with the profiler's cost).

    PYTHONPATH=src python benchmarks/prefill_ops.py --preset k3-small --prompt 1024 --chunk 512
    PYTHONPATH=src python benchmarks/prefill_ops.py --preset k3-tiny --dtype bfloat16 --json /tmp/ops.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import openk3
from openk3.model import attn_res, modeling
from openk3.presets import PRESETS
from openk3.serve import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    Request,
    SamplingParams,
    SchedulerConfig,
    model_runner,
)

LABEL = "part:"
"""Prefix of the ``record_function`` ranges this script opens."""


def ranged(name: str, fn):
    """``fn`` inside a ``record_function`` range named ``part:<name>``."""

    def wrapped(*args, **kwargs):
        with record_function(LABEL + name):
            return fn(*args, **kwargs)

    return wrapped


def instrument(engine: LLMEngine) -> None:
    """Wrap the parts of ``engine``'s model and runner in ranges (instance attributes and module hooks)."""
    lm = engine.runner.lm
    for layer in lm.model.layers:
        kind = "kda" if layer.is_kda else "mla"
        attn = layer.self_attn
        attn.forward = ranged(f"{kind} layer", attn.forward)
        if layer.is_kda:
            attn.kda_core = ranged("kda op", attn.kda_core)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = ranged("rmsnorm", norm.forward)
        if hasattr(layer, "mlp"):
            layer.mlp.forward = ranged("dense mlp", layer.mlp.forward)
        else:
            moe = layer.block_sparse_moe
            moe.forward = ranged("moe (shared, latent)", moe.forward)
            moe.gate.forward = ranged("router", moe.gate.forward)
            moe.experts.forward = ranged("routed experts", moe.experts.forward)
    lm.model.norm.forward = ranged("rmsnorm", lm.model.norm.forward)
    lm.model.embed_tokens.forward = ranged("embed", lm.model.embed_tokens.forward)
    lm.lm_head.forward = ranged("lm_head", lm.lm_head.forward)
    st = engine.storage
    for name in ("gather_states", "write_states", "gather_latents", "write_latents", "flush_states"):
        setattr(st, name, ranged(f"storage.{name}", getattr(st, name)))
    engine.scheduler.schedule = ranged("scheduler", engine.scheduler.schedule)
    engine.scheduler.update = ranged("scheduler", engine.scheduler.update)


def patch_modules() -> None:
    """Range the AttnRes mixes and the sampling (looked up by name in their modules at each call)."""
    mix = modeling.attn_res_mix
    modeling.attn_res_mix = ranged("attn_res mix", mix)
    two = attn_res.TwoPhaseAttnRes
    modeling.TwoPhaseAttnRes = type(
        "RangedTwoPhase", (two,), {"__call__": ranged("attn_res mix", two.__call__)}
    )
    model_runner.sample_tokens = ranged("sampling", model_runner.sample_tokens)


def ancestor(event, prefix: str):
    """The innermost event enclosing ``event`` whose name starts with ``prefix``, or ``None``."""
    e = event.cpu_parent
    while e is not None and not e.name.startswith(prefix):
        e = e.cpu_parent
    return e


def profile_step(engine: LLMEngine) -> dict:
    """Profile one ``engine.step()``: per part ``[ops, top, ms]``, totals, and the step's wall time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
    parts: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    ops_by_name: dict[str, int] = defaultdict(int)
    by_part: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        part = ancestor(e, LABEL)
        label = "runner (other)" if part is None else part.name[len(LABEL) :]
        row = parts[label]
        row[0] += 1
        if ancestor(e, "aten::") is None:
            by_part[label][e.name] += 1
            row[1] += 1
            row[2] += e.cpu_time_total / 1e3
            ops_by_name[e.name] += 1
    return {
        "parts": dict(parts),
        "ops": sum(r[0] for r in parts.values()),
        "top": sum(r[1] for r in parts.values()),
        "wall_ms": wall * 1e3,
        "top_ops_by_name": dict(sorted(ops_by_name.items(), key=lambda kv: -kv[1])[:25]),
        "top_by_part": {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in by_part.items()},
    }


def make_engine(model, args) -> LLMEngine:
    cache = CacheConfig(block_size=args.block_size, pool_mib=args.pool_mib)
    sched = SchedulerConfig(
        max_num_batched_tokens=args.chunk + 1,
        max_num_seqs=2,
        long_prefill_token_threshold=args.chunk,
        max_model_len=args.prompt + 2,
        max_waiting=2,
    )
    return LLMEngine(model, EngineConfig(cache, sched, static_decode=False))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-small", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--pool-mib", type=float, default=256.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = openk3.get_preset(args.preset)
    model = openk3.build_model(config, dtype=getattr(torch, args.dtype), seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = openk3.config.text_config_of(config).vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
    patch_modules()
    # warm-up: the same request once unprofiled (first-call costs)
    make_engine(model, args).generate([Request("warm", prompt, SamplingParams(max_tokens=1))])
    engine = make_engine(model, args)
    instrument(engine)
    layers = engine.runner.lm.config.layer_types
    request = Request("r", prompt, SamplingParams(max_tokens=1))
    engine.add_request(request)
    steps = []
    while not request.output_token_ids:
        steps.append(profile_step(engine))
    report = {"preset": args.preset, "dtype": args.dtype, "prompt": args.prompt, "chunk": args.chunk,
              "layers": {k: layers.count(k) for k in ("kda", "mla")}, "steps": steps}  # fmt: skip
    names = sorted({n for s in steps for n in s["parts"]}, key=lambda n: -steps[0]["parts"].get(n, [0])[0])
    print(f"{args.preset} {args.dtype}: {args.prompt}-token prompt in {args.chunk}-token chunks; "
          f"{report['layers']}")  # fmt: skip
    head = " | ".join(f"step {i + 1} ops / top / ms" for i in range(len(steps)))
    print(f"| part | {head} |")
    for n in names:
        cells = " | ".join("{} / {} / {:.1f}".format(*s["parts"].get(n, [0, 0, 0.0])) for s in steps)
        print(f"| {n} | {cells} |")
    cells = " | ".join(f"{s['ops']} / {s['top']} / {s['wall_ms']:.0f} wall" for s in steps)
    print(f"| total | {cells} |")
    for i, s in enumerate(steps):
        print(f"step {i + 1} top ops by name: {s['top_ops_by_name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
