"""ShortConvolution: the causal depthwise convolution (kernel W = 4) + SiLU on KDA's q, k and v.

Legend: ``B`` batch, ``T`` new tokens, ``C`` channels (H·K), ``W`` kernel size, ``N`` packed documents.
The conv cache holds the last ``W − 1`` *inputs* per channel, ``[B, C, W−1]`` (the layout vLLM and fla use).
Weight ``[C, 1, W]`` as ``nn.Conv1d(groups=C)``; official checkpoints store it in fp32 without bias.
:func:`short_conv_step_` runs a few new tokens of several such convolutions at once (``G`` stacked, as
KDA's q, k, v) on a cache updated in place.
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
        """Causal depthwise conv then SiLU.

        Args:
            x_BTC: input ``[B, T, C]``.
            conv_state_BCW: previous ``W − 1`` inputs ``[B, C, W−1]`` (zeros if ``None``); not with cu_seqlens.
            cu_seqlens: int64 ``[N+1]`` packed documents (``B = 1``); the window never crosses a boundary.
            output_final_state: also return the new cache, ``[B, C, W−1]`` (``[N, C, W−1]`` when packed).
        Returns:
            ``(y_BTC, state or None)``.
        """
        B, T, C = x_BTC.shape
        W = self.kernel_size
        if conv_state_BCW is None:
            past_BWC = x_BTC.new_zeros(B, W - 1, C)
        else:
            past_BWC = conv_state_BCW.transpose(1, 2).to(x_BTC.dtype)
        xp_BSC = torch.cat([past_BWC, x_BTC], dim=1)  # S = T + W - 1
        weight_CW = self.weight[:, 0, :].to(x_BTC.dtype)
        keep_TW = None
        if cu_seqlens is not None:
            # tap w of token t reads position t - (W-1) + w; drop taps before the document start
            pos_TW = (
                torch.arange(T, device=x_BTC.device)[:, None] - (W - 1) + torch.arange(W, device=x_BTC.device)
            )
            keep_TW = (pos_TW >= document_starts(cu_seqlens, T)[:, None]).to(x_BTC.dtype)
        y_BTC = None
        for w in range(W):  # W shifted multiply-adds (depthwise conv1d is slow on CPU, esp. in fp64)
            tap_BTC = xp_BSC[:, w : w + T] * weight_CW[:, w]
            tap_BTC = tap_BTC if keep_TW is None else tap_BTC * keep_TW[None, :, w, None]
            y_BTC = tap_BTC if y_BTC is None else y_BTC + tap_BTC  # tap 0 itself: 0 + a = a
        y_BTC = F.silu(y_BTC)
        if not output_final_state:
            return y_BTC, None
        if cu_seqlens is None:
            return y_BTC, xp_BSC[:, T:, :].transpose(1, 2).contiguous()
        return y_BTC, self._packed_final_state(xp_BSC[0], cu_seqlens)

    def _packed_final_state(self, xp_SC: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        W = self.kernel_size
        starts_N, ends_N = cu_seqlens[:-1].to(torch.int64), cu_seqlens[1:].to(torch.int64)
        pos_NW = ends_N[:, None] - (W - 1) + torch.arange(W - 1, device=xp_SC.device)  # token positions
        state_NWC = xp_SC[pos_NW + (W - 1)]  # xp is shifted by W - 1 zeros
        state_NWC = state_NWC * (pos_NW >= starts_N[:, None])[..., None].to(xp_SC.dtype)
        return state_NWC.transpose(1, 2).contiguous()


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
