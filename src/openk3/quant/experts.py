"""Routed experts kept in MXFP4 in memory, and the conversions between dense and packed models.

:class:`MXFP4RoutedExperts` holds, per weight ``w ∈ {w1, w3, w2}``, the checkpoint's bytes unchanged:
``w_packed`` uint8 ``[E, O, I/2]`` and ``w_scale`` uint8 ``[E, O, I/32]`` (``O, I`` = the weight's output and
input width; ``w1, w3``: ``[F, L]``, ``w2``: ``[L, F]``). Each forward dequantises the three weights to the
activations' dtype and runs the same grouped GEMMs as the dense experts
(:func:`openk3.model.moe.combine_experts`); with ``activations="mxfp8"`` the GEMM inputs are MXFP8
fake-quantised, as ``--qat mxfp4`` trains them. Resident memory is 4.25 bits per expert weight; the transient
dense copy is one layer's experts at a time.

* :func:`use_packed_experts` swaps every MoE block's experts for empty packed ones (before a checkpoint load);
* :func:`pack_experts` quantises a dense model's experts in place (export after training);
* :func:`unpack_experts` dequantises them back to trainable parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.moe import RoutedExperts, SparseMoeBlock, combine_experts
from openk3.quant.mxfp4 import (
    MX_BLOCK,
    dequantize_mxfp4,
    mxfp8_ste,
    quantize_mxfp4,
)
from openk3.quant.scheme import ExpertScheme, set_quantization_config

WEIGHTS = ("w1", "w3", "w2")


class MXFP4RoutedExperts(nn.Module):
    """``E`` experts with MXFP4 weights; same forward contract as :class:`~openk3.model.moe.RoutedExperts`.

    Raises ``ValueError`` when the expert input width ``L`` or the expert width ``F`` is not a multiple of 32
    (an MX block)."""

    def __init__(self, config, input_size: int, activations: str | None = None) -> None:
        super().__init__()
        E, F_, L = config.num_experts, config.moe_intermediate_size, input_size
        for what, n in (("the expert input width", L), ("moe_intermediate_size", F_)):
            if n % MX_BLOCK:
                raise ValueError(f"{what} {n} is not a multiple of {MX_BLOCK}: MXFP4 experts need one")
        self.config = config
        self.scheme = ExpertScheme(activations=activations)
        for name, (O, I) in zip(WEIGHTS, ((F_, L), (F_, L), (L, F_))):
            self.register_buffer(f"{name}_packed", torch.empty(E, O, I // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.empty(E, O, I // MX_BLOCK, dtype=torch.uint8))

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scale)`` of weight ``name`` (``w1``, ``w3`` or ``w2``)."""
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1 [E, F, L], w3 [E, F, L], w2 [E, L, F])`` dequantised to ``dtype`` (exact in fp32/bf16)."""
        return tuple(dequantize_mxfp4(*self.packed(n), dtype) for n in WEIGHTS)

    def forward(self, z_NL: torch.Tensor, weights_Nk: torch.Tensor, indices_Nk: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]``, in ``z_NL.dtype``."""
        x_quant = mxfp8_ste if self.scheme.activations == "mxfp8" else None
        w1, w3, w2 = self.dequantized(z_NL.dtype)
        return combine_experts(self.config, z_NL, weights_Nk, indices_Nk, w1, w3, w2, x_quant)


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
