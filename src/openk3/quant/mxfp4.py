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

Quantisation is torchao's MX implementation (``torchao.prototype.mx_formats``), imported on first use (it
takes seconds; the warnings it logs while importing are silenced); MXFP4 dequantisation is a table look-up
here, straight to the activations' dtype (bit-identical to torchao's). This module fixes the scale rule (FLOOR, the OCP rule) and the layout. Leading dims are kept: ``[E, F, L]`` packs to
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


def _e2m1_values(device) -> torch.Tensor:
    """The 16 E2M1 numbers in fp32, indexed by code: ``(−1)^s · 2^(e−1) · (1 + m/2)`` (``e ≥ 1``) and
    ``(−1)^s · m/2`` (``e = 0``), for code bits ``s e1 e0 m``; code 8 is ``−0``. Built from integers: exact
    on every device."""
    code = torch.arange(16, device=device)
    e, m = (code >> 1) & 3, (code & 1).float()
    power = (1 << (e - 1).clamp(min=0)).float()
    magnitude = torch.where(e == 0, 0.5 * m, power * (1 + 0.5 * m))
    return torch.where(code >= 8, -magnitude, magnitude)


def _e8m0_values(device) -> torch.Tensor:
    """The 256 E8M0 scales in fp32, indexed by byte: ``2^(byte − 127)`` written as fp32 bits (byte 0 is the
    subnormal ``2^−127``), NaN for byte 255; exact on every device."""
    byte = torch.arange(256, dtype=torch.int32, device=device)
    bits = torch.where(byte == 0, 1 << 22, byte << 23)
    return torch.where(byte == E8M0_NAN, 0x7FC00000, bits).view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``element · 2^(scale − 127)`` of an MXFP4 tensor, shape ``[..., 2·packed.shape[-1]]`` in ``dtype``.

    Each packed byte is looked up in a 256-entry table of its two E2M1 numbers (low nibble first), and each
    block of 32 is multiplied by its E8M0 scale, an exact power of two. The arithmetic is done in bf16 for
    bf16, otherwise in fp32 and then converted to ``dtype``: an E2M1 number times a power of two needs two
    significant bits and bf16 has fp32's exponent range, so bf16 and fp32 give the same value (or the same
    ±inf), subnormals included (the smallest, ``0.5 · 2^−127``, is a bf16 subnormal). Transient memory:
    an int32 index per packed byte (2 bytes per number) beside the output. A scale byte 255 gives NaN for
    its block (:func:`check_mxfp4` rejects such a tensor when it is loaded). Raises ``ValueError`` when either
    tensor is not uint8 or the scale's shape is not ``[..., 2·packed.shape[-1]/32]``."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 packed and scale tensors must be uint8, got {packed.dtype} and {scale.dtype}"
        )
    *lead, H = packed.shape
    if tuple(scale.shape) != (*lead, 2 * H // MX_BLOCK) or (2 * H) % MX_BLOCK:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed shape {tuple(packed.shape)}"
        )
    compute = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = _e2m1_values(packed.device)
    byte = torch.arange(256, device=packed.device)
    pair_table = torch.stack((values[byte & 15], values[byte >> 4]), -1).to(compute)  # [256, 2]
    scale_table = _e8m0_values(packed.device).to(compute)  # [256]
    out = pair_table.index_select(0, packed.reshape(-1).int())  # [n, 2]: the two numbers of each byte
    out = out.view(*lead, 2 * H // MX_BLOCK, MX_BLOCK)
    out.mul_(scale_table.index_select(0, scale.reshape(-1).int()).view(*lead, -1, 1))
    return out.view(*lead, 2 * H).to(dtype)


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
