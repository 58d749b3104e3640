"""Accuracy of every KDA gradient against fp64, openk3's Triton backward beside flash-linear-attention's.

For each case (``T``, ``H``, raw-gate distribution of ``tests/test_kda_triton.py``'s ``gate_grad_inputs``:
``normal``, ``slow``, ``fast``, ``mixed``, ``saturated``), the same bf16 inputs and the same cotangent go
through openk3's ``chunk_kda`` (Triton on CUDA) and fla 0.6.0's ``chunk_kda`` (K3 gate in the kernel,
``safe_gate``, lower bound −5); each gradient (dq, dk, dv, dβ, raw-gate dg, dA_log, ddt_bias) is compared with
one fp64 reference (the per-token recurrence for ``T ≤ 128``, the torch chunk form otherwise) as a relative
RMSE. The ratio ours / fla is what the GPU tests hold to at most 1.5.

Usage (CUDA with fla installed; rows are printed and the JSON/Markdown rewritten as each case ends)::

    python benchmarks/kda_gate_grads.py --out benchmarks/results --cases 1000:4:normal,1000:4:fast

``--budget-s`` stops starting new cases after that many seconds (fla autotunes each new shape, minutes on a
fresh machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DEFAULT_CASES = (
    "1000:4:normal,1000:4:slow,1000:4:fast,1000:4:mixed,1000:4:saturated,300:4:normal,8192:96:normal,"
    "8192:96:fast"
)
NAMES = ("dq", "dk", "dv", "dbeta", "dg", "dA_log", "ddt_bias")


def parse_cases(text: str) -> list[tuple[int, int, str]]:
    """``T:H:gate`` items, comma separated."""
    cases = []
    for item in text.split(","):
        try:
            T, H, gate = item.split(":")
            cases.append((int(T), int(H), gate))
        except ValueError:
            raise SystemExit(f"--cases: {item!r} is not T:H:gate (e.g. 1000:4:normal)") from None
    return cases


def markdown(rows: list[dict], header: dict) -> str:
    lines = [
        "# KDA gradients against fp64: openk3 Triton and fla 0.6.0 in one run",
        "",
        f"Command: `{header['command']}`",
        "",
        f"GPU: {header['gpu']}; torch {header['torch']}, triton {header['triton']}, fla {header['fla']}; "
        f"{header['date']}.",
        "",
        "B1, D = 128, bf16 inputs, K3 gate in the op (lower bound −5), q/k L2 norm in the op; relative RMSE "
        "of each gradient against fp64 (ours / fla).",
        "",
        "| T | H | gate | " + " | ".join(NAMES) + " | worst ours/fla |",
        "|---:|---:|---|" + "---|" * len(NAMES) + "---:|",
    ]
    for r in rows:
        cells = [f"{r['ours'][n]:.4f} / {r['fla'][n]:.4f}" for n in NAMES]
        lines.append(f"| {r['T']} | {r['H']} | {r['gate']} | " + " | ".join(cells) + f" | {r['worst']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for kda_gate_grads_h200.{json,md}")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma list of T:H:gate")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no case after this many seconds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kda_gate_grads.py needs a CUDA GPU (it compares with fla's Triton kernels)")
    import fla

    import openk3
    import test_kda_triton as t
    from openk3.ops.kda import chunk_kda

    args.out.mkdir(parents=True, exist_ok=True)
    header = dict(
        command="python " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=__import__("triton").__version__, fla=getattr(fla, "__version__", "?"),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), host=platform.node(),
        openk3=openk3.__file__,
    )  # fmt: skip
    rows: list[dict] = []
    start = time.perf_counter()
    for T, H, gate in parse_cases(args.cases):
        if time.perf_counter() - start > args.budget_s:
            print(
                f"budget of {args.budget_s:.0f} s spent: cases from T{T} H{H} {gate} on not run", flush=True
            )
            break
        inputs = t.gate_grad_inputs(1, T, H, 128, gate=gate, device="cuda", seed=T + H)
        ref = t.reference(inputs)
        ours = t.gate_grad_errors(chunk_kda, inputs, ref)
        theirs = t.gate_grad_errors(t.fla_chunk_kda, inputs, ref)
        worst = max(ours[n] / max(theirs[n], 1e-6) for n in NAMES if max(ours[n], theirs[n]) > 1e-6)
        row = dict(T=T, H=H, gate=gate, ours=ours, fla=theirs, worst=worst)
        rows.append(row)
        print(
            f"T{T} H{H} {gate:>9}: "
            + "  ".join(f"{n} {ours[n]:.4f}/{theirs[n]:.4f}" for n in NAMES)
            + f"  worst {worst:.2f}",
            flush=True,
        )
        (args.out / "kda_gate_grads_h200.json").write_text(
            json.dumps(dict(header=header, rows=rows), indent=1)
        )
        (args.out / "kda_gate_grads_h200.md").write_text(markdown(rows, header))


if __name__ == "__main__":
    main()
