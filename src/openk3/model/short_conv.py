"""ShortConvolution: the causal depthwise convolution (kernel W = 4) + SiLU on KDA's q, k and v.

Legend: ``B`` batch, ``T`` new tokens, ``C`` channels (H·K), ``W`` kernel size, ``N`` packed documents.
The conv cache holds the last ``W − 1`` *inputs* per channel, ``[B, C, W−1]`` (the layout vLLM and fla use).
Weight ``[C, 1, W]`` as ``nn.Conv1d(groups=C)``; official checkpoints store it in fp32 without bias.
:func:`short_conv` runs several such convolutions over the same tokens as one (their channels concatenated:
KDA's q, k, v); :func:`short_conv_step_` runs a few new tokens of them (``G`` stacked) on a cache updated in
place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.model.varlen import document_starts


class ShortConvolution(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(
        self,
        x_BTC: torch.Tensor,
        conv_state_BCW: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal depthwise conv then SiLU (:func:`short_conv` with this module's weight).

        Args:
            x_BTC: input ``[B, T, C]``.
            conv_state_BCW: previous ``W − 1`` inputs ``[B, C, W−1]`` (zeros if ``None``); not with cu_seqlens.
            cu_seqlens: int64 ``[N+1]`` packed documents (``B = 1``); the window never crosses a boundary.
            output_final_state: also return the new cache, ``[B, C, W−1]`` (``[N, C, W−1]`` when packed).
        Returns:
            ``(y_BTC, state or None)``.
        """
        return short_conv(x_BTC, self.weight, conv_state_BCW, cu_seqlens, output_final_state)


def short_conv(
    x_BGTC: torch.Tensor,
    weight_GC1W: torch.Tensor,
    conv_state_BGCW: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`ShortConvolution.forward` for ``G`` convolutions of ``C`` channels over the same tokens at once
    (KDA's q, k and v): ``x`` ``[B, *G, T, C]`` with time the second-to-last axis, weights ``[*G, C, 1, W]``,
    cache ``[B, *G, C, W−1]`` (``*G``: no axis for a single convolution, as :class:`ShortConvolution` calls it).
    Returns ``(y [B, *G, T, C], state or None)``: the state ``[B, *G, C, W−1]``, or ``[N, *G, C, W−1]`` with
    ``cu_seqlens`` (``B = 1``). ``y`` is contiguous, so each convolution's ``[B, T, C]`` is too.

    The ``W`` taps are shifted multiply-adds summed in tap order (a depthwise ``conv1d`` is slow on CPU, esp. in
    fp64): ``y[t] = Σ_w xp[t + w] · weight[:, w]`` over the inputs ``xp`` with the ``W − 1`` past ones in front,
    each product and partial sum rounded to ``x``'s dtype, every channel as if alone. The operators do not
    depend on ``G`` or ``C``: one tap costs a slice, a multiply and an add."""
    T, C = x_BGTC.shape[-2:]
    W = weight_GC1W.shape[-1]
    if conv_state_BGCW is None:
        past_BGWC = x_BGTC.new_zeros(*x_BGTC.shape[:-2], W - 1, C)
    else:
        past_BGWC = conv_state_BGCW.transpose(-1, -2).to(x_BGTC.dtype)
    xp_BGSC = torch.cat([past_BGWC, x_BGTC], dim=-2)  # S = T + W - 1
    taps_G1C = weight_GC1W.to(x_BGTC.dtype).movedim(-1, 0).transpose(-1, -2).unbind(0)  # W views [*G, 1, C]
    keeps_T1 = None
    if cu_seqlens is not None:
        # tap w of token t reads position t - (W-1) + w; drop taps before the document start
        pos_WT = (
            torch.arange(W, device=x_BGTC.device)[:, None] - (W - 1) + torch.arange(T, device=x_BGTC.device)
        )
        keeps_T1 = (pos_WT >= document_starts(cu_seqlens, T)).to(x_BGTC.dtype)[:, :, None].unbind(0)
    y_BGTC = None
    for w, weight_G1C in enumerate(taps_G1C):
        tap_BGTC = xp_BGSC[..., w : w + T, :] * weight_G1C
        tap_BGTC = tap_BGTC if keeps_T1 is None else tap_BGTC * keeps_T1[w]
        y_BGTC = tap_BGTC if y_BGTC is None else y_BGTC + tap_BGTC  # tap 0 itself: 0 + a = a
    y_BGTC = F.silu(y_BGTC)
    if not output_final_state:
        return y_BGTC, None
    if cu_seqlens is None:
        return y_BGTC, xp_BGSC[..., T:, :].transpose(-1, -2).contiguous()
    return y_BGTC, _packed_final_state(xp_BGSC[0], cu_seqlens, W)


def _packed_final_state(xp_GSC: torch.Tensor, cu_seqlens: torch.Tensor, W: int) -> torch.Tensor:
    """The last ``W − 1`` inputs of each packed document, zeros before its start: ``[N, *G, C, W−1]``."""
    starts_N, ends_N = cu_seqlens[:-1].to(torch.int64), cu_seqlens[1:].to(torch.int64)
    pos_NW = ends_N[:, None] - (W - 1) + torch.arange(W - 1, device=xp_GSC.device)  # token positions
    rows = (pos_NW + (W - 1)).flatten()  # xp is shifted by W - 1 zeros
    state_GNWC = xp_GSC.index_select(-2, rows).unflatten(-2, pos_NW.shape)
    state_GNWC = state_GNWC * (pos_NW >= starts_N[:, None])[..., None].to(xp_GSC.dtype)
    return state_GNWC.movedim(-3, 0).transpose(-1, -2).contiguous()


def short_conv_step_(
    x_BGCT: torch.Tensor, state_BGCW: torch.Tensor, weight_GCW: torch.Tensor
) -> torch.Tensor:
    """``SiLU(causal depthwise conv)`` of ``T`` new inputs per channel for ``G`` convolutions at once (the taps
    summed in :meth:`ShortConvolution.forward`'s order); the cache ``state`` (the last ``W − 1`` inputs, any
    float dtype) is overwritten in place. Returns ``[B, G, C, T]`` in ``x``'s dtype."""
    W, T = weight_GCW.shape[-1], x_BGCT.shape[-1]
    xp_BGCS = torch.cat([state_BGCW.to(x_BGCT.dtype), x_BGCT], -1)  # S = W − 1 + T
    y_BGCT = xp_BGCS[..., :T] * weight_GCW[..., 0, None]
    for w in range(1, W):
        y_BGCT = y_BGCT + xp_BGCS[..., w : w + T] * weight_GCW[..., w, None]
    state_BGCW.copy_(xp_BGCS[..., T:])
    return F.silu(y_BGCT)
