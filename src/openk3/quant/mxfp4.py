"""The MX formats of K3's routed experts: MXFP4 weights and MXFP8 activations (OCP Microscaling v1.0).

An MX block is ``G = 32`` consecutive numbers along the last (contraction) dim sharing one E8M0 scale
``2^(e − 127)``, stored as the biased exponent byte ``e`` (``255`` is NaN). The shared exponent is
``floor(log2(max|block|)) − emax`` with ``emax = 2`` for FP4 E2M1 and ``8`` for FP8 E4M3, and each number is
``x / scale`` rounded to nearest-even in the element type, saturating at its largest value (±6 for E2M1,
±448 for E4M3); dequantised, a number is ``element · scale`` (``docs/references.md#mxfp4-routed-experts``).

Checkpoint layout (compressed-tensors ``mxfp4-pack-quantized``) for a weight ``W [R, C]``:

* ``weight_packed`` uint8 ``[R, C/2]``: two E2M1 codes per byte, element ``2i`` in the low nibble, ``2i+1`` in
  the high nibble; a code is a sign bit (8) and a magnitude index into ``0, 0.5, 1, 1.5, 2, 3, 4, 6``;
* ``weight_scale`` uint8 ``[R, C/32]``: the E8M0 exponent byte of each block.

The arithmetic is torchao's MX implementation (``torchao.prototype.mx_formats``), imported on first use (it
takes seconds; the warnings it logs while importing are silenced); this module
fixes the scale rule (FLOOR, the OCP rule) and the layout. Leading dims are kept: ``[E, F, L]`` packs to
``[E, F, L/2]`` and ``[E, F, L/32]``.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch

MX_BLOCK = 32
"""Numbers per MX block (``group_size`` in the checkpoint's ``quantization_config``)."""
E8M0_NAN = 255
"""The E8M0 byte that encodes NaN: a scale tensor holding it is corrupt."""
MXFP4_BYTES_PER_NUMBER = 0.5 + 1 / MX_BLOCK
"""Checkpoint bytes per MXFP4 number: half a byte of code plus one scale byte per block (4.25 bits)."""


_MX_MODULE = "torchao.prototype.mx_formats.mx_tensor"
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers that warn while torchao imports: CUDA kernels a CPU build lacks, enums torch now handles itself."""


def _mx():
    """torchao's MX module, imported on first use with its import-time warnings silenced (later calls are a
    ``sys.modules`` look-up, which ``torch.compile`` traces through)."""
    module = sys.modules.get(_MX_MODULE)
    if module is not None:
        return module
    logs = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(_MX_MODULE)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "MXFP4 experts need torchao, a dependency of openk3: pip install 'torchao>=0.18'"
        ) from e
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _check_blocks(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"{what} has last dim {x.shape[-1]}, not a multiple of the MX block size {MX_BLOCK}: "
            "MX formats need a contraction dim divisible by 32"
        )


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., C]`` (float) to MXFP4: ``(packed uint8 [..., C/2], scale uint8 [..., C/32])``.

    fp16/fp64 inputs are quantised from their fp32 value. Raises ``ValueError`` when ``C`` is not a multiple
    of 32."""
    _check_blocks(w, "the weight")
    mx = _mx()
    scale, packed = mx.to_mx(w.detach().float().contiguous(), torch.float4_e2m1fn_x2, MX_BLOCK)
    return packed.view(torch.uint8), scale.view(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``element · 2^(scale − 127)`` of an MXFP4 tensor, shape ``[..., 2·packed.shape[-1]]`` in ``dtype``.

    Exact in fp32, bf16 and wider (an E2M1 number times a power of two needs two significant bits). A scale
    byte 255 gives NaN for its block (:func:`check_mxfp4` rejects such a tensor when it is loaded)."""
    mx = _mx()
    out = mx.to_dtype(
        packed.contiguous(),
        scale.contiguous().view(torch.float8_e8m0fnu),
        torch.float4_e2m1fn_x2,
        MX_BLOCK,
        torch.float32,
    )
    return out.to(dtype)


def fake_quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w.dtype``: the weight the packed checkpoint will hold (no gradient)."""
    return dequantize_mxfp4(*quantize_mxfp4(w), w.dtype)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3 numbers, blocks of 32 along the last dim) quantise-dequantise of ``x [..., C]`` in
    ``x.dtype`` (no gradient). Raises ``ValueError`` when ``C`` is not a multiple of 32."""
    _check_blocks(x, "the activation")
    mx = _mx()
    scale, data = mx.to_mx(x.detach().float().contiguous(), torch.float8_e4m3fn, MX_BLOCK)
    return mx.to_dtype(data, scale, torch.float8_e4m3fn, MX_BLOCK, torch.float32).to(x.dtype)


def check_mxfp4(name: str, packed: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming tensor ``name`` when a packed or scale tensor is not uint8, or a scale holds
    the E8M0 NaN byte 255 (a damaged file: every number of that block would dequantise to NaN)."""
    for what, t in (("weight_packed", packed), ("weight_scale", scale)):
        if t is not None and t.dtype != torch.uint8:
            raise ValueError(f"{name} is {t.dtype}, expected uint8 ({what} of an MXFP4 tensor)")
    if scale is not None:
        bad = int((scale == E8M0_NAN).sum())
        if bad:
            raise ValueError(
                f"{name} holds {bad} E8M0 scale byte(s) 255 (NaN in the MX format): the scale tensor is "
                "corrupt, so its blocks cannot be dequantised"
            )


class _MXFP4STE(torch.autograd.Function):
    """``forward(w) = fake_quantize_mxfp4(w)``, ``backward(g) = g`` (straight-through)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_mxfp4(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _MXFP8STE(_MXFP4STE):
    """``forward(x) = fake_quantize_mxfp8(x)``, the same straight-through backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_mxfp8(x)


def mxfp4_ste(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake-quantised ``w`` with the straight-through gradient (Bengio et al., 2013): the forward value
    is exactly :func:`fake_quantize_mxfp4` (no ``w + (q − w)`` rounding), the gradient passes unchanged.
    QAT's expert weights."""
    return _MXFP4STE.apply(w)


def mxfp8_ste(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 fake-quantised ``x`` with the straight-through gradient; QAT's expert GEMM inputs."""
    return _MXFP8STE.apply(x)
