"""Speculative decoding benchmark: LK- vs KL-trained drafts of one target, trained for the same steps on the
same batches, side by side: the acceptance rate by draft depth on held-out text, and for k = 1…5 the
measured tokens per target forward and the decode speed-up over plain decoding.

* The target is a trained run (``--target``, an ``openk3 train`` folder); its val split gives the held-out
  windows and the prompts.
* Both drafts start from the same initialisation (``--seed``) and read the same batches of the run's
  training split; they differ only in the loss.
* Decoding: ``--prompts`` val prompts of ``--prompt-len`` tokens, ``--new-tokens`` new tokens each, greedy
  (temperature 0: the speculative output equals the plain one token for token, checked) or sampled
  (``--temperature``). Speed-up = plain time / speculative time, each the best of ``--repeats`` rounds, the
  two alternating so a shared machine slows both alike.

* ``--streams 1,64``: the serving engine's decode throughput with and without the LK draft (k =
  ``--engine-k``) at those numbers of concurrent greedy streams, outputs compared.

    python benchmarks/speculative.py --target runs/k3-tiny --out benchmarks/results/speculative_cpu.md
    python benchmarks/speculative.py --target RUN_K3_SMALL --device cuda --draft-steps 2000 \\
        --batch-size 32 --seq-len 512 --new-tokens 256 --streams 1,64 --out OUT_DIR   # GPU, k3-small

Prints a Markdown report; ``--out`` is a ``.md`` file or a folder (which receives ``speculative_<device>.md``
and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from openk3.checkpoint import from_pretrained
from openk3.data import TokenDataset
from openk3.data.shards import RandomBatches
from openk3.generate import generate
from openk3.model.draft import DraftConfig, build_draft, feature_layers
from openk3.speculative import SpeculativeStats, speculative_generate
from openk3.train.draft_trainer import acceptance_by_step, expected_accepted_length, train_draft
from openk3.train.state import latest_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="run folder of the target (openk3 train --out)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 on CUDA, else float32")
    p.add_argument("--draft-steps", type=int, default=150, help="training steps of each draft")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-batches", type=int, default=8, help="val batches for the acceptance rates")
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--streams", default="", help="engine throughput at these concurrent streams, e.g. 1,64")
    p.add_argument("--engine-k", type=int, default=3, help="k of the engine throughput test")
    p.add_argument("--threads", type=int, help="torch threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help=".md file or folder for the report")
    return p.parse_args()


def timed(fn, *args):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    folder = latest_checkpoint(args.target)
    run = folder.parent.parent
    model = from_pretrained(folder, device=device, dtype=dtype).eval()
    lm = getattr(model, "language_model", model)
    cfg = lm.config
    train, val = TokenDataset(run / "data" / "train.bin"), TokenDataset(run / "data" / "val.bin")
    ks = [int(k) for k in args.ks.split(",")]
    result = {
        "target": str(folder),
        "device": str(device),
        "dtype": str(dtype),
        "args": vars(args),
        "drafts": {},
    }

    drafts = {}
    for loss in ("lk", "kl"):
        dc = DraftConfig(
            feature_layers(cfg.num_hidden_layers), cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers,
            loss=loss, ttt_steps=args.ttt_steps,
        )  # fmt: skip
        draft = build_draft(cfg, dc, device=device, dtype=dtype, seed=args.seed)
        batches = (x.to(device) for x, _ in RandomBatches(train, args.batch_size, args.seq_len, args.seed))
        fit = train_draft(
            draft, lm, batches, args.draft_steps, lr=args.lr, log_every=max(1, args.draft_steps // 5)
        )
        windows = (
            x.to(device) for x, _ in val.iter_sequential(args.batch_size, args.seq_len, args.eval_batches)
        )
        alphas = acceptance_by_step(draft, lm, windows, 5)
        drafts[loss] = draft
        result["drafts"][loss] = {
            "train_seconds": fit.seconds, "final_loss": fit.losses[-1], "alpha_by_depth": alphas,
            "expected_tokens_per_forward": {k: expected_accepted_length(alphas, k) for k in ks}, "decode": {},
        }  # fmt: skip
        print(f"{loss}: trained {args.draft_steps} steps in {fit.seconds:.0f} s; alpha by depth "
              f"{[round(a, 3) for a in alphas]}", file=sys.stderr)  # fmt: skip

    prompts = [
        val.tokens_N[i * 997 : i * 997 + args.prompt_len].astype("int64").tolist()
        for i in range(args.prompts)
    ]
    sample = dict(temperature=args.temperature, seed=args.seed)

    def plain():
        return [generate(model, torch.tensor([p], device=device), args.new_tokens, **sample) for p in prompts]

    def spec(draft, k, stats):
        return [
            speculative_generate(
                model,
                draft,
                torch.tensor([p], device=device),
                args.new_tokens,
                num_speculative_tokens=k,
                stats=stats,
                **sample,
            )  # fmt: skip
            for p in prompts
        ]

    with torch.no_grad():
        reference, _ = timed(plain)  # warm-up
        for loss, draft in drafts.items():
            spec(draft, ks[0], SpeculativeStats())
            for k in ks:
                best_plain = best_spec = float("inf")
                for _ in range(args.repeats):
                    _, t_plain = timed(plain)
                    stats = SpeculativeStats()
                    out, t_spec = timed(spec, draft, k, stats)
                    best_plain, best_spec = min(best_plain, t_plain), min(best_spec, t_spec)
                same = (
                    all(torch.equal(a, b) for a, b in zip(out, reference)) if args.temperature == 0 else None
                )
                result["drafts"][loss]["decode"][k] = {
                    "tokens_per_forward": stats.acceptance_length, "acceptance_rate": stats.acceptance_rate,
                    "plain_s": best_plain, "spec_s": best_spec, "speedup": best_plain / best_spec,
                    "identical_to_plain": same,
                }  # fmt: skip
                print(f"{loss} k={k}: {stats.acceptance_length:.2f} tokens/forward, speed-up "
                      f"{best_plain / best_spec:.2f}x", file=sys.stderr)  # fmt: skip
        if args.streams:
            result["engine"] = engine_throughput(model, drafts["lk"], val, args, device)
    report = render(result, ks, args)
    print(report)
    if args.out:
        out = Path(args.out)
        name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[-1].lower()
        if out.suffix != ".md":
            out.mkdir(parents=True, exist_ok=True)
            (out / f"speculative_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            out = out / f"speculative_{name}.md"
        out.write_text(report)
    return 0


def engine_throughput(model, draft, val, args, device) -> dict:
    """Decode tokens per second of the serving engine with and without the LK draft (greedy, every request
    ``--new-tokens`` long, all submitted at once; prefills included)."""
    from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

    out = {}
    for n in [int(x) for x in args.streams.split(",")]:
        prompts = [
            val.tokens_N[i * 131 : i * 131 + args.prompt_len].astype("int64").tolist() for i in range(n)
        ]
        row = {}
        for name, d in (("plain", None), ("speculative", draft)):
            config = EngineConfig(
                CacheConfig(block_size=16, pool_mib=256 if device.type == "cpu" else 8192),
                SchedulerConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=max(2048, n * 8)),
            )
            best = float("inf")
            for r in range(args.repeats + 1):  # the first round warms up
                eng = LLMEngine(model, config, draft=d, num_speculative_tokens=args.engine_k)
                reqs = [
                    Request(f"{name}{r}-{i}", p, SamplingParams(max_tokens=args.new_tokens))
                    for i, p in enumerate(prompts)
                ]
                got, seconds = timed(eng.generate, reqs)
                if r:
                    best = min(best, seconds)
            row[name] = {"tokens_per_s": n * args.new_tokens / best, "seconds": best}
            row[name + "_outputs"] = [got[q.request_id] for q in reqs]
        row["identical"] = row.pop("plain_outputs") == row.pop("speculative_outputs")
        row["speedup"] = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        print(
            f"engine {n} streams: speed-up {row['speedup']:.2f}x, identical {row['identical']}",
            file=sys.stderr,
        )
        out[n] = row
    return out


def render(result: dict, ks: list[int], args) -> str:
    d = result["drafts"]
    lines = [
        "# Speculative decoding: LK- vs KL-trained drafts",
        "",
        f"Target `{result['target']}` on {result['device']} ({result['dtype']}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}); drafts trained {args.draft_steps} steps each on the same batches "
        f"({args.batch_size} × {args.seq_len} tokens, unroll {args.ttt_steps}, lr {args.lr}).",
        f"Command: `python benchmarks/speculative.py {' '.join(sys.argv[1:])}`",
        "",
        "Acceptance rate α by draft depth on held-out windows (`openk3 eval --draft`'s numbers):",
        "",
        "| loss | depth 1 | 2 | 3 | 4 | 5 | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for loss in ("lk", "kl"):
        a = d[loss]["alpha_by_depth"]
        lines.append(
            f"| {loss} | " + " | ".join(f"{x:.3f}" for x in a) + f" | {d[loss]['train_seconds']:.0f} |"
        )
    lines += [
        "",
        f"Decoding {args.prompts} prompts × {args.new_tokens} new tokens, temperature {args.temperature}: "
        "tokens per target forward (measured) and speed-up over plain decoding:",
        "",
        "| k | LK tokens/forward | LK speed-up | KL tokens/forward | KL speed-up | identical to plain |",
        "|---|---|---|---|---|---|",
    ]
    for k in ks:
        lk, kl = d["lk"]["decode"][k], d["kl"]["decode"][k]
        same = {None: "n/a (sampled)", True: "yes", False: "NO"}[
            lk["identical_to_plain"] and kl["identical_to_plain"]
        ]
        lines.append(
            f"| {k} | {lk['tokens_per_forward']:.2f} | {lk['speedup']:.2f}× | {kl['tokens_per_forward']:.2f} | "
            f"{kl['speedup']:.2f}× | {same} |"
        )
    if "engine" in result:
        lines += [
            "",
            f"Serving engine, greedy, {args.new_tokens} new tokens per stream, LK draft at k = {args.engine_k} "
            "(prefills included):",
            "",
            "| streams | plain tok/s | speculative tok/s | speed-up | identical outputs |",
            "|---|---|---|---|---|",
        ]
        for n, row in result["engine"].items():
            lines.append(
                f"| {n} | {row['plain']['tokens_per_s']:.1f} | {row['speculative']['tokens_per_s']:.1f} | "
                f"{row['speedup']:.2f}× | {'yes' if row['identical'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
