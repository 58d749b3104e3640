"""When the public KDA ops take the Triton path: CUDA tensors, Triton importable, and a supported case.

The chunked path is built on the K3 lower-bounded gate applied in the kernel (``A_log`` given and
``−5 ≤ lower_bound < 0``): its 16-token diagonal tiles are factorised with one causal anchor, which the bound
keeps inside fp32 (docs/references.md#kda-gate-factors, docs/references.md#flashkda). Other gates (Kimi-Linear's softplus, a precomputed
log-decay), float64, other head dims or chunk sizes, and K = 16 when a gradient is needed
(:data:`CHUNK_GRAD_MIN_KEY_DIM`) take the torch path. The decode path takes any gate.
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DIMS = (16, 32, 64, 128)
"""Head dims K and V of the Triton kernels (whole-dim register tiles, powers of two)."""
CHUNK_GRAD_MIN_KEY_DIM = 32
"""Smallest key dim K for which the chunked Triton path runs when a gradient is needed (calls without one take
the 16-token tile forward at every K): at K = 16 the 64-token chunks' bf16 output goes past the 5e-3
tolerance against the fp64 reference (docs/LOG.md), so K = 16 with a gradient takes the torch path."""
SAFE_LOWER_BOUND = -5.0
"""Most negative gate bound of the chunked Triton path (16 steps × 5 nats × log2 e = 115 bits < 127)."""


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` imports (the kernels are imported lazily, only for CUDA tensors)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _on_gpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and triton_available()


def _dims_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.shape[-1] in SUPPORTED_DIMS and v.shape[-1] in SUPPORTED_DIMS


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record a call on ``tensors`` (grad mode on and one of them, None skipped,
    requires grad): such a call needs the chunked path's backward."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _half_or_single(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float16, torch.bfloat16, torch.float32) for t in tensors)


def use_triton_chunk(
    q, k, v, g, beta, *, A_log, lower_bound, chunk_size, dt_bias=None, initial_state=None
) -> bool:
    """Whether :func:`~openk3.ops.kda.chunk.chunk_kda` runs the Triton kernels."""
    return (
        _on_gpu(q, k, v, g, beta)
        and (
            q.shape[-1] >= CHUNK_GRAD_MIN_KEY_DIM
            or not needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
        )
        and A_log is not None
        and lower_bound is not None
        and SAFE_LOWER_BOUND <= lower_bound < 0
        and chunk_size == 64
        and _dims_ok(q, v)
        and _half_or_single(q, k, v, g, beta)
        and q.dtype == k.dtype
    )


def use_triton_recurrent(q, k, v, g, beta, *, initial_state) -> bool:
    """Whether :func:`~openk3.ops.kda.fused_recurrent.fused_recurrent_kda` runs the Triton decode kernel:
    also needs no gradient (the kernel has no backward)."""
    return (
        _on_gpu(q, k, v, g, beta)
        and not needs_grad(q, k, v, g, beta, initial_state)
        and _dims_ok(q, v)
        and _half_or_single(q, k, v, g, beta)
    )
