"""Shared comparison helpers for the KDA op tests (torch ops and Triton kernels): relative RMSE that prints
both errors and fails loudly (STYLE.md point 10)."""

from __future__ import annotations

import torch


def rel_rmse(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``RMS(out − ref) / RMS(ref)`` in float64 (the absolute RMS when ``ref`` is all zeros)."""
    ref, out = ref.double(), out.double()
    denom = ref.square().mean().sqrt().item()
    err = (out - ref).square().mean().sqrt().item()
    return err / denom if denom > 0 else err


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Fail unless ``out`` is finite and within ``tol`` relative RMSE of ``ref``; print both errors."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    rel = rel_rmse(ref, out)
    max_abs = (out.double() - ref.double()).abs().max().item()
    print(f"{name:>15}: rel RMSE {rel:.2e}  max abs {max_abs:.2e}  (tol {tol:.0e})")
    assert rel <= tol, f"{name}: rel RMSE {rel:.3e} > {tol:.0e} (max abs {max_abs:.3e})"
