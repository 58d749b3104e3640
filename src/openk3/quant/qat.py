"""Quantization-aware training of the routed experts: ``openk3 train --qat mxfp4``.

Every routed-expert GEMM of the forward reads MXFP4 fake-quantised weights (the master weights stay fp32 and
are what the optimizer updates) and MXFP8 fake-quantised inputs (the latent token ``z`` into ``w1``/``w3``,
the GLU output into ``w2``), with straight-through gradients (:func:`openk3.quant.mxfp4.mxfp4_ste`). Packing
the trained model (:func:`openk3.quant.experts.pack_experts` with ``ExpertScheme("mxfp8")``, ``openk3
quantize``) stores exactly the weights the forward used and records MXFP8 inputs in ``quantization_config``,
so the served model computes what was trained. Everything outside the routed experts trains as before.
"""

from __future__ import annotations

from torch import nn

from openk3.model.moe import RoutedExperts
from openk3.quant.mxfp4 import MX_BLOCK, _mx

QAT_SCHEMES = ("mxfp4",)
"""``--qat`` values: ``mxfp4`` = MXFP4 expert weights and MXFP8 expert inputs."""


def enable_qat(model: nn.Module, scheme: str = "mxfp4") -> int:
    """Turn on QAT numerics in every dense routed-experts module of ``model``; returns how many.

    Raises ``ValueError`` for a scheme other than :data:`QAT_SCHEMES`, a model without routed experts, or an
    expert input width or expert width that is not a multiple of 32 (an MX block)."""
    if scheme not in QAT_SCHEMES:
        raise ValueError(f"qat={scheme!r} is not supported: use one of {', '.join(QAT_SCHEMES)}")
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    if not experts:
        raise ValueError("qat: the model has no routed experts to quantise (a dense preset?)")
    F_, L = experts[0].w1.shape[1:]
    for what, n in (("the expert input width", L), ("moe_intermediate_size", F_)):
        if n % MX_BLOCK:
            raise ValueError(f"qat: {what} {n} is not a multiple of {MX_BLOCK} (an MX block)")
    _mx()  # import torchao now, not inside a compiled forward
    for m in experts:
        m.qat = True
    return len(experts)
