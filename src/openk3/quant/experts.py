"""Routed experts kept in MXFP4 in memory, and the conversions between dense and packed models.

:class:`MXFP4RoutedExperts` holds, per weight ``w ∈ {w1, w3, w2}``, the checkpoint's bytes unchanged:
``w_packed`` uint8 ``[E, O, I/2]`` and ``w_scale`` uint8 ``[E, O, I/32]`` (``O, I`` = the weight's output and
input width; ``w1, w3``: ``[F, L]``, ``w2``: ``[L, F]``). Each forward dequantises, in chunks of experts, only
the experts that received tokens, straight to the activations' dtype, and runs on each chunk's rows the same
grouped GEMMs as the dense experts (:func:`openk3.model.moe.grouped_expert_ffn`); with
``activations="mxfp8"`` the GEMM inputs are MXFP8 fake-quantised, as ``--qat mxfp4`` trains them. Resident
memory is 4.25 bits per expert weight; the transient dense copy is at most ``chunk_bytes`` of weights.

* :func:`use_packed_experts` swaps every MoE block's experts for empty packed ones (before a checkpoint load);
* :func:`pack_experts` quantises a dense model's experts in place (export after training);
* :func:`unpack_experts` dequantises them back to trainable parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.moe import RoutedExperts, SparseMoeBlock, combine_sorted, grouped_expert_ffn
from openk3.quant.mxfp4 import (
    MX_BLOCK,
    dequantize_mxfp4,
    mxfp8_ste,
    quantize_mxfp4,
)
from openk3.quant.scheme import ExpertScheme, set_quantization_config

WEIGHTS = ("w1", "w3", "w2")
DEQUANT_CHUNK_BYTES = 1 << 30
"""Default bound on the dense expert weights one forward holds at a time (1 GiB: 16 experts of kimi-k3 in
bf16)."""


class MXFP4RoutedExperts(nn.Module):
    """``E`` experts with MXFP4 weights; same forward contract as :class:`~openk3.model.moe.RoutedExperts`.

    The forward sorts the ``M = N·k`` token-slots by expert as the dense experts do, lists the experts that
    received rows in increasing id (padded to ``U = min(E, M)`` with experts that received none) and walks
    the list in chunks of ``C`` experts, the most whose three dense weights fit in ``chunk_bytes`` (at least
    1). Per chunk it dequantises those experts to the activations' dtype, gathers a window of ``M`` rows
    starting at the chunk's first row (static shapes, no host sync, so a CUDA graph can capture it), runs
    :func:`~openk3.model.moe.grouped_expert_ffn` with the chunk's group offsets (rows past the chunk's last
    group are not computed) and copies the chunk's rows into place. One chunk (``U ≤ C``, e.g. a decode
    step) needs no window. Each row meets the same weights in a group of the same size as in the dense
    forward, so outputs equal the dense experts' on the dequantised weights bit for bit (on CUDA as long as
    the grouped GEMM's order of summation over ``K`` does not depend on its tile choice, which depends on
    the number of groups; ``tests/test_mxfp4.py`` checks it there). Transient memory: ``C`` experts' dense
    weights plus a few ``[M, L]`` / ``[M, F]`` activations, whatever ``E``.

    Raises ``ValueError`` when the expert input width ``L`` or the expert width ``F`` is not a multiple of 32
    (an MX block), or ``chunk_bytes`` is not positive."""

    def __init__(
        self, config, input_size: int, activations: str | None = None, chunk_bytes: int = DEQUANT_CHUNK_BYTES
    ) -> None:
        super().__init__()
        E, F_, L = config.num_experts, config.moe_intermediate_size, input_size
        for what, n in (("the expert input width", L), ("moe_intermediate_size", F_)):
            if n % MX_BLOCK:
                raise ValueError(f"{what} {n} is not a multiple of {MX_BLOCK}: MXFP4 experts need one")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.config = config
        self.scheme = ExpertScheme(activations=activations)
        self.chunk_bytes = chunk_bytes
        for name, (O, I) in zip(WEIGHTS, ((F_, L), (F_, L), (L, F_))):
            self.register_buffer(f"{name}_packed", torch.empty(E, O, I // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.empty(E, O, I // MX_BLOCK, dtype=torch.uint8))

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scale)`` of weight ``name`` (``w1``, ``w3`` or ``w2``)."""
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")

    def dequantized(
        self, dtype: torch.dtype, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1 [e, F, L], w3 [e, F, L], w2 [e, L, F])`` dequantised to ``dtype`` (exact in fp32/bf16), of the
        experts ``experts`` (int64 ``[e]``) or of all ``E``."""
        out = []
        for name in WEIGHTS:
            packed, scale = self.packed(name)
            if experts is not None:
                packed, scale = packed.index_select(0, experts), scale.index_select(0, experts)
            out.append(dequantize_mxfp4(packed, scale, dtype))
        return tuple(out)

    def forward(self, z_NL: torch.Tensor, weights_Nk: torch.Tensor, indices_Nk: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]``, in ``z_NL.dtype``."""
        E = self.w1_packed.shape[0]
        return combine_sorted(z_NL, weights_Nk, indices_Nk, E, self._expert_ffn)

    def _expert_ffn(self, x_ML: torch.Tensor, offs_E: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """The experts on rows sorted by expert (``offs_E`` int32 cumulative counts), chunk by chunk;
        ``expert_M`` (the dense path's gather index) is not needed: each chunk derives its own."""
        M, L = x_ML.shape
        E = offs_E.shape[0]
        U = min(E, M)
        expert_bytes = sum(
            p.shape[1] * p.shape[2] * 2 for p in (self.w1_packed, self.w3_packed, self.w2_packed)
        )
        C = max(1, min(U, self.chunk_bytes // (expert_bytes * x_ML.element_size())))
        counts_E = torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1, dtype=torch.int64))
        used_U = torch.argsort((counts_E == 0).to(torch.int32), stable=True)[:U]  # experts with rows first
        offs_U = torch.cumsum(counts_E[used_U], 0)
        rows_M = torch.arange(M, device=x_ML.device)
        if C == U:
            return self._chunk_ffn(x_ML, used_U, offs_U, rows_M)
        y_ML = x_ML.new_empty(M + 1, L)  # row M takes the window rows past the chunk
        for c0 in range(0, U, C):
            start = offs_U[c0 - 1] if c0 else offs_U.new_zeros(())
            offs_C = offs_U[c0 : c0 + C] - start
            x_WL = x_ML[(start + rows_M).clamp_(max=M - 1)]
            y_WL = self._chunk_ffn(x_WL, used_U[c0 : c0 + C], offs_C, rows_M)
            y_ML.index_copy_(0, torch.where(rows_M < offs_C[-1], start + rows_M, M), y_WL)
        return y_ML[:M]

    def _chunk_ffn(self, x_WL, experts_C, offs_C, rows_W) -> torch.Tensor:
        """Experts ``experts_C`` dequantised, on rows ``x_WL`` whose first ``offs_C[-1]`` are theirs."""
        x_quant = mxfp8_ste if self.scheme.activations == "mxfp8" else None
        w1, w3, w2 = self.dequantized(x_WL.dtype, experts_C)
        expert_W = torch.searchsorted(offs_C, rows_W, right=True).clamp_(max=experts_C.shape[0] - 1)
        return grouped_expert_ffn(self.config, x_WL, w1, w3, w2, offs_C.to(torch.int32), expert_W, x_quant)


def _blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def use_packed_experts(model: nn.Module, scheme: ExpertScheme) -> nn.Module:
    """Replace every MoE block's experts by empty :class:`MXFP4RoutedExperts` on the same device (build the
    model on the meta device first so the dense experts are never allocated). Returns ``model``."""
    for block in _blocks(model):
        old = block.experts
        device = old.w1.device
        with torch.device(device):
            block.experts = MXFP4RoutedExperts(old.config, old.w1.shape[2], scheme.activations)
    return model


def pack_experts(model: nn.Module, scheme: ExpertScheme) -> nn.Module:
    """Quantise every dense MoE block's experts to MXFP4 in place (OCP rule, :func:`quantize_mxfp4`) and
    record ``scheme`` as the model config's ``quantization_config``, so :func:`openk3.save_pretrained` writes
    the compressed-tensors layout. A model trained with ``--qat mxfp4`` then computes, packed, exactly what
    its QAT forward computed. Returns ``model``."""
    for block in _blocks(model):
        old = block.experts
        if not isinstance(old, RoutedExperts):
            raise ValueError(f"{type(old).__name__} experts cannot be packed (already packed?)")
        with torch.device(old.w1.device):
            new = MXFP4RoutedExperts(old.config, old.w1.shape[2], scheme.activations)
        for name in WEIGHTS:
            packed, scale = quantize_mxfp4(getattr(old, name))
            new.packed(name)[0].copy_(packed)
            new.packed(name)[1].copy_(scale)
        block.experts = new
    set_quantization_config(model.config, scheme)
    return model


def unpack_experts(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Dequantise every packed MoE block's experts to trainable :class:`RoutedExperts` in ``dtype`` and drop
    the config's ``quantization_config`` (fine-tuning or QAT from a packed checkpoint). Returns ``model``."""
    for block in _blocks(model):
        old = block.experts
        if not isinstance(old, MXFP4RoutedExperts):
            continue
        with torch.device(old.w1_packed.device):
            new = RoutedExperts(old.config, old.w1_packed.shape[2] * 2).to(dtype)
        with torch.no_grad():
            for name, w in zip(WEIGHTS, old.dequantized(dtype)):
                getattr(new, name).copy_(w)
        block.experts = new
    set_quantization_config(model.config, None)
    return model
