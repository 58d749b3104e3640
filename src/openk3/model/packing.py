"""Packed projections for inference: the linears of a layer that read one input, run as one GEMM.

A decode step of a small batch is bound by kernel launches, not by bytes: each ``nn.Linear`` is a GEMM (a
GEMV at one token) of a few microseconds however small its weight. A KDA layer reads its normed input six
times (``q``, ``k``, ``v``, ``f_a``, ``b``, ``g_a``), an MLA layer three times, a MoE block three (the latent
down projection and the shared experts' gate and up). :func:`pack_linears` re-homes such weights as row
views of one ``[ΣO, I]`` matrix, so the layer can run ``F.linear(x, packed)`` once and split the result::

    [y_1 | … | y_n] = x · [W_1; …; W_n]ᵀ           # one GEMM, the same bytes read as n GEMMs read

The parameters stay the same ``nn.Parameter`` objects with their names (only their ``.data`` now views the
pack), so ``state_dict``, checkpoint names, an optimizer built before and in-place writes (``load_state_dict``,
a weight sync, an optimizer step) all keep working and reach the pack; no weight is stored twice. Moving, casting, replacing or deep-copying a parameter breaks the tie
(:meth:`PackedProjection.tied`): eager forwards then run the separate linears, and :func:`pack_for_inference`
packs again.

Only forwards without gradient read the packed matrix (autograd would send the gradient to it, not to the
parameters); training runs the separate linears. The server packs its model once
(:class:`~openk3.serve.model_runner.ModelRunner`).

At one row (a one-stream decode step) even one GEMV per projection is more than the step needs: a library
GEMV cannot fuse with the RMSNorm before it or the activation after it, and it costs a launch of its own.
:func:`project` therefore writes a projection of a row traced by ``torch.compile`` without gradient as an fp32
product and sum (fp64 for fp64), ``y_o = Σ_i x_i · W_oi``, a reduction Inductor generates and fuses with its neighbours (one
kernel where there were two or three; ``docs/LOG.md`` has the measurements). It rounds once, from fp32, as the
GEMM's fp32 accumulator does, so it agrees with ``F.linear`` to the output dtype's rounding.

Legend: ``I`` input width, ``O`` output width of one linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PackedProjection:
    """``weight [ΣO, I]``, whose row blocks (``sizes``, in order) are the weights of ``linears``; ``ptrs`` the
    addresses those weights had when packed (:meth:`of`)."""

    weight: torch.Tensor
    sizes: tuple[int, ...]
    linears: tuple[nn.Linear, ...]
    ptrs: tuple[int, ...]

    @classmethod
    def of(cls, weight: torch.Tensor, linears: tuple[nn.Linear, ...]) -> PackedProjection:
        """The pack of ``linears`` whose weights are, in order, the row blocks of ``weight``."""
        return cls(weight, tuple(lin.weight.shape[0] for lin in linears), linears,
                   tuple(lin.weight.data_ptr() for lin in linears))  # fmt: skip

    def __call__(self, x_SI: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of the linears, ``[*, O_j]`` each, views of one GEMM's output (:func:`project`)."""
        return project(x_SI, self.weight).split(self.sizes, -1)

    def tied(self) -> bool:
        """Whether every linear's weight still is the view of :attr:`weight` it was given: a parameter moved
        or cast (``Module.to``, ``.float()``), replaced or deep-copied has other memory. (The pack holds its
        memory, so no other tensor can take those addresses.)"""
        return all(lin.weight.data_ptr() == p for lin, p in zip(self.linears, self.ptrs))


FEW_ROWS = 1
"""Most rows :func:`project` runs as a reduction: at one row it halved a chain of norm + two projections on an
H200; at four it no longer gained (``benchmarks/decode_gemv.py``)."""


def few_rows(x_SI: torch.Tensor) -> bool:
    """Whether a forward's input of rows ``x_SI [*, I]`` is a decode step's few rows (at most
    :data:`FEW_ROWS`), traced by ``torch.compile`` without gradient: the case :func:`project` runs as a
    reduction."""
    return (
        x_SI.numel() <= FEW_ROWS * x_SI.shape[-1]
        and not torch.is_grad_enabled()
        and torch.compiler.is_compiling()
    )


def project(x_SI: torch.Tensor, weight: torch.Tensor | nn.Linear) -> torch.Tensor:
    """``x · Wᵀ`` ``[*, O]`` in ``x``'s dtype for ``x_SI [*, I]`` and ``weight [O, I]`` (or a bias-free
    ``nn.Linear``, then called as a module outside the few-row case): a product and sum in fp32 (fp64 for
    fp64) for :func:`few_rows`, else ``F.linear``."""
    w_OI = weight.weight if isinstance(weight, nn.Linear) else weight
    if few_rows(x_SI):
        acc = torch.promote_types(x_SI.dtype, torch.float32)
        return (x_SI.to(acc).unsqueeze(-2) * w_OI.to(acc)).sum(-1).to(x_SI.dtype)
    return weight(x_SI) if isinstance(weight, nn.Linear) else F.linear(x_SI, w_OI)


def pack_linears(linears: list[nn.Linear] | tuple[nn.Linear, ...]) -> PackedProjection:
    """Copy the weights of ``linears`` (no bias, one input width, one dtype and device) into one matrix and
    point each weight (the same ``nn.Parameter``, so an optimizer holding it still updates the model, and the
    pack) at its rows. Raises ``ValueError`` otherwise."""
    linears = tuple(linears)
    w0 = linears[0].weight
    for lin in linears:
        if lin.bias is not None:
            raise ValueError("pack_linears: a linear with a bias cannot be packed")
        w = lin.weight
        if w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or w.device != w0.device:
            raise ValueError("pack_linears: the linears must share input width, dtype and device")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    offset = 0
    for lin in linears:  # the same Parameter objects, now over the pack's rows: an optimizer keeps them
        n = lin.weight.shape[0]
        lin.weight.data = weight[offset : offset + n]
        offset += n
    return PackedProjection.of(weight, linears)


def packed_or_none(packed: PackedProjection | None) -> PackedProjection | None:
    """``packed`` when a forward may read it, else ``None`` (run the separate linears): not with gradient, and
    not once the tie broke (checked eagerly; a compiled step trusts the pack its engine made, as its CUDA
    graphs trust the parameters' addresses)."""
    if packed is None or torch.is_grad_enabled():
        return None
    return packed if torch.compiler.is_compiling() or packed.tied() else None


def pack_for_inference(model: nn.Module) -> nn.Module:
    """Pack the projections of every layer of ``model`` that can (a ``pack_projections`` method), again where
    a tie broke; returns ``model``. Idempotent: tied packs are kept."""
    for module in model.modules():
        pack = getattr(module, "pack_projections", None)
        if pack is not None:
            packed = module.packed
            if packed is None or not packed.tied():
                pack()
    return model
