"""Fleet benchmark: prefix-cache hit rate and time to first token of a multi-turn agentic workload on three
``openk3 serve`` workers, routed at random, through ``openk3 route`` (cache-aware), and through the router
with a device pool too small for the working set, without and with the host-memory tier.

Workload: ``--sessions`` sessions run at once; each has its own history of ``--history`` random token ids
and, turn after turn, sends its history so far grown by ``--growth`` new ids (a tool result, a user
message), ``--turns`` turns, ``--new-tokens`` generated tokens each (greedy, streamed with usage). Every
condition uses fresh histories (a new seed), so no condition reuses another's cache. Random weights (seed
0): the numbers measure caching and compute, not text.

* hit rate: ``Σ cached_tokens / Σ prompt_tokens`` of the turns after the first (``usage.prompt_tokens_
  details.cached_tokens`` as the workers report it);
* TTFT: from sending the request to the first streamed event, mean over the turns after the first (and
  over the first turns, where every condition misses).

Conditions: ``random`` (the client picks a worker uniformly per request), ``cache-aware`` (the router with
the session id in ``X-Session-ID``), both with a device pool of ``--pool-mib`` per worker, which holds
every session; then the router with ``--small-pool-mib`` per worker, without and with a host tier of
``--host-pool-mib``.

    python benchmarks/fleet.py --out benchmarks/results/fleet_cpu.md      # k3-tiny, CPU, about 5 minutes

Prints a Markdown report; ``--out`` is the ``.md`` file (a ``.json`` with the records lands beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import openk3
from openk3.data import Tokenizer
from openk3.serve.router import RouterConfig, build_router_app
from openk3.serve.router.local_fleet import start_workers
from openk3.serve.server import BackgroundServer

MODEL = "fleet"
TOKENIZER_VOCAB = 384
TOKENIZER_TEXT = [
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n",
    "HAMLET. To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer\n",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny", help="model preset (random weights, seed 0)")
    p.add_argument("--workers", type=int, default=3, help="openk3 serve processes")
    p.add_argument("--sessions", type=int, default=6, help="sessions running at once")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--history", type=int, default=1536, help="tokens of a session's first prompt")
    p.add_argument("--growth", type=int, default=128, help="new tokens per turn")
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=8, help="generated tokens per turn")
    p.add_argument("--block-size", dest="block_size", type=int, default=16, help="worker cache block size")
    p.add_argument("--pool-mib", dest="pool_mib", type=float, default=64.0, help="device pool per worker")
    p.add_argument(
        "--small-pool-mib", dest="small_pool_mib", type=float, default=8.0, help="the too-small device pool"
    )
    p.add_argument("--host-pool-mib", dest="host_pool_mib", type=float, default=64.0, help="host tier")
    p.add_argument("--out", type=Path, help="write the report here (.md, with a .json beside it)")
    return p.parse_args()


def save_checkpoint(folder: Path, preset: str) -> None:
    openk3.save_pretrained(openk3.build_model(openk3.get_preset(preset), seed=0), folder)
    Tokenizer.train(TOKENIZER_TEXT * 30, vocab_size=TOKENIZER_VOCAB).save(folder)


async def one_turn(client: httpx.AsyncClient, url: str, headers: dict, prompt: list[int], n: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - start
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached, "ttft_s": ttft}


async def workload(args, route, seed: int) -> list[dict]:
    """Run every session's turns (sessions concurrently); ``route(session)`` → (base URL, headers)."""
    rng = random.Random(seed)
    total = args.history + args.growth * (args.turns - 1)
    histories = [[rng.randrange(4, TOKENIZER_VOCAB) for _ in range(total)] for _ in range(args.sessions)]
    records: list[dict] = []

    async def session(client, s: int) -> None:
        for t in range(args.turns):
            url, headers = route(s)
            prompt = histories[s][: args.history + args.growth * t]
            out = await one_turn(client, url, headers, prompt, args.new_tokens)
            records.append({"session": s, "turn": t, "worker": url, **out})

    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(session(client, s) for s in range(args.sessions)))
    return records


def summarize(name: str, records: list[dict], wall_s: float) -> dict:
    later = [r for r in records if r["turn"] > 0]
    first = [r for r in records if r["turn"] == 0]
    return {
        "condition": name,
        "hit_rate": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
        "ttft_later_s": sum(r["ttft_s"] for r in later) / len(later),
        "ttft_first_s": sum(r["ttft_s"] for r in first) / len(first),
        "requests": len(records),
        "wall_s": wall_s,
        "records": records,
    }


def run_condition(args, name: str, workers, cache_aware: bool, seed: int) -> dict:
    urls = [w.url for w in workers]
    with contextlib.ExitStack() as stack:
        if cache_aware:
            srv = stack.enter_context(BackgroundServer(build_router_app(RouterConfig(workers=tuple(urls)))))

            def route(s):
                return srv.base_url, {"X-Session-ID": f"session-{seed}-{s}"}
        else:
            rng = random.Random(seed)

            def route(s):
                return rng.choice(urls), {}

        start = time.perf_counter()
        records = asyncio.run(workload(args, route, seed))
        result = summarize(name, records, time.perf_counter() - start)
    print(
        f"{name}: hit rate {result['hit_rate']:.3f}, TTFT {result['ttft_later_s']:.3f} s "
        f"({result['wall_s']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def serve_args(args, pool_mib: float, host_pool_mib: float) -> list[str]:
    max_len = args.history + args.growth * args.turns + args.new_tokens + 64
    return [
        "--model-name", MODEL, "--block-size", str(args.block_size), "--pool-mib", str(pool_mib),
        "--host-pool-mib", str(host_pool_mib), "--max-model-len", str(max_len),
    ]  # fmt: skip


def turn_hit_rates(records: list[dict]) -> list[float]:
    """Cached / prompt tokens of each turn, over the sessions."""
    turns = sorted({r["turn"] for r in records})
    return [
        sum(r["cached_tokens"] for r in records if r["turn"] == t)
        / sum(r["prompt_tokens"] for r in records if r["turn"] == t)
        for t in turns
    ]


def markdown(report: dict) -> str:
    a, env = report["args"], report["env"]
    lines = [
        f"# Fleet benchmark ({a['preset']}, {a['workers']} workers, CPU)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"CPU: {env['cpu']}, one torch thread per worker, load average before the run {env['load_average']:.2f}; "
        f"torch {env['torch']}, Python {env['python']}. {a['sessions']} sessions at once, {a['turns']} turns: "
        f"a {a['history']}-token history growing by {a['growth']} tokens per turn, {a['new_tokens']} new "
        f"tokens per turn (greedy, streamed), block size {a['block_size']}, random weights (seed 0). "
        f"Wall time of the whole run: {report['wall_s']:.0f} s.",
        "",
        "| routing | device pool per worker | host tier | cached prompt tokens after turn 1 | by turn (2, 3, …) | mean TTFT after turn 1 (s) | mean TTFT turn 1 (s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["conditions"]:
        by_turn = ", ".join(f"{100 * h:.0f}%" for h in turn_hit_rates(row["records"])[1:])
        lines.append(
            f"| {row['routing']} | {row['pool_mib']:g} MiB | {row['host_pool_mib']:g} MiB | "
            f"{100 * row['hit_rate']:.1f}% | {by_turn} | {row['ttft_later_s']:.3f} | {row['ttft_first_s']:.3f} |"
        )
    best = a["history"] / (a["history"] + a["growth"])
    lines += [
        "",
        f"A perfect cache keeps every earlier turn's prompt: {100 * best:.1f}% of the second turn's tokens, "
        "more on later turns (cut to whole blocks).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg()[0],
    }
    plans = [  # (routing, pool, host tier, cache-aware)
        ("random", args.pool_mib, 0.0, False),
        ("cache-aware", args.pool_mib, 0.0, True),
        ("cache-aware", args.small_pool_mib, 0.0, True),
        ("cache-aware", args.small_pool_mib, args.host_pool_mib, True),
    ]
    conditions = []
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), args.preset)
        fleets = {}
        for seed, (routing, pool, host, cache_aware) in enumerate(plans):
            key = (pool, host)
            if key not in fleets:
                for w in [w for ws in fleets.values() for w in ws]:
                    w.stop()
                fleets = {key: start_workers(tmp, args.workers, serve_args(args, pool, host))}
            name = f"{routing}, pool {pool:g} MiB, host {host:g} MiB"
            result = run_condition(args, name, fleets[key], cache_aware, seed)
            conditions.append({"routing": routing, "pool_mib": pool, "host_pool_mib": host, **result})
        for w in [w for ws in fleets.values() for w in ws]:
            w.stop()
    report = {
        "command": "python " + " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "conditions": conditions,
        "wall_s": time.perf_counter() - t_start,
    }
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
