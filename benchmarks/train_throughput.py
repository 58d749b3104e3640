"""Training throughput and memory on one GPU: what ``openk3 train --device cuda`` runs, in one process.

Sections (each records its numbers, or its error, and the run goes on; ``--budget-s`` skips what would start
after the time budget):

1. ``--preset`` (default ``k3-1b``) at a global batch of ``--batch-size × --seq-len`` (16 × 2048): the memory
   planner (:func:`openk3.train.memory.plan_memory`, budget ``--memory-gb``, default 60) picks micro-batch,
   accumulation and checkpointing; compiled decoder layers with the Triton KDA custom op, the fused
   LM-head loss, Per-Head Muon + AdamW, Quantile Balancing, two host reads per step after the backward (loss
   and gradient norm; the balancer's statistics), as the trainer (:func:`openk3.train.step.accumulate_gradients`). Reported: tokens/s, MFU, the
   estimate and the measured peak (``torch.cuda.max_memory_allocated``), time per phase (CUDA events).
2. ``profile``: one step of that model under ``torch.profiler`` (:mod:`openk3.train.step_profile`): per
   phase the wall time, the time the GPU was busy, kernels, launches and host syncs; the top kernels by
   device time; device time per kernel class (GEMM, KDA kernels, MoE dispatch, attention, other;
   communication is 0 on one GPU); where the step reads device data on the host
   (:class:`~openk3.train.host_syncs.HostSyncAudit`); frames compiled, graphs and graph breaks of
   ``torch.compile``; and, from one more profiled step with shapes and stacks, the operators that launched the
   step's cuBLAS slow-path kernels (SIMT ``magma_sgemmEx``, GEMV) and device-to-device copies.
3. ``dense``: the dense yardstick, the same model with every MoE replaced by a dense SwiGLU MLP of the same active
   parameters (KDA/MLA, AttnRes kept), same batch and planner: its MFU and K3's ratio to it.
4. ``compare``: ``--compare-preset`` (``k3-small``) at ``--compare-batch`` × ``--seq-len`` against transformers'
   ``kimi_linear`` of the same shape, with fla's kernels when ``fla`` imports (forward + backward + fused
   AdamW; it has no balancer); the ratio of tokens/s.
5. ``largest``: the largest ``k3_shaped(depth)`` model whose estimate fits 90% of the GPU, confirmed with two steps at
   micro-batch 1 with full checkpointing (stepping down a size when that runs out of memory).

``--sections`` picks among them (``planned``, ``profile``, ``compare``, ``dense``, ``largest``; default all;
4 runs before 3; ``profile`` runs ``planned`` too). Compiling ``k3-1b`` alone takes most of six minutes on an
H200, so a device limited to ten minutes a command runs the sections in two commands.

MFU = 6 · active parameters · tokens/s / peak bf16 dense FLOP/s (attention score FLOPs not counted;
``--peak-tflops`` default 989, the H200 SXM datasheet value).

GPU (about 7 minutes on an H200)::

    python benchmarks/train_throughput.py --json benchmarks/results/train_throughput_h200.json \
        --md benchmarks/results/train_throughput_h200.md

Where the k3-1b step goes, alone (a few minutes on a cold H200, most of it compiling)::

    python benchmarks/train_throughput.py --sections profile --steps 3 --json DIR/train_profile_h200.json \
        --md DIR/train_profile_h200.md

CPU smoke run (k3-tiny, a few tiny steps, every section; the numbers mean nothing)::

    python benchmarks/train_throughput.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import openk3
from openk3.accounting import closed_form_counts
from openk3.config import KimiLinearConfig, text_config_of
from openk3.presets import get_preset, k3_shaped
from openk3.train.balance import QuantileBalancer
from openk3.train.checkpointing import wrap_decoder_layers
from openk3.train.host_syncs import HostSyncAudit
from openk3.train.memory import MODES, device_memory_bytes, estimate_memory, plan_memory
from openk3.train.optim import build_optimizer
from openk3.train.step import accumulate_gradients
from openk3.train.step_profile import profile_step as step_profile


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
    """Named marks through a step: CUDA events on a GPU (device time), ``perf_counter`` on the CPU; the time
    from one mark to the next counts for the first mark's name."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self, name: str = "") -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        """Seconds per name (synchronises the GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for (name, a), (_, b) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = out.get(name, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


def training_step(model, optimizer, x, y, balancer, mark) -> torch.Tensor:
    """One step of the transformers model (bf16 autocast, full logits, no balancer)."""
    mark("fwd_bwd")
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    mark("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return loss


def time_training(model, optimizer, batches, steps: int, warmup: int) -> dict:
    """Mean seconds per phase of the transformers model over ``steps`` timed steps."""
    device = batches[0][0].device
    parts: dict[str, list[float]] = {}
    for i in range(warmup + steps):
        timer = PhaseTimer(device)
        loss = training_step(model, optimizer, *batches[i % len(batches)], None, timer.mark)
        if i >= warmup:
            for key, seconds in timer.seconds().items():
                parts.setdefault(key, []).append(seconds)
        elif device.type == "cuda":
            torch.cuda.synchronize()
    phases = {f"{k}_s": sum(v) / len(v) for k, v in parts.items()}
    return {"phases": phases, "step_s": sum(phases.values()), "last_loss": loss.item()}


def openk3_step(model, optimizer, balancer, x, y, micro_batch: int, mark) -> torch.Tensor:
    """One step as :class:`~openk3.train.trainer.Trainer` runs it: micro-batches, gradient clipping, the
    step's one host sync (loss and norm), Quantile Balancing, the optimizer."""
    total = accumulate_gradients(
        model,
        x,
        y,
        micro_batch,
        mark=lambda p: mark(p if p != "end" else "clip_sync"),
    )
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    loss, _ = torch.stack([total, norm.to(total)]).tolist()
    mark("balancer")
    if balancer is not None:
        balancer.step()
    mark("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return loss


def time_openk3(model, optimizer, balancer, batches, micro_batch: int, steps: int, warmup: int) -> dict:
    """Mean seconds per phase over ``steps`` timed steps after ``warmup`` (compilation), and the peak memory
    of the timed steps."""
    device = batches[0][0].device
    for i in range(warmup):
        openk3_step(model, optimizer, balancer, *batches[i % len(batches)], micro_batch, lambda p: None)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    parts: dict[str, list[float]] = {}
    for i in range(steps):
        timer = PhaseTimer(device)
        loss = openk3_step(model, optimizer, balancer, *batches[i % len(batches)], micro_batch, timer.mark)
        for key, seconds in timer.seconds().items():
            parts.setdefault(key, []).append(seconds)
    phases = {f"{k}_s": sum(v) / len(v) for k, v in parts.items()}
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"phases": phases, "step_s": sum(phases.values()), "last_loss": loss, "peak_bytes": peak}


def random_batches(vocab: int, batch: int, seq_len: int, device, count: int = 2) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=g).to(device)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def dense_yardstick(config) -> KimiLinearConfig:
    """``config``'s text model with every MoE block replaced by a dense SwiGLU MLP, the width solved so the
    active parameters match (:func:`openk3.accounting.closed_form_counts`); KDA/MLA layers and AttnRes kept."""
    text = text_config_of(config)
    data = text.to_dict()
    data.update(
        num_experts=None, hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, first_k_dense_replace=0, intermediate_size=1,
    )  # fmt: skip
    base = closed_form_counts(KimiLinearConfig.from_dict(data))["active"]
    target = closed_form_counts(text)["active"]
    per_column = 3 * text.hidden_size * text.num_hidden_layers
    data["intermediate_size"] = max(1, 1 + round((target - base) / per_column))
    return KimiLinearConfig.from_dict(data)


def planned_row(name: str, config, args, device, budget: int, compile: bool) -> tuple[dict, tuple]:
    """Plan, build, compile and time ``config`` at the global batch; returns the row and (model, optimizer,
    balancer, batches, micro-batch) for the profile."""
    text = text_config_of(config)
    plan = plan_memory(
        config, args.batch_size, args.seq_len, budget, device.type, name=name, compiled=compile,
        micro_batch=args.micro_batch_size, checkpointing=args.activation_checkpointing,
    )  # fmt: skip
    counts = closed_form_counts(text)
    model = openk3.build_model(config, device=device, seed=0)
    wrap_decoder_layers(model, plan.checkpointing, compile)
    balancer = QuantileBalancer(model) if text.num_experts else None
    optimizer = build_optimizer(model, lr=1e-3)
    batches = random_batches(text.vocab_size, args.batch_size, args.seq_len, device)
    print(f"{name}: {plan}", flush=True)
    t = time_openk3(model, optimizer, balancer, batches, plan.micro_batch, args.steps, args.warmup)
    row = {
        "model": f"openk3 {name}" + (" (compiled layers)" if compile else " (eager)"),
        "optimizer": "Per-Head Muon + AdamW" + (" + QB" if balancer else ""),
        "params": counts["total"],
        "active_params": counts["active"],
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum,
        "checkpointing": plan.checkpointing,
        "estimate_bytes": plan.estimate.total,
        **t,
    }
    return row, (model, optimizer, balancer, batches, plan.micro_batch)


KDA_KERNELS = re.compile(
    r"^(tile_prepare|tile_recurrence|pair_prepare|chunk_from_tiles|chunk_prepare|chunk_state_fwd|"
    r"chunk_state_bwd|chunk_grad_wy_value|chunk_grad_wy_key|chunk_grad_intra)_kernel"
)
CLASSES = (
    ("KDA kernels", KDA_KERNELS),
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot", re.I)),
    ("GEMM (dense + grouped experts)", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|gemv|grouped|_mm_|::mm$|addmm|bmm", re.I)),
    ("MoE dispatch (sort, gather, scatter)", re.compile(r"sort|scatter|gather|index|cumsum|radix|histc|bincount", re.I)),
)  # fmt: skip


def kernel_classes(top_kernels) -> dict[str, float]:
    """Device seconds per kernel class (:data:`CLASSES`, first match wins) from ``(name, count, seconds)``."""
    totals = {name: 0.0 for name, _ in CLASSES} | {"other (norms, activations, optimizer, glue)": 0.0}
    for kernel, _, seconds in top_kernels:
        key = next((name for name, pattern in CLASSES if pattern.search(kernel)), None)
        totals[key or "other (norms, activations, optimizer, glue)"] += seconds
    return totals


SECTIONS = ("planned", "profile", "compare", "dense", "largest")
"""The module docstring's sections, as ``--sections`` names them."""


SLOW_PATH_KERNELS = {
    "cuBLAS SIMT GEMM (magma_sgemmEx)": "magma_sgemmEx",
    "cuBLAS GEMV": "gemv",
    "device-to-device copy": "Memcpy DtoD",
}
"""Kernels the 2026-12-02 profile found in bulk where tensor-core GEMMs or fused kernels were expected."""


def kernel_sources(step, device, top: int = 8) -> dict[str, list[dict]]:
    """Which operator launched each :data:`SLOW_PATH_KERNELS` kernel of one more step (``torch.profiler`` with
    shapes and Python stacks): per kind, the ``top`` (operator, input shapes, autograd node or ``forward``,
    innermost openk3 frame) by device time, with counts and ms. Empty on the CPU (no device kernels)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True
    ) as p:
        step(lambda phase: None)
        torch.cuda.synchronize()
    found: dict[str, dict[tuple, list[float]]] = {kind: {} for kind in SLOW_PATH_KERNELS}
    for e in p.events():
        for k in e.kernels:
            kind = next((kind for kind, key in SLOW_PATH_KERNELS.items() if key in k.name), None)
            if kind is None:
                continue
            node, parent = "forward", e.cpu_parent
            while parent is not None:
                if parent.name.startswith("autograd::engine::evaluate_function: "):
                    node = parent.name.removeprefix("autograd::engine::evaluate_function: ")
                    break
                parent = parent.cpu_parent
            frames = [f for f in (e.stack or []) if "openk3" in f or "benchmarks" in f]
            key = (e.name, str(e.input_shapes)[:120], node, frames[0] if frames else "")
            entry = found[kind].setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += k.duration / 1e3
    return {
        kind: [
            dict(op=op, shapes=shapes, autograd=node, where=where, count=n, ms=ms)
            for (op, shapes, node, where), (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
        ]
        for kind, rows in found.items()
    }


def profile_step(model, optimizer, balancer, batches, micro_batch: int) -> dict:
    """One step under ``torch.profiler`` (:func:`openk3.train.step_profile.profile_step`: per phase wall and
    device-busy time, kernels, launches, host syncs; the top kernels; device time per kernel class), the host
    reads of one more (unprofiled) step with where they are (:class:`~openk3.train.host_syncs.HostSyncAudit`;
    ``torch.compile`` steps aside while a dispatch mode is active, so that step runs the layers eagerly), and
    what ``torch.compile`` did so far (frames compiled, graphs, Inductor kernels generated, graph breaks)."""
    import torch._inductor.metrics as inductor_metrics
    from torch._dynamo.utils import counters

    device = batches[0][0].device
    prof = step_profile(
        lambda mark: openk3_step(model, optimizer, balancer, *batches[0], micro_batch, mark), device
    )
    with HostSyncAudit(device) as audit:
        openk3_step(model, optimizer, balancer, *batches[1], micro_batch, lambda p: None)
    try:
        sources = kernel_sources(
            lambda mark: openk3_step(model, optimizer, balancer, *batches[0], micro_batch, mark), device
        )
    except Exception as exc:  # a diagnostic: its failure must not lose the profile above
        sources = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        **prof.to_dict(),
        "kernel_sources": sources,
        "markdown": prof.markdown(),
        "classes": kernel_classes(prof.top_kernels),
        "host_reads": audit.counts(),
        "dynamo": {
            "graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": dict(counters["graph_break"]),
            "frames_compiled": counters["frames"].get("ok", 0),
            "inductor_kernels": inductor_metrics.generated_kernel_count,
        },
    }


def two_steps(config, args, device) -> dict:
    """Two steps of ``config`` at micro-batch 1 with full checkpointing, eager; the second is timed."""
    model = openk3.build_model(config, device=device, seed=0)
    wrap_decoder_layers(model, "full", compile=False)
    optimizer = build_optimizer(model, lr=1e-4)
    batches = random_batches(config.text_config.vocab_size, 1, args.seq_len, device)
    return time_openk3(model, optimizer, QuantileBalancer(model), batches, 1, 1, 1)


def largest_trainable(args, device, total_bytes: int) -> dict:
    """The largest ``k3_shaped(depth)`` whose estimate (micro-batch 1, full checkpointing) fits 90% of the
    device, confirmed by two steps; a depth that runs out of memory is reported and the next smaller tried."""
    budget = int(0.9 * total_bytes)

    def estimate(depth: int) -> int:
        return estimate_memory(k3_shaped(depth), 1, args.seq_len, "full", device.type).total

    tried = []
    for depth in sorted((d for d in args.depths if estimate(d) <= budget), reverse=True):
        config = k3_shaped(depth)
        counts = closed_form_counts(config.text_config)
        try:
            t = two_steps(config, args, device)
        except torch.OutOfMemoryError as err:
            tried.append({"depth": depth, "error": str(err).splitlines()[0]})
            free(device)
            continue
        return {
            "depth": depth, "params": counts["total"], "active_params": counts["active"],
            "peak_bytes": t["peak_bytes"], "step_s": t["step_s"], "estimate_bytes": estimate(depth),
            "tried": tried,
        }  # fmt: skip
    return {"depth": None, "tried": tried}


def free(device) -> None:
    import gc

    torch._dynamo.reset()  # compiled graphs and their guards hold the previous model's layers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


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
        "micro_batch": batches[0][0].shape[0],
        "grad_accum": 1,
        "checkpointing": "none",
        **t,
    }


def section(results: dict, name: str, start: float, budget_s: float, fn):
    """Run ``fn()``; record its error (and go on) or skip it when the time budget is spent."""
    if time.perf_counter() - start > budget_s:
        results["errors"][name] = f"skipped: the {budget_s:.0f} s budget was spent"
        print(f"{name}: skipped (time budget)", flush=True)
        return None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as err:  # noqa: BLE001  (a benchmark section reports its failure and the run goes on)
        results["errors"][name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        traceback.print_exc()
        out = None
    results["section_seconds"][name] = time.perf_counter() - t0
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def sections(args, device, results: dict) -> None:
    """The five sections in order of importance; the JSON and Markdown are rewritten after each, so a run cut
    short by a time limit keeps what it measured."""
    start = time.perf_counter()
    compile = not args.no_compile
    budget = int(args.memory_gb * 1e9)
    held = {}

    def main_row():
        row, held["k3"] = planned_row(args.preset, get_preset(args.preset), args, device, budget, compile)
        results["rows"]["k3"] = row

    if "planned" in args.sections or "profile" in args.sections:  # the profile steps the planned model
        section(results, "planned run", start, args.budget_s, main_row)
    if "k3" in held and "profile" in args.sections:
        results["profile"] = section(
            results, "profile", start, args.budget_s, lambda: profile_step(*held["k3"])
        )
    held.clear()
    free(device)
    finish(results, args)
    if "compare" not in args.sections and "dense" not in args.sections and "largest" not in args.sections:
        return
    compare_args = argparse.Namespace(
        **{
            **vars(args),
            "batch_size": args.compare_batch,
            "micro_batch_size": None,
            "activation_checkpointing": "auto",
        }
    )  # the comparison runs its batch of its own planner's choice, as transformers' row does

    def compare_rows():
        config = get_preset(args.compare_preset)
        row, _ = planned_row(args.compare_preset, config, compare_args, device, 10**15, compile)
        results["rows"]["compare"] = row
        free(device)
        if not args.skip_hf:
            text = text_config_of(config)
            batches = random_batches(text.vocab_size, args.compare_batch, args.seq_len, device)
            hf = hf_row(text, batches, args, results)
            if hf is not None:
                results["rows"]["hf"] = hf

    if "compare" in args.sections:
        section(results, "comparison", start, args.budget_s, compare_rows)
    free(device)
    finish(results, args)

    def dense_row():
        config = dense_yardstick(get_preset(args.preset))
        row, _ = planned_row(f"{args.preset} dense yardstick", config, args, device, budget, compile)
        results["rows"]["dense"] = row

    if "dense" in args.sections:
        section(results, "dense yardstick", start, args.budget_s, dense_row)
    free(device)
    finish(results, args)
    total = device_memory_bytes(args.device) if device.type == "cuda" else int(args.memory_gb * 1e9)
    if "largest" in args.sections:
        results["largest"] = section(
            results, "largest model", start, args.budget_s, lambda: largest_trainable(args, device, total)
        )
    finish(results, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 and a message on a bad one)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="k3-1b")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--memory-gb", type=float, default=60.0, help="the planner's budget (10^9 bytes)")
    parser.add_argument("--compare-preset", default="k3-small")
    parser.add_argument("--compare-batch", type=int, default=4)
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        help="sequences per forward (default: the planner's largest that fits)",
    )
    parser.add_argument(
        "--activation-checkpointing", default="auto", choices=("auto", *MODES),
        help="per decoder layer (default: the planner's choice)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--depths", type=int, nargs="+", default=[24, 28, 32, 36, 40])
    parser.add_argument("--budget-s", type=float, default=390.0, help="start no section after this many s")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-compile", action="store_true", help="eager decoder layers")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: k3-tiny, batch 4 × 64, 1 step")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="sections to run: planned, profile, compare, dense, largest",
    )  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.preset, args.compare_preset = "cpu", "k3-tiny", "k3-tiny"
        args.batch_size, args.seq_len, args.compare_batch, args.steps, args.warmup = 4, 64, 2, 1, 1
        args.memory_gb, args.depths, args.no_compile, args.budget_s = 2.0, [8, 12], True, 3600.0
    if args.micro_batch_size is not None and (
        args.micro_batch_size < 1 or args.batch_size % args.micro_batch_size
    ):
        parser.error(f"--micro-batch-size {args.micro_batch_size} must divide --batch-size {args.batch_size}")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on a GPU machine, or pass --quick for a CPU smoke run")
    device = torch.device(args.device)
    results = {
        "command": "python benchmarks/train_throughput.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"none (CPU, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "batch": f"{args.batch_size} x {args.seq_len}",
        "memory_budget_gb": args.memory_gb,
        "peak_tflops": args.peak_tflops,
        "rows": {},
        "errors": {},
        "section_seconds": {},
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    sections(args, device, results)


def finish(results: dict, args) -> None:
    tokens = {
        "k3": args.batch_size,
        "dense": args.batch_size,
        "compare": args.compare_batch,
        "hf": args.compare_batch,
    }
    for key, row in results["rows"].items():
        row["tokens_per_s"] = tokens[key] * args.seq_len / row["step_s"]
        row["mfu"] = 6 * row["active_params"] * row["tokens_per_s"] / (args.peak_tflops * 1e12)
    rows = results["rows"]
    if "k3" in rows and "dense" in rows:
        results["mfu_ratio_dense_over_k3"] = rows["dense"]["mfu"] / rows["k3"]["mfu"]
    if "compare" in rows and "hf" in rows:
        results["ratio_vs_transformers"] = rows["compare"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"GPU {results['gpu']}, torch {results['torch']}, triton {results.get('triton')}, transformers "
        f"{results.get('transformers')}, fla {results.get('fla')}; bf16 autocast, fp32 master weights; MFU = "
        f"6 · active params · tokens/s / {args.peak_tflops:g} TFLOP/s",
        "",
        "| model | optimizer | params | active | batch | micro × accum | checkpointing | step ms | tokens/s | MFU "
        "| est. GB | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        batch = tokens[key]
        peak = "–" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 1e9:.1f}"
        est = "–" if r.get("estimate_bytes") is None else f"{r['estimate_bytes'] / 1e9:.1f}"
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['params'] / 1e6:,.0f}M | {r['active_params'] / 1e6:,.0f}M | "
            f"{batch} × {args.seq_len} | {r['micro_batch']} × {r['grad_accum']} | {r['checkpointing']} | "
            f"{r['step_s'] * 1e3:,.0f} | {r['tokens_per_s']:,.0f} | {r['mfu'] * 100:.1f}% | {est} | {peak} |"
        )
    lines += ["", "Time per phase (ms per step, CUDA events):", ""]
    names = sorted({k for r in rows.values() for k in r["phases"]})
    lines += [
        "| model | " + " | ".join(n.removesuffix("_s") for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['model']} | " + " | ".join(f"{r['phases'].get(n, 0) * 1e3:,.1f}" for n in names) + " |"
        )
    if results.get("profile"):
        prof = results["profile"]
        lines += ["", f"One {args.preset} step under torch.profiler, the device synchronised at each phase boundary "
                  "(busy share = device busy / wall; launches = CUDA runtime launch calls; host syncs = the "
                  "step's own waits on the device):", ""]  # fmt: skip
        lines += prof["markdown"]
        classes = prof["classes"]
        whole = sum(classes.values()) or math.nan
        lines += ["", "| kernel class | ms | share |", "|---|---|---|"]
        lines += [f"| {k} | {v * 1e3:,.1f} | {v / whole * 100:.1f}% |" for k, v in classes.items()]
        reads = prof["host_reads"]
        lines += ["", f"Host reads of device data in one step ({sum(reads.values())}, HostSyncAudit): "
                  + ("; ".join(f"{n} × {where}" for where, n in reads.items()) or "none")]  # fmt: skip
        for kind, rows in prof.get("kernel_sources", {}).items():
            if kind == "error":
                lines += ["", f"Kernel sources: failed ({rows})"]
                continue
            lines += ["", f"Where the {kind} kernels of one step come from (operator that launched them):", "",
                      "| operator | input shapes | autograd node | openk3 frame | kernels | ms |", "|---|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| `{r['op']}` | {r['shapes']} | {r['autograd']} | {r['where']} | {r['count']} | {r['ms']:.2f} |"
                      for r in rows] or ["| none | | | | 0 | 0 |"]  # fmt: skip
        dyn = prof["dynamo"]
        lines += ["", f"torch.compile so far: {dyn['frames_compiled']} frames compiled into {dyn['graphs']} "
                  f"graphs ({dyn['inductor_kernels']} Inductor kernels generated), {dyn['graph_breaks']} graph "
                  "breaks"]  # fmt: skip
    if "mfu_ratio_dense_over_k3" in results:
        lines += [
            "",
            f"Dense yardstick MFU / K3 MFU: {results['mfu_ratio_dense_over_k3']:.2f}× (target ≤ 1.5×)",
        ]
    if "ratio_vs_transformers" in results:
        lines += ["", f"openk3 {args.compare_preset} / transformers kimi_linear tokens/s: "
                  f"{results['ratio_vs_transformers']:.2f}× (target ≥ 2×)"]  # fmt: skip
    big = results.get("largest")
    if big and big.get("depth"):
        peak = "–" if big["peak_bytes"] is None else f"{big['peak_bytes'] / 1e9:.1f} GB"
        lines += ["", f"Largest model that trains here: k3_shaped({big['depth']}) ({big['params'] / 1e9:.2f}B "
                  f"parameters, {big['active_params'] / 1e9:.2f}B active), micro-batch 1 × {args.seq_len}, full "
                  f"checkpointing: peak {peak} (estimate {big['estimate_bytes'] / 1e9:.1f} GB), "
                  f"{big['step_s']:.2f} s per step"]  # fmt: skip
    if big and big.get("tried"):
        lines += [
            "",
            "Out of memory: " + "; ".join(f"depth {t['depth']}: {t['error']}" for t in big["tried"]),
        ]
    if results["errors"]:
        lines += ["", "Sections that failed or were skipped:", ""]
        lines += [f"- {k}: {v}" for k, v in results["errors"].items()]
    text_out = "\n".join(lines)
    print(text_out, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text_out + "\n")


if __name__ == "__main__":
    main()
