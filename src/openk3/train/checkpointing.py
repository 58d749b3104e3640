"""Activation checkpointing and ``torch.compile`` per decoder layer, applied to a built model from outside.

:func:`wrap_decoder_layers` replaces each decoder layer's stream method (``forward_attn_res`` for K3's Block
AttnRes, ``forward_residual`` for Kimi-Linear) on the instance, for calls that record a gradient without a
cache (training); evaluation, prefill and decoding keep the plain method. The layer's work becomes a pure
function of tensors (``partial`` and the completed AttnRes blocks, passed as a tuple; the model appends the block a
layer opens to its own list, :attr:`~openk3.model.decoder.KimiDecoderLayer.opens_block`), which is what checkpointing and compiling need.

Modes (:data:`openk3.train.memory.MODES`):

* ``none``: autograd keeps every activation.
* ``full``: ``torch.utils.checkpoint`` (non-reentrant) keeps the layer's inputs only; the backward reruns the
  layer's forward, one layer at a time.
* ``selective``: the same, with a policy (``create_selective_checkpoint_contexts``) that keeps the outputs of
  the matmuls (``mm``, ``addmm``, ``bmm``, grouped ``mm``), of attention and of the KDA kernel op
  (``openk3::kda_chunk_fwd``): the tensors that cost FLOPs to recompute and little memory to keep; norms,
  activations, the short convolutions, routing and elementwise work are recomputed.

The recomputation sees the same inputs and runs the same ops (routing included, so the MoE block records the
same router output for Quantile Balancing), hence the same loss and gradients (tested bit for bit on CPU).

``compile=True`` puts the (checkpointed) layer function under ``torch.compile``: one graph per layer kind;
the KDA kernels are a custom op inside it (:mod:`openk3.ops.kda.triton.train_op`), so there is no graph break.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from openk3.model.attn_res import attn_res_mix
from openk3.train.memory import MODES


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = (
        "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    import openk3.ops.kda.triton.train_op  # noqa: F401  (registers the op)

    ops.add(torch.ops.openk3.kda_chunk_fwd.default)
    return ops


def _policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of the ``selective`` mode (a fresh pair of contexts per call)."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops()))


def _backbone(model: torch.nn.Module):
    from openk3.model.modeling import KimiLinearModel

    return next(m for m in model.modules() if isinstance(m, KimiLinearModel))


def _layer_step(plain, attn_res: bool, mode: str, compile: bool):
    """The training step of a layer's stream method ``plain`` as a pure function ``(partial, *blocks,
    cu_seqlens) -> partial``."""

    def run(partial, *blocks, cu_seqlens=None):
        if attn_res:
            return plain(list(blocks), partial, None, cu_seqlens)
        return plain(partial, None, cu_seqlens)

    if mode == "none":
        step = run
    else:
        context = selective_context if mode == "selective" else None

        def step(partial, *blocks, cu_seqlens=None):
            kwargs = {"context_fn": context} if context is not None else {}
            return checkpoint(run, partial, *blocks, cu_seqlens=cu_seqlens, use_reentrant=False, **kwargs)

    return torch.compile(step, dynamic=False) if compile else step  # static shapes: one graph per layer


def wrap_decoder_layers(model: torch.nn.Module, checkpointing: str = "none", compile: bool = False) -> None:
    """Checkpoint (``checkpointing`` in :data:`~openk3.train.memory.MODES`) and/or compile every decoder layer
    of ``model`` in place (see the module docstring). Raises ``ValueError`` for another mode."""
    if checkpointing not in MODES:
        raise ValueError(f"activation_checkpointing={checkpointing!r}: use one of {', '.join(MODES)}")
    if checkpointing == "none" and not compile:
        return
    backbone = _backbone(model)
    attn_res = backbone.config.uses_attn_res
    if compile:  # layers differ in kind and AttnRes source count: one graph each
        limit = 8 * len(backbone.layers)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    for layer in backbone.layers:
        name = "forward_attn_res" if attn_res else "forward_residual"
        plain = getattr(layer, name)
        step = _layer_step(plain, attn_res, checkpointing, compile)
        setattr(layer, name, _dispatcher(attn_res, plain, step))


def _outside_the_region(x_BTD: torch.Tensor, cu_seqlens) -> None:
    """What the layer step needs built before it runs, outside the compiled region: the KDA op's cached
    chunk indexes of fixed-length rows (:func:`~openk3.ops.kda.triton.train_op.cache_fixed_length_indexes`;
    two cache lookups once built)."""
    if cu_seqlens is None:
        from openk3.ops.kda.triton.train_op import cache_fixed_length_indexes

        cache_fixed_length_indexes(x_BTD.shape[0], x_BTD.shape[1], x_BTD.device)


def _dispatcher(attn_res: bool, plain, step):
    if attn_res:

        def forward_attn_res(blocks, partial_BTD, cache=None, cu_seqlens=None, mix=attn_res_mix):
            if cache is not None or not torch.is_grad_enabled() or mix is not attn_res_mix:
                return plain(blocks, partial_BTD, cache, cu_seqlens, mix)
            _outside_the_region(partial_BTD, cu_seqlens)
            return step(partial_BTD, *blocks, cu_seqlens=cu_seqlens)  # the caller appends a block it opens

        return forward_attn_res

    def forward_residual(h_BTD, cache=None, cu_seqlens=None):
        if cache is not None or not torch.is_grad_enabled():
            return plain(h_BTD, cache, cu_seqlens)
        _outside_the_region(h_BTD, cu_seqlens)
        return step(h_BTD, cu_seqlens=cu_seqlens)

    return forward_residual
