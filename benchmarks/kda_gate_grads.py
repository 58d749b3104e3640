"""Accuracy of the Triton KDA backward's gradients against fp64, beside fla's on a GPU.

Each case is ``T:H:gate`` (gate one of normal, slow, fast, mixed, saturated) on the inputs of
``tests/test_kda_triton.py::test_gpu_gate_grads_against_fla`` (B1, D = 128, bf16, K3 gate in the op, q/k L2
norm in the op, ``seed = T + H``), or ``varlen:H:gate`` on those of ``test_gpu_gate_grads_against_fla_varlen``
(five packed documents of 1000, 63, 1, 2900 and 136 tokens, ``seed = H``). Each cell is the relative RMSE of one gradient against the fp64
reference (the per-token recurrence up to 128 tokens, the fp64 torch chunk form beyond). On a CUDA machine
with ``fla`` installed the cells are ``ours / fla`` and a case fails where ours passes 1.5× fla's; without a
GPU the kernels run on the Triton interpreter (``triton >= 3.9``), whose tensor-core products round their
operands as the GPU does, and the cells are ours alone (or ``ours / fla`` with fla's H200 numbers passed as
``--fla-json``). With ``--out`` the table is rewritten after every case, so a run cut at a time limit keeps
the cases it finished.

    python benchmarks/kda_gate_grads.py 64:4:slow 300:4:normal                    # CPU: the interpreter
    python benchmarks/kda_gate_grads.py --out benchmarks/results/kda_gate_grads_cpu.md 64:4:normal ...

The helpers (inputs, reference, error) are the test module's, so the benchmark measures what the tests hold.
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
import test_kda_triton as kt  # noqa: E402  (sets TRITON_INTERPRET on a machine without CUDA)

VARLEN = "varlen"
"""The ``T`` of a case on the packed documents of ``kt.VARLEN_GATE_GRAD_LENGTHS``."""


def parse_case(text: str) -> tuple[int | str, int, str]:
    try:
        T, H, gate = text.split(":")
        case = (T if T == VARLEN else int(T)), int(H), gate
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected T:H:gate or varlen:H:gate, e.g. 300:4:normal"
        ) from None
    if case[2] not in kt.GATE_GRAD_CASES or (case[0] != VARLEN and case[0] < 1) or case[1] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: T (or varlen), H ≥ 1 and gate one of {', '.join(kt.GATE_GRAD_CASES)}"
        )
    return case


def case_inputs(T: int | str, H: int, gate: str, device: str) -> tuple[dict, torch.Tensor | None]:
    """The test module's inputs of one case and its ``cu_seqlens`` (``None`` for one fixed-length sequence)."""
    if T == VARLEN:
        return kt.varlen_gate_grad_inputs(H, gate, device)
    return kt.gate_grad_inputs(1, T, H, 128, gate=gate, device=device, seed=T + H), None


def out_file(text: str) -> Path:
    """``--out``: a file path in an existing folder (checked before any case runs)."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file path in an existing folder")
    return path


def fla_errors(text: str) -> dict:
    """``--fla-json``: a JSON file ``{"T:H:gate": {gradient: error}}`` with a number for every gradient."""
    try:
        data = json.loads(Path(text).read_text())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not a readable JSON file ({e})") from None
    ok = isinstance(data, dict) and all(
        isinstance(errors, dict)
        and all(
            isinstance(errors.get(n), (int, float)) and not isinstance(errors.get(n), bool)
            for n in kt.GATE_GRAD_NAMES
        )
        for errors in data.values()
    )
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {{'T:H:gate': {{gradient: number}}}} with the gradients {', '.join(kt.GATE_GRAD_NAMES)}"
        )
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", type=parse_case, help="T:H:gate or varlen:H:gate, e.g. 300:4:normal")
    p.add_argument(
        "--fla-json", type=fla_errors, help="fla's errors measured elsewhere: {'T:H:gate': {gradient: error}}"
    )
    p.add_argument(
        "--out", type=out_file, help="also write the Markdown table here (rewritten after each case)"
    )
    args = p.parse_args(argv)
    device = "cuda" if kt.HAS_CUDA else "cpu"
    with_fla = kt.HAS_CUDA and kt.HAS_FLA
    fla_known = args.fla_json or {}
    names = kt.GATE_GRAD_NAMES
    where = (
        "GPU " + torch.cuda.get_device_name()
        if kt.HAS_CUDA
        else f"Triton interpreter on {platform.machine()}"
    )
    lines = [
        f"{where}; torch {torch.__version__}; command: `python benchmarks/kda_gate_grads.py "
        + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        "",
        "| T | H | gate | " + " | ".join(names) + " | within 1.5× fla | s |",
        "|---:|---:|---|" + "---|" * len(names) + "---|---:|",
    ]  # fmt: skip
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    failed = 0
    for T, H, gate in args.cases:
        t0 = time.perf_counter()
        inputs, cu_seqlens = case_inputs(T, H, gate, device)
        ref = kt.reference(inputs, cu_seqlens)
        ours = kt.gate_grad_errors(kt.chunk_kda if kt.HAS_CUDA else kt.triton_chunk, inputs, ref, cu_seqlens)
        fla = (
            kt.gate_grad_errors(kt.fla_chunk_kda, inputs, ref, cu_seqlens)
            if with_fla
            else fla_known.get(f"{T}:{H}:{gate}")
        )
        if fla:
            cells = [f"{ours[n]:.4f} / {fla[n]:.4f}" for n in names]
            bad = [n for n in names if ours[n] > kt.FLA_RATIO * fla[n] + 1e-6]
            verdict = "yes" if not bad else "**no** (" + ", ".join(bad) + ")"
            failed += bool(bad)
        else:
            cells, verdict = [f"{ours[n]:.4f}" for n in names], "—"
        row = (
            f"| {T} | {H} | {gate} | "
            + " | ".join(cells)
            + f" | {verdict} | {time.perf_counter() - t0:.0f} |"
        )
        lines.append(row)
        print(row, flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
