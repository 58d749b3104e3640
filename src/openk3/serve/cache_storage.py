"""The tensors behind the block pool: one ``[num_blocks, page_numel]`` buffer holding MLA latent blocks and
KDA state pages, with gather/scatter helpers for the model runner.

Page layouts (``storage dtype`` = ``promote(model dtype, float32)``, so KDA states stay fp32 for bf16
models as ``docs/references.md#paged-pool-and-prefix-cache`` requires; latents of a bf16 model are stored
widened, exactly)::

    MLA block page : [L_mla, bs, C + r]          latent kv_a_layernorm(c) then the unrotated k_pe
    KDA state      : state_pages pages, flat = [L_kda, H, K, V] recurrent state, then
                     [L_kda, 3, P, W−1] q/k/v conv caches (last W−1 inputs), zero-padded to whole pages

A batch of KDA states is moved in **units** of ``u = gcd(page_numel, H·K·V, 3·P·(W−1))`` numbers: every
layer's recurrent and conv state starts on a unit boundary and no unit straddles two pages, so one
``index_select`` gathers the states of ``B`` slots straight into per-layer contiguous tensors
(:class:`StateBatch`: ``[L_kda, B, H, K, V]`` and ``[L_kda, B, 3, P, W−1]``) and one ``index_copy_`` writes
them back. The gather lands in a workspace reused from step to step, and the states stay checked out there
until another access needs their pages, so a steady decode batch neither reads nor writes state pages.

Legend: ``B`` requests, ``S`` cached tokens (padded to the longest), ``T`` new tokens, ``bs`` block size,
``L_mla``/``L_kda`` MLA/KDA layers, ``C`` kv_lora_rank, ``r`` qk_rope_head_dim, ``H`` KDA heads,
``K = V`` head size, ``P = H·K``, ``W`` short-conv kernel size, ``U`` units of one layer's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from openk3.model.cache import KDACache
from openk3.serve.transfer import to_device


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


@dataclass
class StateBatch:
    """The KDA states of ``B`` state slots as per-layer contiguous tensors in the storage dtype (fp32 for
    fp32/bf16 models); from :meth:`CacheStorage.gather_states`, views of its workspace, valid until the
    next flush."""

    recurrent: torch.Tensor
    """``[L_kda, B, H, K, V]`` recurrent states (layer ``i``: ``recurrent[i]``, contiguous)."""
    conv: torch.Tensor
    """``[L_kda, B, 3, P, W−1]`` q/k/v conv caches (the last ``W − 1`` inputs)."""
    index: torch.Tensor
    """int64 unit rows of the pool that hold them, in the order of ``recurrent`` then ``conv``."""

    def caches(self, model_dtype: torch.dtype) -> list[KDACache]:
        """One batched :class:`KDACache` per KDA layer for the model's layer forward: conv caches
        ``[B, P, W−1]`` in ``model_dtype``, recurrent ``[B, H, K, V]`` (a view: the forward replaces it)."""
        conv = self.conv.to(model_dtype)
        return [
            KDACache((conv[i, :, 0], conv[i, :, 1], conv[i, :, 2]), self.recurrent[i])
            for i in range(self.recurrent.shape[0])
        ]

    def absorb(self, caches: list[KDACache]) -> None:
        """Copy the states a model forward left in ``caches`` (one per layer) into this batch."""
        for rec_BHKV, conv_B3PW, c in zip(self.recurrent.unbind(0), self.conv.unbind(0), caches):
            rec_BHKV.copy_(c.recurrent_state)
            conv_B3PW.copy_(torch.stack(c.conv_states, 1))


@dataclass
class _Resident:
    """The states checked out into the workspace: the slots in batch order, their pages, the batch."""

    slots: list[tuple[int, ...]]
    pages: set[int]
    batch: StateBatch


class CacheStorage:
    """``pages`` ``[num_blocks, page_numel]`` in the storage dtype, zero-initialised, on ``device``.

    Invariant: the KDA states of the slots checked out by :meth:`gather_states` live in the workspace
    (newer than their pages) until :meth:`flush_states`; every method that reads or writes state pages
    flushes first when it touches them, and :meth:`release_states` does so before a slot is freed."""

    def __init__(self, layout: PageLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.pages = torch.zeros(num_blocks, layout.page_numel, dtype=layout.dtype, device=device)
        self._workspace = self.pages.new_empty(0)
        self._resident: _Resident | None = None
        if layout.num_kda_layers:
            self._init_state_units()

    # ---- MLA latents -----------------------------------------------------------------------------------
    def _latent_view(self) -> torch.Tensor:
        lo = self.layout
        return self.pages.view(-1, lo.num_mla_layers, lo.block_size, lo.latent_width)

    def gather_latents(
        self, block_tables: list[list[int]], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents of ``B`` requests, padded: ``([L_mla, B, S, C + r]`` in the model dtype, key mask
        ``[B, S]`` bool (True = a real token)); ``S = max(lengths)`` (may be 0). Padded entries read the null
        block (zeros). One ``index_select`` over the token rows of the pool."""
        lo, dev = self.layout, self.pages.device
        bs, S = lo.block_size, max(lengths)
        nb = math.ceil(S / bs)
        table_BN = to_device([t[:nb] + [0] * (nb - len(t[:nb])) for t in block_tables], dev)
        return self.gather_latents_padded(table_BN, to_device(lengths, dev), S)

    def gather_latents_padded(
        self, table_BN: torch.Tensor, lengths_B: torch.Tensor, S: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather_latents` from device tensors (no host data: a CUDA graph can capture it): block
        tables int64 ``[B, N]`` with ``N·bs ≥ S``, lengths int64 ``[B]`` ≤ ``S``."""
        lo, dev = self.layout, self.pages.device
        bs, L, B = lo.block_size, lo.num_mla_layers, table_BN.shape[0]
        pos_S = torch.arange(S, device=dev)
        mask_BS = pos_S < lengths_B[:, None]
        block_BS = torch.where(mask_BS, table_BN[:, pos_S // bs], 0)
        layer_L11 = torch.arange(L, device=dev)[:, None, None]
        row_LBS = (block_BS * L + layer_L11) * bs + pos_S % bs  # token rows of pages.view(-1, C + r)
        lat = self.pages.view(-1, lo.latent_width).index_select(0, row_LBS.view(-1))
        return lat.view(L, B, S, lo.latent_width).to(lo.model_dtype), mask_BS

    def write_latents(self, block_ids: list[int], offsets: list[int], latents_LNd: torch.Tensor) -> None:
        """Write ``N`` tokens' latents ``[L_mla, N, C + r]``: token ``n`` goes to block ``block_ids[n]`` at
        in-block offset ``offsets[n]``."""
        dev = self.pages.device
        pages, offs = to_device(block_ids, dev), to_device(offsets, dev)
        self._latent_view()[pages, :, offs] = latents_LNd.transpose(0, 1).to(self.layout.dtype)

    # ---- KDA states ------------------------------------------------------------------------------------
    def _init_state_units(self) -> None:
        """The unit size and, for one slot, each unit's page (0 … state_pages − 1) and offset in it."""
        lo = self.layout
        H, K, V, W = lo.kda_shape
        L, rec, conv = lo.num_kda_layers, H * K * V, 3 * H * K * (W - 1)
        self.unit = math.gcd(lo.page_numel, rec, conv)
        self.units_per_page = lo.page_numel // self.unit
        flat = [  # offsets of the units in a slot's flat state: [L, U] recurrent, [L, U] conv
            torch.stack([torch.arange(i * rec, (i + 1) * rec, self.unit) for i in range(L)]),
            torch.stack(
                [torch.arange(L * rec + i * conv, L * rec + (i + 1) * conv, self.unit) for i in range(L)]
            ),
        ]
        dev = self.pages.device
        self._unit_page = [(f // lo.page_numel).to(dev) for f in flat]
        self._unit_offset = [(f % lo.page_numel // self.unit).to(dev) for f in flat]

    def state_index(self, slots: list[tuple[int, ...]]) -> torch.Tensor:
        """int64 unit rows of ``B`` slots, ordered ``[L, B, U]`` recurrent then ``[L, B, U]`` conv."""
        slot_BP = to_device(slots, self.pages.device).view(len(slots), -1)
        parts = []
        for pos_LU, off_LU in zip(self._unit_page, self._unit_offset):
            page_LBU = slot_BP[:, pos_LU].transpose(0, 1)
            parts.append((page_LBU * self.units_per_page + off_LU[:, None, :]).reshape(-1))
        return torch.cat(parts)

    def _batch_view(self, buffer: torch.Tensor, index: torch.Tensor, B: int) -> StateBatch:
        lo = self.layout
        H, K, V, W = lo.kda_shape
        n_rec = lo.num_kda_layers * B * H * K * V // self.unit
        rec = buffer[:n_rec].view(lo.num_kda_layers, B, H, K, V)
        conv = buffer[n_rec:].view(lo.num_kda_layers, B, 3, H * K, W - 1)
        return StateBatch(rec, conv, index)

    def gather_states(self, slots: list[tuple[int, ...]]) -> StateBatch:
        """Check the states of ``B`` slots out into the workspace (one ``index_select``) and return them.

        The batch is then the state of record for those slots: change it in place, and it reaches the pool
        at the next :meth:`flush_states` (which any other access to those pages triggers). Asking again for
        the same slots in the same order (a steady decode batch) reads nothing."""
        if self._resident is not None and self._resident.slots == slots:
            return self._resident.batch
        self.flush_states()
        index = self.state_index(slots)
        if self._workspace.shape[0] < index.numel():
            self._workspace = self.pages.new_empty(index.numel(), self.unit)
        buffer = self._workspace[: index.numel()]
        torch.index_select(self.pages.view(-1, self.unit), 0, index, out=buffer)
        batch = self._batch_view(buffer, index, len(slots))
        self._resident = _Resident(list(slots), {p for slot in slots for p in slot}, batch)
        return batch

    def flush_states(self) -> None:
        """Write the checked-out states back to their slots (one ``index_copy_``); the workspace is free."""
        if self._resident is not None:
            batch = self._resident.batch
            self.pages.view(-1, self.unit).index_copy_(0, batch.index, self._workspace[: batch.index.numel()])
            self._resident = None

    def _flush_if_touching(self, pages) -> None:
        if self._resident is not None and not self._resident.pages.isdisjoint(pages):
            self.flush_states()

    def release_states(self, slot: tuple[int, ...]) -> None:
        """A request gives its state slot back (before its pages return to the pool)."""
        self._flush_if_touching(slot)

    def write_states(self, slots: list[tuple[int, ...]], caches: list[KDACache]) -> None:
        """Store per-layer batched caches (one :class:`KDACache` per KDA layer after a model forward: conv
        ``[B, P, W−1]``, recurrent ``[B, H, K, V]``) through a buffer of their own, so the checked-out states
        stay in the workspace."""
        self._flush_if_touching({p for slot in slots for p in slot})
        index = self.state_index(slots)
        buffer = self.pages.new_empty(index.numel(), self.unit)
        self._batch_view(buffer, index, len(slots)).absorb(caches)
        self.pages.view(-1, self.unit).index_copy_(0, index, buffer)

    def copy_pages(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        """Copy-on-write of a KDA checkpoint into a request's own slot (or back)."""
        self._flush_if_touching(src + dst)
        dev = self.pages.device
        self.pages.index_copy_(0, to_device(dst, dev), self.pages.index_select(0, to_device(src, dev)))

    def copy_to_host(self, pages: tuple[int, ...], host: torch.Tensor, rows: tuple[int, ...]) -> None:
        """Copy device pages into rows of a host buffer ``[R, page_numel]`` (asynchronous on CUDA when
        ``host`` is pinned: ordered on the current stream before any later write of those pages)."""
        self._flush_if_touching(pages)
        for page, row in zip(pages, rows):
            host[row].copy_(self.pages[page], non_blocking=True)

    def copy_from_host(self, host: torch.Tensor, rows: tuple[int, ...], pages: tuple[int, ...]) -> None:
        """Copy rows of a host buffer into device pages (the inverse of :meth:`copy_to_host`)."""
        self._flush_if_touching(pages)
        for row, page in zip(rows, pages):
            self.pages[page].copy_(host[row], non_blocking=True)

    def zero_pages(self, pages: tuple[int, ...]) -> None:
        self._flush_if_touching(pages)
        self.pages.index_fill_(0, to_device(pages, self.pages.device), 0)
