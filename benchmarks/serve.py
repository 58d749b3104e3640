"""Serving engine benchmark: time to first token with and without a prefix-cache hit, and decode throughput
of continuous batching against a plain one-request-at-a-time generation loop.

Engine-level (no HTTP): requests go straight into :class:`openk3.serve.LLMEngine`; the model is built from
a preset with random weights (seed 0), so the numbers measure compute, not text. Greedy decoding, no stop
token (every request produces exactly its ``max_tokens``).

* TTFT: a shared prefix of ``--prefix`` random tokens plus a distinct 16-token suffix, ``--new-tokens`` new
  tokens. The miss is the first request on an empty cache; the hit is a second request with another suffix
  (its MLA blocks and the KDA checkpoint at the end of the prefix are reused; only the suffix is prefilled).
* Throughput: ``N`` requests of ``--prompt`` tokens each (distinct) and ``--decode-tokens`` new tokens
  (default ``--new-tokens``), all submitted at once; generated tokens / wall time until the last finishes
  (prefills included). The plain loop runs :func:`openk3.generate.greedy` (the model's own caches) on the
  same kind of request, one after another; its rate does not depend on ``N``.
* Each measurement is the best of ``--repeats`` rounds; for each ``N`` the engine and the plain loop
  alternate, so a machine shared with other jobs slows both alike. A warm-up first runs every code path
  once (packed first chunk, continuing chunks, a prefix hit, batched decode), so kernel compilation stays
  outside the timed rounds.

    python benchmarks/serve.py --threads 1 --out benchmarks/results/serve_cpu.md   # CPU: k3-tiny, 4K prefix
    python benchmarks/serve.py --preset k3-small --device cuda --prefix 32768 --new-tokens 512 \\
        --decode-tokens 128 --block-size 512 --repeats 1 --out OUT_DIR               # GPU setting, docs/references.md#project-targets

Prints a Markdown report. ``--out`` is a ``.md`` file (the report) or a folder, which receives
``serve_<device>.md`` and ``serve_<device>.json`` (device: ``cpu`` or the GPU's short name, e.g. ``h200``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import openk3
from openk3.generate import greedy
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

SUFFIX = 16
"""Distinct tokens after the shared prefix of each TTFT request."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights; default bfloat16 on CUDA, else float32")
    p.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens for the TTFT test")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of each TTFT request")
    p.add_argument("--decode-tokens", type=int, help="new tokens per stream in the throughput test")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream in the throughput test")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--plain-requests", type=int, default=1, help="requests per timed plain-loop run")
    p.add_argument("--repeats", type=int, default=2, help="rounds per measurement (the best is reported)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--long-prefill-token-threshold", type=int, default=256)
    p.add_argument("--pool-mib", type=float, help="paged pool size; default 256 on CPU, 8192 on CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, help="a .md file for the report, or a folder for .md and .json")
    args = p.parse_args()
    args.decode_tokens = args.decode_tokens or args.new_tokens
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.pool_mib = args.pool_mib or (8192.0 if cuda else 256.0)
    return args


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
        block_size=args.block_size,
        pool_mib=args.pool_mib,
        checkpoint_interval=max(1, 256 // args.block_size),
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs + args.block_size),
        max_num_seqs=max(num_seqs, 1),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=max_model_len,
        max_waiting=max(num_seqs, 1),
    )
    return LLMEngine(model, EngineConfig(cache, sched))


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
    hit, a batch of streams (chunks of equal length, batched decode), and the plain loop."""
    prefix = tokens(min(args.prefix, 2 * args.block_size + args.long_prefill_token_threshold))
    engine = make_engine(model, args, len(prefix) + SUFFIX + 5, 4)
    for name in ("miss", "hit"):
        engine.generate([Request(f"w-{name}", prefix + tokens(SUFFIX), SamplingParams(max_tokens=4))])
    streams = [Request(f"w{i}", tokens(args.prompt), SamplingParams(max_tokens=4)) for i in range(4)]
    make_engine(model, args, args.prompt + 5, 4).generate(streams)
    greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), 4)
    sync(args.device)


def measure_ttft(model, args, tokens) -> dict:
    """Best (by TTFT) miss and hit over ``--repeats`` rounds, a new prefix each round."""
    params = SamplingParams(max_tokens=args.new_tokens)
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        prefix = tokens(args.prefix)
        engine = make_engine(model, args, args.prefix + SUFFIX + args.new_tokens + 1, 1)
        for name in ("miss", "hit"):
            req = Request(name, prefix + tokens(SUFFIX), params)
            ttft, total = time_to_first_token(engine, req, args.device)
            if name not in best or ttft < best[name]["ttft_s"]:
                best[name] = {"cached_tokens": req.num_cached_tokens, "ttft_s": ttft, "total_s": total}
        del engine
    return best


def measure_throughput(model, args, tokens, n: int) -> dict:
    """Engine with ``n`` streams and the plain loop, alternating; best rate of each, tokens/s."""
    params = SamplingParams(max_tokens=args.decode_tokens)
    rate, plain = 0.0, 0.0
    for _ in range(args.repeats):
        engine = make_engine(model, args, args.prompt + args.decode_tokens + 1, n)
        reqs = [Request(f"s{i}", tokens(args.prompt), params) for i in range(n)]
        sync(args.device)
        t0 = time.perf_counter()
        engine.generate(reqs)
        sync(args.device)
        rate = max(rate, n * args.decode_tokens / (time.perf_counter() - t0))
        del engine
        t0 = time.perf_counter()
        for _ in range(args.plain_requests):
            greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), args.decode_tokens)
        sync(args.device)
        plain = max(plain, args.plain_requests * args.decode_tokens / (time.perf_counter() - t0))
    return {"streams": n, "engine_tok_s": rate, "plain_tok_s": plain, "speedup": rate / plain}


def markdown(report: dict) -> str:
    a, env = report["args"], report["env"]
    machine = (
        f"GPU: {env['gpu']} ({env.get('nvidia_smi') or 'nvidia-smi unavailable'}), CUDA {env['cuda']}; "
        if "gpu" in env
        else f"CPU: {env['cpu']}, {env['threads']} torch threads, load average before the run "
        f"{env['load_average']:.2f}; "
    )
    ttft, rows = report["ttft"], report["throughput"]
    miss, hit = ttft["miss"], ttft["hit"]
    lines = [
        f"# Serving benchmark ({a['preset']}, {a['device']}, {a['dtype']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{machine}torch {env['torch']}, triton {env['triton'] or 'not installed'}, Python {env['python']}. "
        f"block_size {a['block_size']}, KDA checkpoint every {max(1, 256 // a['block_size'])} blocks, "
        f"prefill chunks ≤ {a['long_prefill_token_threshold']} tokens, step budget "
        f"≥ {a['max_num_batched_tokens']} tokens, greedy, random weights (seed 0). "
        f"Wall time of the whole run: {report['wall_s']:.0f} s.",
        "",
        f"## Time to first token: {a['prefix']}-token shared prefix + {SUFFIX}-token suffix, "
        f"{a['new_tokens']} new tokens (best of {a['repeats']})",
        "",
        "| request | cached tokens | TTFT (s) | whole request (s) |",
        "|---|---:|---:|---:|",
        f"| miss (empty cache) | {miss['cached_tokens']} | {miss['ttft_s']:.3f} | {miss['total_s']:.3f} |",
        f"| hit (same prefix, new suffix) | {hit['cached_tokens']} | {hit['ttft_s']:.3f} "
        f"| {hit['total_s']:.3f} |",
        "",
        f"Hit TTFT = 1/{miss['ttft_s'] / hit['ttft_s']:.1f} of the miss.",
        "",
        f"## Decode throughput: {a['prompt']}-token prompts, {a['decode_tokens']} new tokens each "
        f"(best of {a['repeats']}, engine and plain loop alternating)",
        "",
        "| concurrent streams | engine (tokens/s) | plain loop (tokens/s) | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['streams']} | {r['engine_tok_s']:.1f} | {r['plain_tok_s']:.1f} | {r['speedup']:.1f}× |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(args)
    torch.manual_seed(0)
    config = openk3.get_preset(args.preset)
    model = openk3.build_model(config, device=args.device, dtype=DTYPES[args.dtype], seed=0).eval()
    vocab = openk3.config.text_config_of(config).vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    warm_up(model, args, tokens)
    print(f"warm-up done after {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    ttft = measure_ttft(model, args, tokens)
    print(f"TTFT {ttft} after {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for n in args.streams:
        rows.append(measure_throughput(model, args, tokens, n))
        print(f"{rows[-1]} after {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    report = {
        "command": "python " + " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "ttft": ttft,
        "hit_ttft_fraction_of_miss": ttft["hit"]["ttft_s"] / ttft["miss"]["ttft_s"],
        "throughput": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    text = markdown(report)
    print(text)
    if args.out is not None:
        if args.out.suffix == ".md":
            args.out.write_text(text)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            name = f"serve_{device_tag(env)}"
            (args.out / f"{name}.md").write_text(text)
            (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
