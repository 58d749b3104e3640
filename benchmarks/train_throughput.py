"""Training throughput on one GPU: openk3 ``k3-small`` vs a same-size Hugging Face ``kimi_linear`` model.

Both models train in bf16 autocast with fp32 master weights on the same random token batches; a step is
forward + cross-entropy + backward (+ optimizer step, timed separately). transformers uses
flash-linear-attention's kernels when ``fla`` imports (carry ``fla-core`` and ``flash-linear-attention``
wheels), otherwise its pure-PyTorch KDA (reported in the output). The Hugging Face model has no K3
features (AttnRes, latent MoE, gated MLA, SiTU), so it is matched on width, depth, heads, expert count,
top-k and vocabulary; both parameter counts are printed.

MFU = 6 · active parameters · tokens/s / peak bf16 dense FLOP/s (attention score FLOPs not counted;
``--peak-tflops`` default 989, the H200 SXM datasheet value).

Usage (on a CUDA machine)::

    python benchmarks/train_throughput.py --json benchmarks/results/train_throughput_h200.json \
        --md benchmarks/results/train_throughput_h200.md
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

import openk3
from openk3.accounting import count_parameters
from openk3.presets import get_preset
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


def time_training(model, optimizer, batches, steps: int, warmup: int) -> dict:
    """Mean seconds per fwd+bwd and per optimizer step over ``steps`` timed steps (CUDA events)."""
    fb, opt = [], []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        mid.record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            fb.append(start.elapsed_time(mid) / 1e3)
            opt.append(mid.elapsed_time(end) / 1e3)
    return {"fwd_bwd_s": sum(fb) / len(fb), "optimizer_s": sum(opt) / len(opt), "last_loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    config = get_preset(args.preset)
    text = openk3.config.text_config_of(config)
    tokens = args.batch_size * args.seq_len
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, text.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).cuda()
        batches.append((ids[:, :-1], ids[:, 1:]))
    counts = count_parameters(config)
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "peak_tflops": args.peak_tflops,
        "rows": [],
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    model = openk3.build_model(config, device="cuda", seed=0)
    for name, opt in (("Per-Head Muon + AdamW", build_optimizer(model, lr=1e-3)),):
        print(f"openk3 {args.preset}: timing {args.steps} steps after {args.warmup} warm-up", flush=True)
        t = time_training(model, opt, batches, args.steps, args.warmup)
        results["rows"].append(
            {
                "model": f"openk3 {args.preset}",
                "optimizer": name,
                "params": counts["total"],
                "active_params": counts["active"],
                **t,
            }
        )
        print("openk3:", results["rows"][-1], flush=True)
    del model, opt
    torch.cuda.empty_cache()

    if not args.skip_hf:
        try:
            import fla  # noqa: F401

            results["fla"] = getattr(fla, "__version__", "present")
        except ImportError:
            results["fla"] = None
        import transformers
        from transformers import KimiLinearForCausalLM

        results["transformers"] = transformers.__version__
        hf = KimiLinearForCausalLM(hf_config_like(text)).cuda()
        hf_total = sum(p.numel() for p in hf.parameters())
        hf_active = (
            hf_total
            - text.vocab_size * text.hidden_size
            - sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
            * (1 - text.num_experts_per_token / text.num_experts)
        )
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)
        t = time_training(hf, opt, batches, args.steps, args.warmup)
        kernels = "fla kernels" if results["fla"] else "pure PyTorch KDA"
        results["rows"].append(
            {
                "model": f"transformers kimi_linear ({kernels})",
                "optimizer": "AdamW (fused)",
                "params": hf_total,
                "active_params": int(hf_active),
                **t,
            }
        )
        print("transformers:", results["rows"][-1], flush=True)

    for row in results["rows"]:
        step = row["fwd_bwd_s"] + row["optimizer_s"]
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
        "| model | optimizer | params | active | fwd+bwd ms | opt ms | tokens/s | MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['params'] / 1e6:.1f}M | {r['active_params'] / 1e6:.1f}M | "
            f"{r['fwd_bwd_s'] * 1e3:.1f} | {r['optimizer_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r['mfu'] * 100:.1f}% |"
        )
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
            f.write(
                f"Command: `python benchmarks/train_throughput.py --preset {args.preset} --batch-size "
                f"{args.batch_size} --seq-len {args.seq_len} --steps {args.steps}`\n\n{text_out}\n"
            )


if __name__ == "__main__":
    main()
