"""Training throughput on one GPU: openk3 ``k3-small`` vs a same-size Hugging Face ``kimi_linear`` model.

Both models train in bf16 autocast with fp32 master weights on the same random token batches. One openk3
step is what ``openk3 train`` runs: forward + cross-entropy + backward, then Quantile Balancing
(``step``: quantiles, bias overwrite, maxvio; the histogram counting runs inside the MoE blocks' forward) and the Per-Head Muon + AdamW step; each part is
timed separately (CUDA events) and tokens/s counts all three. transformers runs forward + backward + fused
AdamW (it has no balancer). It uses flash-linear-attention's kernels when ``fla`` imports (carry
``fla-core`` and ``flash-linear-attention`` wheels), otherwise its pure-PyTorch KDA (reported in the
output). The Hugging Face model has no K3 features (AttnRes, latent MoE, gated MLA, SiTU), so it is
matched on width, depth, heads, expert count, top-k and vocabulary; both parameter counts are printed.

``--compile`` runs each openk3 decoder layer under ``torch.compile`` with the KDA kernel call left eager
(a graph break around ``chunk_kda``, patched in this process only): norms, AttnRes mixes, SiTU, router and
MoE glue fuse into fewer kernels. Off by default (checked end to end on the CPU only); the first two steps
compile every layer (each layer is its own graph): keep ``--warmup`` >= 2 (default 3).
``--no-balancer`` leaves Quantile Balancing out.
``--count-ops`` adds, per phase of one eager openk3 step, the dispatched non-view aten ops (about one
kernel launch each) and the host reads (``.item()``-like ops and device-to-host copies: syncs on a GPU).

MFU = 6 · active parameters · tokens/s / peak bf16 dense FLOP/s (attention score FLOPs not counted;
``--peak-tflops`` default 989, the H200 SXM datasheet value).

Usage (on a CUDA machine; add ``--compile`` for the compiled variant)::

    python benchmarks/train_throughput.py --preset k3-small --batch-size 4 --seq-len 2048 --steps 10 \
        --json benchmarks/results/train_throughput_h200.json --md benchmarks/results/train_throughput_h200.md

CPU smoke run (CPU bf16 autocast; checks the script end to end, the numbers mean nothing)::

    python benchmarks/train_throughput.py --device cpu --preset k3-tiny --batch-size 1 --seq-len 64 \
        --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
import openk3.model.kda as kda_layer
from openk3.accounting import count_parameters
from openk3.model.modeling import KimiLinearModel
from openk3.presets import get_preset
from openk3.train.balance import QuantileBalancer
from openk3.train.optim import build_optimizer


def hf_config_like(text):
    """A transformers KimiLinearConfig with the width/depth/heads/experts of openk3 text config ``text``."""
    from transformers import KimiLinearConfig

    la = text.linear_attn_config
    return KimiLinearConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_attention_heads,
        intermediate_size=text.intermediate_size,
        moe_intermediate_size=text.moe_intermediate_size,
        num_experts=text.num_experts,
        num_experts_per_token=text.num_experts_per_token,
        num_shared_experts=text.num_shared_experts,
        routed_scaling_factor=1.0,
        first_k_dense_replace=text.first_k_dense_replace,
        q_lora_rank=text.q_lora_rank,
        kv_lora_rank=text.kv_lora_rank,
        qk_nope_head_dim=text.qk_nope_head_dim,
        qk_rope_head_dim=text.qk_rope_head_dim,
        v_head_dim=text.v_head_dim,
        linear_attn_config={
            "kda_layers": la.kda_layers,
            "full_attn_layers": la.full_attn_layers,
            "num_heads": la.num_heads,
            "head_dim": la.head_dim,
            "short_conv_kernel_size": la.short_conv_kernel_size,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


class PhaseTimer:
    """Marks between the phases of a step: CUDA events on a GPU (device time), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks (synchronises the GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def training_step(model, optimizer, x, y, balancer, mark) -> torch.Tensor:
    """One bf16-autocast step; ``mark()`` runs before the forward and after each of the three phases
    (fwd+bwd, balancer, optimizer). Returns the loss."""
    mark()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    mark()
    if balancer is not None:
        balancer.step()
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    return loss


def time_training(model, optimizer, batches, steps: int, warmup: int, balancer=None) -> dict:
    """Mean seconds per fwd+bwd, balancer step and optimizer step over ``steps`` timed steps."""
    device = batches[0][0].device
    parts: dict[str, list[float]] = {"fwd_bwd_s": [], "balancer_s": [], "optimizer_s": []}
    for i in range(warmup + steps):
        timer = PhaseTimer(device)
        loss = training_step(model, optimizer, *batches[i % len(batches)], balancer, timer.mark)
        if i >= warmup:
            for key, seconds in zip(parts, timer.seconds(), strict=True):
                parts[key].append(seconds)
        elif device.type == "cuda":
            torch.cuda.synchronize()
    return {key: sum(v) / len(v) for key, v in parts.items()} | {"last_loss": loss.item()}


class OpCounter(TorchDispatchMode):
    """Per phase of a step: dispatched aten ops that are not views (≈ kernel launches on a GPU) and host
    reads (``_local_scalar_dense``, ``nonzero``, device-to-host copies: each one a sync on a GPU)."""

    PHASES = ("fwd_bwd", "balancer", "optimizer")

    def __init__(self) -> None:
        super().__init__()
        self.marks = 0
        self.ops = dict.fromkeys(self.PHASES, 0)
        self.host_reads = dict.fromkeys(self.PHASES, 0)

    def mark(self) -> None:
        self.marks += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase = self.PHASES[min(max(self.marks - 1, 0), 2)]
        if not func.is_view:
            self.ops[phase] += 1
        name = func._schema.name
        to_host = (
            name == "aten::_to_copy"
            and str(kwargs.get("device", "")) == "cpu"
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
        )
        if name in ("aten::_local_scalar_dense", "aten::nonzero") or to_host:
            self.host_reads[phase] += 1
        return func(*args, **kwargs)


def count_ops(model, optimizer, batches, balancer=None) -> dict:
    """Dispatched ops and host reads of one (eager) training step, per phase."""
    counter = OpCounter()
    with counter:
        training_step(model, optimizer, *batches[0], balancer, counter.mark)
    return {"dispatched_ops": counter.ops, "host_reads": counter.host_reads}


def compile_non_kda(model) -> None:
    """``torch.compile`` every decoder layer's forward; the KDA kernels stay eager (a graph break each).

    Layers differ in kind (KDA/MLA, dense/MoE) and in AttnRes block count, so each gets its own graphs:
    the recompile limit is raised to cover them.
    """
    kda_layer.chunk_kda = torch.compiler.disable(kda_layer.chunk_kda)
    kda_layer.fused_recurrent_kda = torch.compiler.disable(kda_layer.fused_recurrent_kda)
    backbone = next(m for m in model.modules() if isinstance(m, KimiLinearModel))
    limit = 8 * len(backbone.layers)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    for layer in backbone.layers:
        name = "forward_attn_res" if backbone.config.uses_attn_res else "forward_residual"
        setattr(layer, name, torch.compile(getattr(layer, name)))


def hf_row(text, batches, args, results: dict) -> dict | None:
    """Time the same-size transformers ``kimi_linear`` model (fla kernels if they import); ``None`` when this
    transformers has no ``kimi_linear``. Records the transformers and fla versions in ``results``."""
    import transformers

    results["transformers"] = transformers.__version__
    try:
        from transformers import KimiLinearForCausalLM
    except ImportError:
        print(f"transformers {transformers.__version__} has no kimi_linear: no comparison row", flush=True)
        return None
    try:
        import fla

        results["fla"] = getattr(fla, "__version__", "present")
    except ImportError:
        results["fla"] = None
    device = batches[0][0].device
    hf = KimiLinearForCausalLM(hf_config_like(text)).to(device)
    hf_total = sum(p.numel() for p in hf.parameters())
    hf_active = (
        hf_total
        - text.vocab_size * text.hidden_size
        - sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
        * (1 - text.num_experts_per_token / text.num_experts)
    )
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=fused)
    t = time_training(hf, opt, batches, args.steps, args.warmup)
    kernels = "fla kernels" if results["fla"] and device.type == "cuda" else "pure PyTorch KDA"
    return {
        "model": f"transformers kimi_linear ({kernels})",
        "optimizer": "AdamW (fused)" if fused else "AdamW",
        "params": hf_total,
        "active_params": int(hf_active),
        **t,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the openk3 decoder layers (KDA kernels eager)"
    )
    parser.add_argument(
        "--no-balancer", action="store_true", help="leave Quantile Balancing out of the openk3 step"
    )
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="also count dispatched ops and host reads of one eager openk3 step, per phase",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on a GPU machine, or pass --device cpu for a smoke run")
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = get_preset(args.preset)
    text = openk3.config.text_config_of(config)
    tokens = args.batch_size * args.seq_len
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, text.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)
        batches.append((ids[:, :-1], ids[:, 1:]))
    counts = count_parameters(config)
    results = {
        "gpu": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"none (CPU, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "peak_tflops": args.peak_tflops,
        "compile": args.compile,
        "balancer": not args.no_balancer,
        "rows": [],
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    model = openk3.build_model(config, device=device, seed=0)
    balancer = None if args.no_balancer else QuantileBalancer(model)
    optimizer = build_optimizer(model, lr=1e-3)
    if args.compile:
        compile_non_kda(model)
    print(f"openk3 {args.preset}: timing {args.steps} steps after {args.warmup} warm-up", flush=True)
    t = time_training(model, optimizer, batches, args.steps, args.warmup, balancer)
    results["rows"].append(
        {
            "model": f"openk3 {args.preset}" + (" (torch.compile)" if args.compile else ""),
            "optimizer": "Per-Head Muon + AdamW" + ("" if args.no_balancer else " + QB"),
            "params": counts["total"],
            "active_params": counts["active"],
            **t,
        }
    )
    if args.count_ops and not args.compile:
        results["rows"][-1].update(count_ops(model, optimizer, batches, balancer))
    print("openk3:", results["rows"][-1], flush=True)
    del model, optimizer, balancer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf:
        row = hf_row(text, batches, args, results)
        if row is not None:
            results["rows"].append(row)
            print("transformers:", row, flush=True)

    for row in results["rows"]:
        step = row["fwd_bwd_s"] + row["balancer_s"] + row["optimizer_s"]
        row["tokens_per_s"] = tokens / step
        row["tokens_per_s_fwd_bwd"] = tokens / row["fwd_bwd_s"]
        row["mfu"] = 6 * row["active_params"] * row["tokens_per_s"] / (args.peak_tflops * 1e12)
    if len(results["rows"]) == 2:
        results["ratio_tokens_per_s"] = (
            results["rows"][0]["tokens_per_s"] / results["rows"][1]["tokens_per_s"]
        )
        results["ratio_fwd_bwd"] = (
            results["rows"][0]["tokens_per_s_fwd_bwd"] / results["rows"][1]["tokens_per_s_fwd_bwd"]
        )

    lines = [
        f"GPU {results['gpu']}, torch {results['torch']}, triton {results.get('triton')}, "
        f"transformers {results.get('transformers')}, fla {results.get('fla')}; "
        f"batch {args.batch_size} × {args.seq_len} tokens, bf16 autocast",
        "",
        "| model | optimizer | params | active | fwd+bwd ms | balancer ms | opt ms | tokens/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['params'] / 1e6:.1f}M | {r['active_params'] / 1e6:.1f}M | "
            f"{r['fwd_bwd_s'] * 1e3:.1f} | {r['balancer_s'] * 1e3:.1f} | {r['optimizer_s'] * 1e3:.1f} | "
            f"{r['tokens_per_s']:,.0f} | "
            f"{r['mfu'] * 100:.1f}% |"
        )
    for r in results["rows"]:
        if "dispatched_ops" in r:
            ops, reads = r["dispatched_ops"], r["host_reads"]
            lines += [
                "",
                f"{r['model']}, one eager step: dispatched non-view ops "
                + ", ".join(f"{k} {v:,}" for k, v in ops.items())
                + "; host reads "
                + ", ".join(f"{k} {v}" for k, v in reads.items()),
            ]
    if "ratio_tokens_per_s" in results:
        lines.append("")
        lines.append(
            f"openk3 / transformers tokens/s: {results['ratio_tokens_per_s']:.2f}× "
            f"(fwd+bwd only: {results['ratio_fwd_bwd']:.2f}×)"
        )
    text_out = "\n".join(lines)
    print(text_out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"Command: `python benchmarks/train_throughput.py {command_flags(args)}`\n\n{text_out}\n")


def command_flags(args) -> str:
    """The flags that reproduce this run (output paths left out)."""
    flags = [
        f"--preset {args.preset}",
        f"--batch-size {args.batch_size}",
        f"--seq-len {args.seq_len}",
        f"--steps {args.steps}",
        f"--warmup {args.warmup}",
    ]
    flags += ["--device cpu"] if args.device == "cpu" else []
    flags += ["--compile"] if args.compile else []
    flags += ["--no-balancer"] if args.no_balancer else []
    flags += ["--count-ops"] if args.count_ops else []
    flags += ["--skip-hf"] if args.skip_hf else []
    return " ".join(flags)


if __name__ == "__main__":
    main()
