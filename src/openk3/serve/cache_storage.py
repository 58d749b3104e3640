"""The tensors behind the block pool: one ``[num_blocks, page_numel]`` buffer holding MLA latent blocks and
KDA state pages, with gather/scatter helpers for the model runner.

Page layouts (``storage dtype`` = ``promote(model dtype, float32)``, so KDA states stay fp32 for bf16
models as reference/systems.md §3.3 requires; latents of a bf16 model are stored widened, exactly)::

    MLA block page : [L_mla, bs, C + r]          latent kv_a_layernorm(c) then the unrotated k_pe
    KDA state      : state_pages pages, flat = [L_kda, H, K, V] recurrent state, then
                     [L_kda, 3, P, W−1] q/k/v conv caches (last W−1 inputs), zero-padded to whole pages

Legend: ``B`` requests, ``S`` cached tokens (padded to the longest), ``T`` new tokens, ``bs`` block size,
``L_mla``/``L_kda`` MLA/KDA layers, ``C`` kv_lora_rank, ``r`` qk_rope_head_dim, ``H`` KDA heads,
``K = V`` head size, ``P = H·K``, ``W`` short-conv kernel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from openk3.model.cache import KDACache


@dataclass(frozen=True)
class PageLayout:
    block_size: int
    num_mla_layers: int
    num_kda_layers: int
    latent_width: int
    """``C + r`` numbers per token per MLA layer."""
    kda_shape: tuple[int, int, int, int]
    """``(H, K, V, W)``."""
    model_dtype: torch.dtype
    dtype: torch.dtype
    """Storage dtype: ``promote(model_dtype, float32)``."""

    @classmethod
    def for_config(cls, text_config, block_size: int, model_dtype: torch.dtype) -> PageLayout:
        kinds = text_config.layer_types
        la = text_config.linear_attn_config
        H, K = (la.num_heads, la.head_dim) if la is not None else (0, 0)
        W = la.short_conv_kernel_size if la is not None else 1
        return cls(
            block_size,
            kinds.count("mla"),
            kinds.count("kda"),
            text_config.kv_lora_rank + text_config.qk_rope_head_dim,
            (H, K, K, W),
            model_dtype,
            torch.promote_types(model_dtype, torch.float32),
        )

    @property
    def state_numel(self) -> int:
        H, K, V, W = self.kda_shape
        return self.num_kda_layers * (H * K * V + 3 * H * K * (W - 1))

    @property
    def page_numel(self) -> int:
        if self.num_mla_layers:
            return self.num_mla_layers * self.block_size * self.latent_width
        return max(self.state_numel, 1)

    @property
    def state_pages(self) -> int:
        """Pages one KDA state occupies (0 without KDA layers)."""
        return math.ceil(self.state_numel / self.page_numel) if self.num_kda_layers else 0

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.dtype.itemsize


class CacheStorage:
    """``pages`` ``[num_blocks, page_numel]`` in the storage dtype, zero-initialised, on ``device``."""

    def __init__(self, layout: PageLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.pages = torch.zeros(num_blocks, layout.page_numel, dtype=layout.dtype, device=device)

    # ---- MLA latents -----------------------------------------------------------------------------------
    def _latent_view(self) -> torch.Tensor:
        lo = self.layout
        return self.pages.view(-1, lo.num_mla_layers, lo.block_size, lo.latent_width)

    def gather_latents(
        self, block_tables: list[list[int]], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents of ``B`` requests, padded: ``([L_mla, B, S, C + r]`` in the model dtype,
        key mask ``[B, S]`` bool (True = a real token)); ``S = max(lengths)``; padded entries are zero."""
        lo, dev = self.layout, self.pages.device
        B, S = len(lengths), max(lengths)
        nb = max(1, math.ceil(S / lo.block_size))
        idx_BN = torch.zeros(B, nb, dtype=torch.int64)
        for b, (table, n) in enumerate(zip(block_tables, lengths)):
            used = math.ceil(n / lo.block_size)
            idx_BN[b, :used] = torch.tensor(table[:used], dtype=torch.int64)
        pages = self._latent_view()[idx_BN.to(dev)]  # [B, nb, L, bs, C + r]
        lat_LBSd = pages.permute(2, 0, 1, 3, 4).reshape(lo.num_mla_layers, B, nb * lo.block_size, -1)[
            :, :, :S
        ]
        mask_BS = torch.arange(S, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        lat_LBSd = lat_LBSd.masked_fill(~mask_BS[None, :, :, None], 0.0)
        return lat_LBSd.to(lo.model_dtype), mask_BS

    def write_latents(self, block_ids: list[int], offsets: list[int], latents_LNd: torch.Tensor) -> None:
        """Write ``N`` tokens' latents ``[L_mla, N, C + r]``: token ``n`` goes to block ``block_ids[n]`` at
        in-block offset ``offsets[n]``."""
        dev = self.pages.device
        pages = torch.tensor(block_ids, dtype=torch.int64, device=dev)
        offs = torch.tensor(offsets, dtype=torch.int64, device=dev)
        self._latent_view()[pages, :, offs] = latents_LNd.transpose(0, 1).to(self.layout.dtype)

    # ---- KDA states ------------------------------------------------------------------------------------
    def _slot_index(self, slots: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=self.pages.device).view(len(slots), -1)

    def read_states(self, slots: list[tuple[int, ...]]) -> list[KDACache]:
        """One batched :class:`KDACache` per KDA layer for ``B`` state slots: conv ``[B, P, W−1]`` in the
        model dtype, recurrent ``[B, H, K, V]`` in the storage dtype (copies)."""
        lo = self.layout
        H, K, V, W = lo.kda_shape
        B, L = len(slots), lo.num_kda_layers
        flat = self.pages.index_select(0, self._slot_index(slots).view(-1)).view(B, -1)
        rec = flat[:, : L * H * K * V].view(B, L, H, K, V)
        conv = flat[:, L * H * K * V : lo.state_numel].view(B, L, 3, H * K, W - 1).to(lo.model_dtype)
        return [
            KDACache(conv_states=(conv[:, i, 0], conv[:, i, 1], conv[:, i, 2]), recurrent_state=rec[:, i])
            for i in range(L)
        ]

    def write_states(self, slots: list[tuple[int, ...]], caches: list[KDACache]) -> None:
        """Store per-layer batched caches (as :meth:`read_states` returns them, after a forward)."""
        lo = self.layout
        H, K, V, W = lo.kda_shape
        B, L = len(slots), lo.num_kda_layers
        flat = self.pages.new_empty(B, lo.state_pages * lo.page_numel)
        flat[:, lo.state_numel :] = 0
        rec = flat[:, : L * H * K * V].view(B, L, H, K, V)
        conv = flat[:, L * H * K * V : lo.state_numel].view(B, L, 3, H * K, W - 1)
        for i, c in enumerate(caches):
            rec[:, i] = c.recurrent_state
            for j in range(3):
                conv[:, i, j] = c.conv_states[j]
        self.pages.index_copy_(0, self._slot_index(slots).view(-1), flat.view(-1, lo.page_numel))

    def copy_pages(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        """Copy-on-write of a KDA checkpoint into a request's own slot (or back)."""
        self.pages[list(dst)] = self.pages[list(src)]

    def zero_pages(self, pages: tuple[int, ...]) -> None:
        self.pages[list(pages)] = 0
