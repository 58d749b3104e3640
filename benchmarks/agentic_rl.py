"""Agentic RL in microVM sandboxes on the CPU: SFT a K3-shaped model on tool-use demonstrations of the
``sumfile`` task group, then RL steps where every tool call and every judge runs in a sandbox of a running
``openk3 sandbox serve``.

The demonstrations are two turns: the prompt → the ``python`` call that sums ``numbers.txt`` into
``answer.txt``; and prompt + call + an empty observation → ``done``. SFT trains only the policy's turn (the
observation sits in the prompt part). An untrained model writes no valid call (reward 0); after SFT the policy
calls the tool in the sandbox, and the judge's test in a fork gives reward 1. Reported per RL step: mean reward,
tool calls, mean response length, wall time; and the SFT time and loss. Run::

    openk3 sandbox serve --port 3000 --api-key bench &      # wait for 'ready'
    python benchmarks/agentic_rl.py --sandbox-url http://127.0.0.1:3000 --api-key bench \\
        --md benchmarks/results/agentic_rl.md
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

import openk3
from openk3.rl.agentic import AgenticConfig, AgenticRollout
from openk3.rl.agentic_tasks import SumFile
from openk3.rl.harness import TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, AgentTokenizer
from openk3.rl.rollout import RolloutEngine, RolloutSampling
from openk3.rl.sft import sft
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.rl.tool_sandbox import E2BConnection, E2BSandboxes, SandboxServerError
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

SUM_CODE = "s=sum(map(int,open('numbers.txt')));open('answer.txt','w').write(str(s))"


def demonstrations(rollout: AgenticRollout, tok: AgentTokenizer, n: int, rng: random.Random) -> list:
    call = TOOL_CALL + json.dumps({"name": "python", "arguments": {"code": SUM_CODE}}, separators=(",", ":"))
    call_ids = tok.encode(call + TOOL_CALL_END)
    out = []
    for _ in range(n):
        prompt = rollout.prompt_ids(SumFile.sample(rng))
        out.append((prompt, call_ids))
        out.append(
            (
                prompt + call_ids + tok.encode(TOOL_RESPONSE + TOOL_RESPONSE_END),
                tok.encode("done") + [tok.stop_id],
            )
        )
    return out


def positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sandbox-url", required=True, help="URL of a running `openk3 sandbox serve`")
    ap.add_argument("--api-key", required=True, help="an API key that server accepts")
    ap.add_argument("--depth", type=positive, default=4, help="k3_shaped depth (8 = k3-tiny)")
    ap.add_argument("--sft-steps", type=positive, default=200)
    ap.add_argument("--rl-steps", type=positive, default=3)
    ap.add_argument("--prompts", type=positive, default=2, help="prompts per RL step")
    ap.add_argument("--group", type=positive, default=4, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", type=Path, default=None, help="write the results table here")
    args = ap.parse_args()
    try:  # an unreachable server is an error now, not a table of nan rewards after SFT
        connection = E2BConnection(args.sandbox_url, args.api_key)
        connection.check()
    except (ValueError, SandboxServerError) as e:
        ap.error(str(e))
    torch.set_num_threads(1)
    tok = AgentTokenizer()
    model = openk3.build_model(
        openk3.presets.k3_shaped(args.depth, vocab_size=tok.vocab_size), seed=args.seed
    )
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=800), SchedulerConfig(max_num_batched_tokens=2048)
    )
    stops = frozenset({tok.stop_id, tok.special_id(TOOL_CALL_END)})
    engine = RolloutEngine(
        model, cfg, RolloutSampling(1.0, stops, seed=args.seed), sample_vocab_size=tok.vocab_size
    )
    sandboxes = E2BSandboxes(connection)
    rollout = AgenticRollout(engine, tok, [SumFile()], sandboxes, AgenticConfig(sandbox_workers=2))
    rng = random.Random(args.seed)

    t0 = time.perf_counter()
    losses = sft(model, demonstrations(rollout, tok, 64, rng), steps=args.sft_steps, batch_size=4, lr=3e-3)
    sft_s = time.perf_counter() - t0
    engine.sync_weights(model)
    print(f"sft: {args.sft_steps} steps, {sft_s:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.4f}", flush=True)

    trainer = PolicyTrainer(model, rollout, RLConfig(group_size=args.group, max_tokens=160, lr=3e-4))
    rows = []
    for step in range(args.rl_steps):
        metas = [SumFile.sample(rng) for _ in range(args.prompts)]
        calls_before = rollout.stats["tool_calls"]
        t0 = time.perf_counter()
        stats, trajs = trainer.step([rollout.prompt_ids(m) for m in metas], metas, rollout.outcome)
        row = {"step": step, "reward": stats["reward"], "tool_calls": rollout.stats["tool_calls"] - calls_before,
               "failed": sum(t.finish_reason == "failed" for t in trajs), "length": stats["length"],
               "seconds": time.perf_counter() - t0}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    rollout.release()

    lines = [
        "# Agentic RL in microVM sandboxes (CPU)",
        "",
        f"`python benchmarks/agentic_rl.py --depth {args.depth} --sft-steps {args.sft_steps} --rl-steps "
        f"{args.rl_steps} --prompts {args.prompts} --group {args.group}` against `openk3 sandbox serve` "
        f"({platform.machine()}, torch {torch.__version__}, one thread).",
        "",
        f"SFT: {args.sft_steps} steps, batch 4, {sft_s:.0f} s, loss {losses[0]:.3f} → {losses[-1]:.4f} nats/token.",
        "",
        "| RL step | mean reward | tool calls | failed | mean length | seconds |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['step']} | {r['reward']:.3f} | {r['tool_calls']} | {r['failed']} | {r['length']:.0f} | "
            f"{r['seconds']:.0f} |"
            for r in rows
        ),  # fmt: skip
    ]
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
