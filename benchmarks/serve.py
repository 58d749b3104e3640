"""Serving engine benchmark: time to first token with and without a prefix-cache hit, and decode throughput
of continuous batching against a plain one-request-at-a-time generation loop.

Engine-level (no HTTP): requests go straight into :class:`openk3.serve.LLMEngine`; the model is built from
a preset with random weights (seed 0), so the numbers measure compute, not text. Greedy decoding, no stop
token (every request produces exactly ``--new-tokens``).

* TTFT: a shared prefix of ``--prefix`` random tokens plus a distinct 16-token suffix. The miss is the
  first request on an empty cache; the hit is a second request with another suffix (its MLA blocks and
  the KDA checkpoint at the end of the prefix are reused; only the suffix is prefilled).
* Throughput: ``N`` requests of ``--prompt`` tokens each (distinct), all submitted at once, generated
  tokens / wall time until the last finishes; the plain loop runs :func:`openk3.generate.greedy` on the
  same kind of requests one after another (its rate does not depend on ``N``).
* Each measurement is the best of ``--repeats`` rounds; the engine and the plain loop alternate, so a
  machine shared with other jobs slows both alike.

    python benchmarks/serve.py                                   # CPU setting: k3-tiny, 4K prefix, 64 new
    python benchmarks/serve.py --preset k3-small --device cuda --prefix 32768 --new-tokens 512 \\
        --block-size 512 --streams 1 8 64                        # GPU setting of issue 5

Prints a Markdown report; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

import openk3
from openk3.generate import greedy
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens for the TTFT test")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream in the throughput test")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--plain-requests", type=int, default=1, help="requests per timed plain-loop run")
    p.add_argument("--repeats", type=int, default=2, help="rounds per measurement (the best is reported)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--long-prefill-token-threshold", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="also write the report here")
    return p.parse_args()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(model, args, max_model_len: int, num_seqs: int) -> LLMEngine:
    cache = CacheConfig(
        block_size=args.block_size,
        pool_mib=256 if args.device == "cpu" else 8192,
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


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = openk3.get_preset(args.preset)
    model = openk3.build_model(config, device=args.device, seed=0).eval()
    vocab = openk3.config.text_config_of(config).vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    params = SamplingParams(max_tokens=args.new_tokens)
    lines = [
        f"# Serving benchmark ({args.preset}, {args.device})",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, load average before the run {os.getloadavg()[0]:.2f}; "
        f"block_size {args.block_size}, KDA checkpoint every {max(1, 256 // args.block_size)} blocks, "
        f"prefill chunks ≤ {args.long_prefill_token_threshold} tokens, greedy, random weights (seed 0).",
        "",
    ]

    # warm-up (first-call costs of the kernels): one engine request and a short plain generation
    warm = make_engine(model, args, 600, 2)
    warm.generate(
        [
            Request("w0", tokens(512), SamplingParams(max_tokens=4)),
            Request("w1", tokens(8), SamplingParams(max_tokens=4)),
        ]
    )
    greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), 4)
    del warm

    # ---- TTFT with and without a prefix hit (best of --repeats rounds, a new prefix each round) -------------
    max_len = args.prefix + 16 + args.new_tokens + 1
    best = {}
    for _ in range(args.repeats):
        prefix = tokens(args.prefix)
        engine = make_engine(model, args, max_len, 1)
        for name in ("miss", "hit"):
            req = Request(name, prefix + tokens(16), params)
            ttft, total = time_to_first_token(engine, req, args.device)
            if name not in best or ttft < best[name][1]:
                best[name] = (req.num_cached_tokens, ttft, total)
        del engine
    (c_miss, ttft_miss, total_miss), (c_hit, ttft_hit, total_hit) = best["miss"], best["hit"]
    lines += [
        f"## Time to first token: {args.prefix}-token shared prefix + 16-token suffix, "
        f"{args.new_tokens} new tokens (best of {args.repeats})",
        "",
        "| request | cached tokens | TTFT (s) | whole request (s) |",
        "|---|---:|---:|---:|",
        f"| miss (empty cache) | {c_miss} | {ttft_miss:.3f} | {total_miss:.3f} |",
        f"| hit (same prefix, new suffix) | {c_hit} | {ttft_hit:.3f} | {total_hit:.3f} |",
        "",
        f"Hit TTFT = 1/{ttft_miss / ttft_hit:.1f} of the miss.",
        "",
    ]
    print("\n".join(lines[-8:]), file=sys.stderr, flush=True)

    # ---- decode throughput: engine and plain loop alternate, best of --repeats each ----------------------
    lines += [
        f"## Decode throughput: {args.prompt}-token prompts, {args.new_tokens} new tokens each "
        f"(best of {args.repeats}, engine and plain loop alternating)",
        "",
        "| concurrent streams | engine (tokens/s) | plain loop (tokens/s) | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    for n in args.streams:
        rate, plain = 0.0, 0.0
        for _ in range(args.repeats):
            engine = make_engine(model, args, args.prompt + args.new_tokens + 1, n)
            reqs = [Request(f"s{i}", tokens(args.prompt), params) for i in range(n)]
            t0 = time.perf_counter()
            engine.generate(reqs)
            sync(args.device)
            rate = max(rate, n * args.new_tokens / (time.perf_counter() - t0))
            del engine
            t0 = time.perf_counter()
            for _ in range(args.plain_requests):
                greedy(model, torch.tensor([tokens(args.prompt)], device=args.device), args.new_tokens)
            sync(args.device)
            plain = max(plain, args.plain_requests * args.new_tokens / (time.perf_counter() - t0))
        lines.append(f"| {n} | {rate:.1f} | {plain:.1f} | {rate / plain:.1f}× |")
        print(lines[-1], file=sys.stderr, flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
