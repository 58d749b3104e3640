"""Serving engine benchmark: time to first token with and without a prefix-cache hit, decode throughput of
continuous batching against a plain one-request-at-a-time generation loop, each set against the physical limit
of the machine, and (``--peer``) the same work by Hugging Face ``transformers`` ``generate`` on the same-size
``kimi_linear`` (fla kernels when they import) in the same process.

Engine-level (no HTTP): requests go straight into :class:`openk3.serve.LLMEngine`; the model is built from
a preset with random weights (seed 0), so the numbers measure compute, not text. Greedy decoding, no stop
token (every request produces exactly its ``max_tokens``).

* TTFT: a shared prefix of ``--prefix`` random tokens plus a distinct 16-token suffix, ``--new-tokens`` new
  tokens. The miss is the first request with a new prefix; the hit is a second request with another suffix
  (its MLA blocks and the KDA checkpoint at the end of the prefix are reused; only the suffix is prefilled).
  One engine serves every round, so later rounds replay the graphs the first captured.
* Throughput: ``N`` requests of ``--prompt`` tokens each (distinct) and ``--decode-tokens`` new tokens
  (default ``--new-tokens``), all submitted at once; generated tokens / wall time until the last finishes
  (prefills included), and the decode rate alone (tokens after each stream's first / the time from the last
  first token to the end). One engine per ``N`` runs an untimed round first (CUDA-graph capture), then the
  timed rounds. The plain loop runs :func:`openk3.generate.greedy` (the model's own caches) on the same kind
  of request, one after another; its rate does not depend on ``N``.
* Limits (lower bounds of the time, so upper bounds of the rates; ``--bandwidth`` 4.3 TB/s and ``--peak``
  790 TFLOP/s, the H200's, on any device unless given; the report names the limits it used): a decode step reads the weights an active token needs (all but the routed
  experts, plus the experts ``N`` streams touch, ``E·(1 − (1 − k/E)^N)`` per MoE layer under uniform routing),
  reads and writes each stream's KDA states and reads its cached latents, at ``--bandwidth``; a prefill of
  ``T`` tokens does ``2·(active − lm_head)·T`` matmul FLOPs, ``T²·H·(qk + v)`` per MLA layer (causal) and
  ``2·T·H·(3·K·V + 64·(K + V))`` per KDA layer (chunks of 64), at ``--peak``; the hit reads the weights, the
  cached latents and the state (whichever of bytes and FLOPs takes longer).
* Each measurement is the best of ``--repeats`` rounds. A warm-up first runs every code path once (packed
  first chunk, continuing chunks, a prefix hit, batched decode), so kernel compilation stays outside the timed
  rounds.

    python benchmarks/serve.py --threads 1 --out benchmarks/results/serve_cpu.md   # CPU: k3-tiny, 4K prefix
    python benchmarks/serve.py --preset k3-small k3-1b --device cuda --prefix 32768 --new-tokens 64 \
        --decode-tokens 64 --block-size 512 --repeats 2 --peer --out OUT_DIR       # the GPU targets

The engine's sizes default to those of ``openk3 serve`` on the device (on CUDA: 512-token blocks, 16384-token
prefill chunks with a KDA checkpoint every chunk, a step budget of two chunks; on a CPU: 16, 256, 512). Prints a Markdown report. ``--out`` is a ``.md``
file (the report) or a folder, which receives ``serve_<device>.md`` and ``serve_<device>.json`` (device:
``cpu`` or the GPU's short name, e.g. ``h200``). Every argument, ``--out`` included, is checked before a model
is built (a bad one: one line and exit status 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from kda import directory_argument

import openk3
from openk3.accounting import count_parameters
from openk3.checkpoint.out_folder import out_dir_problem
from openk3.generate import greedy
from openk3.presets import PRESETS
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.serve.config import ENGINE_SIZE_NAMES, default_by_device, engine_defaults

SUFFIX = 16
"""Distinct tokens after the shared prefix of each TTFT request."""
WARM_TOKENS = 4
"""New tokens of each warm-up request (fewer when the measured requests have fewer)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
H200_BANDWIDTH = 4.3e12
"""Bytes/s a decode step can reach on an H200, ``--bandwidth``'s default (``docs/references.md``)."""
H200_PEAK = 790e12
"""bf16 matmul FLOP/s measured on an H200, ``--peak``'s default (``docs/references.md``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        nargs="+",
        default=["k3-tiny"],
        choices=sorted(PRESETS),
        help="presets, measured in turn (default k3-tiny)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights; default bfloat16 on CUDA, else float32")
    p.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens for the TTFT test (4096)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of each TTFT request (64)")
    p.add_argument(
        "--decode-tokens", type=int, help="new tokens per stream in the throughput test (--new-tokens)"
    )
    p.add_argument(
        "--prompt", type=int, default=32, help="prompt tokens per stream in the throughput test (32)"
    )
    p.add_argument(
        "--streams",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="concurrent streams, each measured (1 8 64)",
    )
    p.add_argument("--plain-requests", type=int, default=1, help="requests per timed plain-loop run, >= 1")
    p.add_argument("--repeats", type=int, default=2, help="rounds per measurement, the best reported (2)")
    p.add_argument("--block-size", type=int, help=f"default {default_by_device('block_size')}")
    p.add_argument("--max-num-batched-tokens", type=int, help="step budget; default two prefill chunks")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help=f"prefill chunk, >= 1; default {default_by_device('long_prefill_token_threshold')}",
    )
    p.add_argument("--peer", action="store_true", help="also time transformers kimi_linear generate")
    p.add_argument(
        "--bandwidth",
        type=float,
        default=H200_BANDWIDTH,
        help="memory bandwidth of the limit, bytes/s > 0; default an H200's, on any device",
    )
    p.add_argument(
        "--peak",
        type=float,
        default=H200_PEAK,
        help="matmul peak of the limit, FLOP/s > 0; default an H200's, on any device",
    )
    p.add_argument("--pool-mib", type=float, help=f"paged pool size; default {default_by_device('pool_mib')}")
    p.add_argument("--threads", type=int, help="torch CPU threads, >= 1; default torch's")
    p.add_argument(
        "--eager", action="store_true", help="no static decode step / CUDA graphs (the paged path)"
    )
    p.add_argument(
        "--out",
        type=directory_argument,
        help="a .md file for the report, or a folder for .md and .json (default: the report to stdout only)",
    )
    args = p.parse_args(argv)
    if args.decode_tokens is None:
        args.decode_tokens = args.new_tokens
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if min(args.streams) < 1:
        p.error("every --streams value must be at least 1")
    fill_engine_sizes(args, max(args.streams))
    counts = ("prefix", "new_tokens", "decode_tokens", "prompt", "repeats", "plain_requests", "block_size")
    check_engine_args(
        p,
        args,
        (
            *counts,
            "long_prefill_token_threshold",
            "max_num_batched_tokens",
        ),  # the budget's default follows the chunk
        {"pool_mib": "MiB", "bandwidth": "bytes/s", "peak": "FLOP/s"},
    )
    for preset in args.preset:
        ttft = {"--prefix": args.prefix, "--new-tokens": args.new_tokens}
        check_positions(p, preset, ttft, ttft_model_len(args) - sum(ttft.values()))
        streams = {"--prompt": args.prompt, "--decode-tokens": args.decode_tokens}
        check_positions(p, preset, streams, throughput_model_len(args) - sum(streams.values()))
    if args.out is not None:  # checked now: the report is first written after the first preset's run
        report_file = args.out.suffix == ".md"
        if report_file and args.out.is_dir():
            p.error(f"--out {args.out} is a folder: a --out ending in .md names the report file")
        folder = args.out.parent if report_file else args.out
        if problem := out_dir_problem(folder, f"--out {args.out}: its folder" if report_file else "--out"):
            p.error(problem)
    return args


def check_engine_args(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    counts: tuple[str, ...],
    amounts: dict[str, str] | None = None,
) -> None:
    """Refuse with ``p.error`` (one line, exit status 2), before a model is built: an argument named in
    ``counts`` below 1 (``--long-prefill-token-threshold 0`` included: the engine's ``SchedulerConfig`` refuses
    0, so it is not read as the default), one named in ``amounts`` (argument → unit; default ``--pool-mib``
    in MiB) that is not a finite number > 0, a given ``--threads`` below 1, a ``--device`` other than ``cpu``,
    ``cuda`` or ``cuda:N``, and a CUDA device that torch does not see."""
    for name in counts:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name, unit in (amounts or {"pool_mib": "MiB"}).items():
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be a number of {unit} > 0, got {value:g}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is available (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {args.device}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def check_positions(p: argparse.ArgumentParser, preset: str, lengths: dict[str, int], more: int) -> None:
    """Refuse with ``p.error`` (one line, exit status 2) when ``lengths`` (argument → tokens) plus ``more``
    positions exceed ``preset``'s ``max_position_embeddings``, the longest ``max_model_len`` its engine
    takes; the line gives the largest sum of those arguments that fits."""
    limit = openk3.config.text_config_of(openk3.get_preset(preset)).max_position_embeddings
    if sum(lengths.values()) + more > limit:
        given = ", ".join(f"{flag} {n}" for flag, n in lengths.items())
        names = " + ".join(lengths)
        p.error(
            f"{given}: too long for {preset}, whose max_position_embeddings {limit} must hold "
            f"{names} + {more}: give {names} at most {limit - more}"
        )


def ttft_model_len(args: argparse.Namespace) -> int:
    """``max_model_len`` of the TTFT engine: the prefix, the suffix, the new tokens and one more."""
    return args.prefix + SUFFIX + args.new_tokens + 1


def throughput_model_len(args: argparse.Namespace) -> int:
    """``max_model_len`` of a throughput engine: a prompt, its new tokens and one more."""
    return args.prompt + args.decode_tokens + 1


def fill_engine_sizes(args: argparse.Namespace, max_num_seqs: int) -> None:
    """Set the engine sizes not given (``None``: ``block_size``, ``pool_mib``, ``long_prefill_token_threshold``,
    ``max_num_batched_tokens``) and ``checkpoint_interval`` to ``--device``'s defaults, those of
    ``openk3 serve`` (:func:`openk3.serve.config.engine_defaults`); a given value (a bad one too, refused
    later by :func:`check_engine_args`) is kept."""
    given = {n: getattr(args, n, None) for n in ENGINE_SIZE_NAMES}  # no --checkpoint-interval here
    sizes = engine_defaults(args.device, given, max_num_seqs)
    for name, value in sizes.items():
        setattr(args, name, value)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def environment(args: argparse.Namespace) -> dict:
    """Versions and the machine: GPU name, torch, triton, CUDA, Python, CPU load."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        env["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            env["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["nvidia_smi"] = None
    return env


def device_tag(env: dict) -> str:
    """``cpu``, or the GPU's short name (``NVIDIA H200`` → ``h200``)."""
    if "gpu" not in env:
        return "cpu"
    words = re.findall(r"[A-Za-z0-9]+", env["gpu"])
    named = [w for w in words if any(c.isdigit() for c in w)]
    return (named[0] if named else words[-1]).lower()


def make_engine(model, args, max_model_len: int, num_seqs: int) -> LLMEngine:
    cache = CacheConfig(
        block_size=args.block_size, pool_mib=args.pool_mib, checkpoint_interval=args.checkpoint_interval
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs + args.block_size),
        max_num_seqs=max(num_seqs, 1),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=max_model_len,
        max_waiting=max(num_seqs, 1),
    )
    return LLMEngine(model, EngineConfig(cache, sched, static_decode=False if args.eager else None))


def time_to_first_token(engine: LLMEngine, request: Request, device: str) -> tuple[float, float]:
    """(TTFT, total time) of one request run alone in ``engine``, seconds."""
    t0 = time.perf_counter()
    engine.add_request(request)
    ttft = None
    while engine.has_unfinished_requests():
        engine.step()
        if ttft is None and request.output_token_ids:
            sync(device)
            ttft = time.perf_counter() - t0
    sync(device)
    return ttft, time.perf_counter() - t0


def warm_up(model, args, tokens) -> None:
    """Run each code path once at small sizes: a prefix miss (packed first chunk, continuing chunks) and
    hit, a batch of streams (chunks of equal length, batched decode), and the plain loop. No request is longer
    than a measured one of its kind (``ttft_model_len``, ``throughput_model_len``)."""
    prefix = tokens(min(args.prefix, 2 * args.block_size + args.long_prefill_token_threshold))
    new = min(WARM_TOKENS, args.new_tokens)
    engine = make_engine(model, args, len(prefix) + SUFFIX + new + 1, 4)
    for name in ("miss", "hit"):
        engine.generate([Request(f"w-{name}", prefix + tokens(SUFFIX), SamplingParams(max_tokens=new))])
    new = min(WARM_TOKENS, args.decode_tokens)
    streams = [Request(f"w{i}", tokens(args.prompt), SamplingParams(max_tokens=new)) for i in range(4)]
    make_engine(model, args, args.prompt + new + 1, 4).generate(streams)
    greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), new)
    sync(args.device)


def measure_ttft(model, args, tokens) -> dict:
    """Best (by TTFT) miss and hit over ``--repeats`` rounds on one engine, a new prefix each round (so the
    miss stays a miss, and later rounds replay the CUDA graphs the first captured)."""
    params = SamplingParams(max_tokens=args.new_tokens)
    best: dict[str, dict] = {}
    engine = make_engine(model, args, ttft_model_len(args), 1)
    for round_ in range(args.repeats):
        prefix = tokens(args.prefix)
        for name in ("miss", "hit"):
            req = Request(f"{name}{round_}", prefix + tokens(SUFFIX), params)
            ttft, total = time_to_first_token(engine, req, args.device)
            if name not in best or ttft < best[name]["ttft_s"]:
                best[name] = {"cached_tokens": req.num_cached_tokens, "ttft_s": ttft, "total_s": total}
    del engine
    return best


def measure_throughput(model, args, tokens, n: int) -> dict:
    """Engine with ``n`` streams (one engine: an untimed round, then ``--repeats`` timed) and the plain loop,
    alternating; best rate of each, tokens/s."""
    params = SamplingParams(max_tokens=args.decode_tokens)
    engine = make_engine(model, args, throughput_model_len(args), n)
    engine.generate([Request(f"w{i}", tokens(args.prompt), params) for i in range(n)])  # capture, compile
    rate, decode, plain = 0.0, 0.0, 0.0
    for round_ in range(args.repeats):
        reqs = [Request(f"s{round_}-{i}", tokens(args.prompt), params) for i in range(n)]
        sync(args.device)
        t0 = time.perf_counter()
        engine.generate(reqs)
        sync(args.device)
        t1, end = time.perf_counter(), time.monotonic()
        rate = max(rate, n * args.decode_tokens / (t1 - t0))
        last_first = max(r.first_token_time for r in reqs)
        if args.decode_tokens > 1 and end > last_first:
            decode = max(decode, n * (args.decode_tokens - 1) / (end - last_first))
        t0 = time.perf_counter()
        for _ in range(args.plain_requests):
            greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), args.decode_tokens)
        sync(args.device)
        plain = max(plain, args.plain_requests * args.decode_tokens / (time.perf_counter() - t0))
    del engine
    return {
        "streams": n,
        "engine_tok_s": rate,
        "decode_tok_s": decode,
        "plain_tok_s": plain,
        "speedup": rate / plain,
    }


def limits(text, args) -> dict:
    """The physical limits of the module docstring for preset config ``text``: decode tokens/s per stream
    count, prefill and hit seconds."""
    counts = count_parameters(text)
    la = text.linear_attn_config
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    L_kda, L_mla = text.layer_types.count("kda"), text.layer_types.count("mla")
    E, k = text.num_experts, text.num_experts_per_token
    moe_layers = counts["routed_experts"] // (E * counts["routed_expert"])
    item = DTYPES[args.dtype].itemsize
    store = torch.promote_types(DTYPES[args.dtype], torch.float32).itemsize  # the pool's dtype
    latent = text.kv_lora_rank + text.qk_rope_head_dim
    state_bytes = L_kda * (H * K * K + 3 * H * K * (W - 1)) * store
    not_routed = counts["active"] - moe_layers * k * counts["routed_expert"]

    def weight_bytes(n: int) -> float:
        touched = E * (1 - (1 - k / E) ** n)
        return (not_routed + moe_layers * touched * counts["routed_expert"]) * item

    context = args.prompt + args.decode_tokens / 2
    decode = {
        n: n * args.bandwidth / (weight_bytes(n) + n * (2 * state_bytes + L_mla * context * latent * store))
        for n in args.streams
    }
    T = args.prefix + SUFFIX
    qk, v = text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim
    flops = (
        2 * (counts["active"] - counts["lm_head"]) * T
        + 2 * counts["lm_head"]
        + L_mla * T * T * text.num_attention_heads * (qk + v)
        + L_kda * T * 2 * H * (3 * K * K + 64 * 2 * K)
    )
    hit_bytes = weight_bytes(SUFFIX) + state_bytes + L_mla * T * latent * store
    hit_flops = 2 * counts["active"] * SUFFIX + L_mla * 2 * SUFFIX * T * text.num_attention_heads * (qk + v)
    return {
        "decode_tok_s": decode,
        "prefill_s": flops / args.peak,
        "prefill_flops": flops,
        "hit_s": max(hit_bytes / args.bandwidth, hit_flops / args.peak),
        "weight_bytes_1": weight_bytes(1),
        "state_bytes": state_bytes,
    }


def measure_peer(text, args, tokens) -> dict:
    """transformers ``kimi_linear`` of ``text``'s shape, ``generate`` greedy: single-stream and batched decode
    rates (tokens after the first / time after the first) and the TTFT of the prefix-sized prompt."""
    import transformers
    from train_throughput import hf_config_like

    out: dict = {"transformers": transformers.__version__}
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "present")
    except ImportError:
        out["fla"] = None
    from transformers import KimiLinearForCausalLM

    hf = KimiLinearForCausalLM(hf_config_like(text)).to(args.device, DTYPES[args.dtype]).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def timed(ids: torch.Tensor, new: int) -> float:
        sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync(args.device)
        return time.perf_counter() - t0

    def batch(n: int, length: int) -> torch.Tensor:
        return torch.tensor([tokens(length) for _ in range(n)], device=args.device)

    timed(batch(1, args.prompt), 4)  # warm-up: kernels, autotuning
    for n in (1, max(args.streams)):
        best = 0.0
        for _ in range(args.repeats):
            ids = batch(n, args.prompt)
            first, whole = timed(ids, 1), timed(ids, args.decode_tokens)
            best = max(best, n * (args.decode_tokens - 1) / max(whole - first, 1e-9))
        out[f"decode_tok_s_{n}"] = best
    out["ttft_s"] = min(timed(batch(1, args.prefix + SUFFIX), 1) for _ in range(args.repeats))
    return out


def percent(x: float) -> str:
    return f"{100 * x:.3g}%"


def preset_markdown(r: dict, a: dict) -> list[str]:
    """The sections of one preset: TTFT, throughput, and the targets table against the limits and the peer."""
    ttft, rows, lim, peer = r["ttft"], r["throughput"], r["limits"], r.get("peer")
    miss, hit = ttft["miss"], ttft["hit"]
    lines = [
        f"## {r['preset']}: time to first token, {a['prefix']}-token shared prefix + {SUFFIX}-token suffix, "
        f"{a['new_tokens']} new tokens (best of {a['repeats']})",
        "",
        "| request | cached tokens | TTFT (s) | whole request (s) |",
        "|---|---:|---:|---:|",
        f"| miss (new prefix) | {miss['cached_tokens']} | {miss['ttft_s']:.3f} | {miss['total_s']:.3f} |",
        f"| hit (same prefix, new suffix) | {hit['cached_tokens']} | {hit['ttft_s']:.3f} "
        f"| {hit['total_s']:.3f} |",
        "",
        f"Hit TTFT = 1/{miss['ttft_s'] / hit['ttft_s']:.1f} of the miss.",
        "",
        f"## {r['preset']}: decode throughput, {a['prompt']}-token prompts, {a['decode_tokens']} new tokens each "
        f"(best of {a['repeats']}, engine and plain loop alternating)",
        "",
        "| concurrent streams | engine (tokens/s) | decode only (tokens/s) | plain loop (tokens/s) | speed-up |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {t['streams']} | {t['engine_tok_s']:.1f} | {t['decode_tok_s']:.1f} | {t['plain_tok_s']:.1f} "
        f"| {t['speedup']:.1f}× |"
        for t in rows
    ]
    by_n = {t["streams"]: t for t in rows}
    big = max(by_n)

    def peer_cell(key: str, fmt: str) -> str:
        return fmt.format(peer[key]) if peer and key in peer else "—"

    lines += [
        "",
        f"## {r['preset']}: against {limits_name(a)}" + (" and transformers `generate`" if peer else ""),
        "",
        "| work | openk3 | limit | share of the limit reached | transformers kimi_linear |",
        "|---|---:|---:|---:|---:|",
    ]
    if 1 in by_n:
        got, best = by_n[1]["decode_tok_s"], lim["decode_tok_s"][1]
        lines.append(
            f"| single-stream decode (tok/s) | {got:,.0f} | {best:,.0f} | {percent(got / best)} "
            f"| {peer_cell('decode_tok_s_1', '{:,.1f}')} |"
        )
    got, best = by_n[big]["decode_tok_s"], lim["decode_tok_s"][big]
    if big > 1:
        lines.append(
            f"| {big}-stream decode, aggregate (tok/s) | {got:,.0f} | {best:,.0f} | {percent(got / best)} "
            f"| {peer_cell(f'decode_tok_s_{big}', '{:,.1f}')} |"
        )
    lines += [
        f"| {a['prefix'] + SUFFIX}-token prefill, TTFT of a miss (s) | {miss['ttft_s']:.3f} | {lim['prefill_s']:.3g} "
        f"| {percent(lim['prefill_s'] / miss['ttft_s'])} | {peer_cell('ttft_s', '{:.3f}')} |",
        f"| prefix-hit TTFT, {a['prefix']} cached + {SUFFIX} new (s) | {hit['ttft_s']:.4f} | {lim['hit_s']:.3g} "
        f"| {percent(lim['hit_s'] / hit['ttft_s'])} | — |",
    ]
    if peer:
        lines += [
            "",
            f"transformers {peer['transformers']}, fla {peer['fla'] or 'not installed'}"
            + (f"; error: {peer['error']}" if "error" in peer else ""),
        ]
    return lines + [""]


def h200_limits(a: dict) -> bool:
    """Whether the run's limits are the H200's (the defaults of ``--bandwidth`` and ``--peak``)."""
    return (a["bandwidth"], a["peak"]) == (H200_BANDWIDTH, H200_PEAK)


def limits_name(a: dict) -> str:
    return "an H200's limits" if h200_limits(a) else "the limits of --bandwidth and --peak"


def limits_source(a: dict, env: dict) -> str:
    """The limits' rates and whose they are; on any machine but an H200, that its ratios compare with one."""
    rates = f"{a['bandwidth'] / 1e12:.3g} TB/s and {a['peak'] / 1e12:.3g} TFLOP/s"
    if not h200_limits(a):
        return f"{rates}, given by --bandwidth and --peak"
    tag = device_tag(env)
    if tag == "h200":
        return f"{rates}, an H200's (the defaults of --bandwidth and --peak)"
    here = "CPU" if tag == "cpu" else "GPU"
    return (
        f"{rates}, an H200's (the defaults of --bandwidth and --peak), not this {here}'s: each share of the limit "
        "compares this run with an H200"
    )


def markdown(report: dict) -> str:
    a, env = report["args"], report["env"]
    machine = (
        f"GPU: {env['gpu']} ({env.get('nvidia_smi') or 'nvidia-smi unavailable'}), CUDA {env['cuda']}; "
        if "gpu" in env
        else f"CPU: {env['cpu']}, {env['threads']} torch threads, load average before the run "
        f"{env['load_average']:.2f}; "
    )
    lines = [
        f"# Serving benchmark ({', '.join(a['preset'])}, {a['device']}, {a['dtype']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{machine}torch {env['torch']}, triton {env['triton'] or 'not installed'}, Python {env['python']}. "
        f"block_size {a['block_size']}, KDA checkpoint every {report['checkpoint_interval']} blocks, "
        f"prefill chunks ≤ {a['long_prefill_token_threshold']} tokens, step budget "
        f"≥ {a['max_num_batched_tokens']} tokens, greedy, random weights (seed 0), "
        f"{'decode in CUDA graphs' if a['device'].startswith('cuda') and not a['eager'] else 'paged eager decode'}. Limits: "
        f"{limits_source(a, env)} (see the script's docstring). "
        f"Wall time of the whole run: {report['wall_s']:.0f} s.",
        "",
    ]
    for r in report["presets"]:
        lines += preset_markdown(r, a)
    return "\n".join(lines)


def preset_tokens(text):
    """Random token ids of a preset's vocabulary, seeded: ``tokens(n)`` is the next ``n`` of them."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, text.vocab_size, (n,), generator=gen).tolist()

    return tokens


def run_preset(name: str, args) -> dict:
    """openk3's numbers and the limits for preset ``name``."""
    torch.manual_seed(0)
    config = openk3.get_preset(name)
    text = openk3.config.text_config_of(config)
    model = openk3.build_model(config, device=args.device, dtype=DTYPES[args.dtype], seed=0).eval()
    tokens = preset_tokens(text)
    t_start = time.perf_counter()
    warm_up(model, args, tokens)
    print(f"{name}: warm-up done after {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    result = {"preset": name, "ttft": measure_ttft(model, args, tokens)}
    print(f"{name}: TTFT {result['ttft']}", file=sys.stderr, flush=True)
    result["throughput"] = []
    for n in args.streams:
        result["throughput"].append(measure_throughput(model, args, tokens, n))
        print(f"{name}: {result['throughput'][-1]}", file=sys.stderr, flush=True)
    result["limits"] = limits(text, args)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def run_peer(name: str, args) -> dict:
    """The transformers peer for preset ``name``; its failure is reported, not raised."""
    text = openk3.config.text_config_of(openk3.get_preset(name))
    try:
        peer = measure_peer(text, args, preset_tokens(text))
    except Exception as e:  # noqa: BLE001 (the run goes on and says why the peer has no numbers)
        peer = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300], "transformers": "?", "fla": None}
    print(f"{name}: peer {peer}", file=sys.stderr, flush=True)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return peer


def write_report(report: dict, args, env: dict, t_start: float) -> str:
    """Render and write the report (called after each part, so a run cut short keeps what it measured)."""
    report["wall_s"] = time.perf_counter() - t_start
    text = markdown(report)
    if args.out is not None:
        if args.out.suffix == ".md":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            name = f"serve_{device_tag(env)}"
            (args.out / f"{name}.md").write_text(text)
            (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment(args)
    report = {
        "command": "python " + " ".join(sys.argv if argv is None else ["benchmarks/serve.py", *argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "checkpoint_interval": args.checkpoint_interval,
        "presets": [],
    }
    for name in args.preset:
        report["presets"].append(run_preset(name, args))
        write_report(report, args, env, t_start)
    if args.peer:  # after openk3's numbers are safe: the peer's first calls may autotune for minutes
        for result in report["presets"]:
            result["peer"] = run_peer(result["preset"], args)
            write_report(report, args, env, t_start)
    print(write_report(report, args, env, t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
