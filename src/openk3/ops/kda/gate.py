"""KDA decay gates: raw pre-activation → per-channel log-decay ``g ≤ 0`` (natural log).

Two gates, both per head ``h`` and channel ``k`` (kda_kernels reference §1.3; fla ``fla/ops/kda/gate.py``):

* Kimi-Linear (unbounded, ``lower_bound=None``): ``g = −exp(A_log_h) · softplus(g_raw + dt_bias)``, in
  ``(−∞, 0)``;
* K3 (bounded, ``lower_bound = lb < 0``): ``g = lb · sigmoid(exp(A_log_h) · (g_raw + dt_bias))``, in
  ``(lb, 0)``; the K3 checkpoints use ``lb = −5``.

Legend: ``H`` heads, ``K`` key (channel) dim, ``...`` leading dims (e.g. ``B, T``); ``H'`` ≥ H the stored
length of ``A_log`` (the official K3 tensor is padded to 128).
"""

from __future__ import annotations

import math

import torch


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Map the raw gate to the per-step log-decay ``g`` (natural log, ≤ 0).

    Args:
        g_raw: ``[..., H, K]`` raw pre-activation (any float dtype).
        A_log: ``[H']`` with ``H' ≥ H``; only the first ``H`` entries are used.
        dt_bias: ``[H*K]`` bias added to ``g_raw`` before the activation, or None (no bias).
        lower_bound: None for the Kimi-Linear softplus gate; a finite float ``lb < 0`` for the K3 gate
            ``lb·sigmoid(exp(A_log)·(g_raw + dt_bias))``.

    Returns:
        ``[..., H, K]`` log-decay, computed and returned in float32 (float64 when ``g_raw`` is float64).
        Differentiable w.r.t. ``g_raw``, ``A_log`` and ``dt_bias``. ``A_log`` is held at ``⌊ln max⌋`` of the
        dtype (88 in fp32, 709 in fp64) before ``exp``, where ``e^{A_log}`` would otherwise overflow to inf
        and the gradients would be 0·inf = NaN: a K3 gate saturated there has gradients 0 (fp64's limit) and
        its log-decay changes only where ``|g_raw + dt_bias| < 1e-36``; the softplus gate's rate is
        ``e^{88}`` there instead of inf.

    Raises:
        ValueError: ``g_raw`` has fewer than 2 dims, ``A_log`` is not 1-D with at least ``H`` entries,
            ``dt_bias`` does not have ``H*K`` entries, or ``lower_bound`` is not a finite negative number.
    """
    H, K = _check_gate_args(g_raw, A_log, dt_bias, lower_bound)
    dtype = torch.float64 if g_raw.dtype == torch.float64 else torch.float32
    x_HK = g_raw.to(dtype)
    if dt_bias is not None:
        x_HK = x_HK + dt_bias.to(dtype).view(H, K)
    # A_log held at ⌊ln(dtype max)⌋ (88 in fp32) before exp: an inf rate would make a saturated gate's
    # gradients 0·inf = NaN where fp64 gives 0 (and the clamp's gradient is 0 there, as fp64's limit)
    max_log_rate = math.floor(math.log(torch.finfo(dtype).max))
    rate_H1 = A_log[:H].to(dtype).clamp(max=max_log_rate).exp().unsqueeze(-1)
    if lower_bound is None:
        return -rate_H1 * _softplus(x_HK)
    return lower_bound * torch.sigmoid(rate_H1 * x_HK)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)`` without a threshold cut-off (exact in fp64 too, unlike ``F.softplus``'s x > 20)."""
    return torch.logaddexp(x, x.new_zeros(()))


def _check_gate_args(
    g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> tuple[int, int]:
    if g_raw.dim() < 2:
        raise ValueError(f"g_raw must be [..., H, K]; got shape {tuple(g_raw.shape)}")
    H, K = g_raw.shape[-2:]
    if A_log.dim() != 1 or A_log.numel() < H:
        raise ValueError(f"A_log must be 1-D with at least H={H} entries; got shape {tuple(A_log.shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"dt_bias must have shape [H*K] = [{H * K}]; got {tuple(dt_bias.shape)}")
    if lower_bound is not None and not (math.isfinite(lower_bound) and lower_bound < 0):
        raise ValueError(f"lower_bound must be a finite negative number (K3 uses -5.0); got {lower_bound}")
    return H, K
