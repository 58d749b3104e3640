"""The Triton chunked KDA for training as two torch custom ops, so ``torch.compile`` traces through it.

``torch.compile`` cannot trace a Triton launch inside an ``autograd.Function`` whose arguments include Python
objects (the chunk index), so the decoder layers broke their graphs at every KDA call. Here the training case
(fixed-length rows, no initial or final state, the K3 gate and β's sigmoid in the kernels, the in-kernel L2
norm, the default options and launch geometry) is two ops with tensor-only
signatures and fake (meta) implementations:

* ``openk3::kda_chunk_fwd(q, k, v, g, β, A_log, dt_bias, scale, lower_bound) -> (o, Aqk, Akk, q_rstd,
  k_rstd)``: :class:`~openk3.ops.kda.triton.chunk_function.ChunkKDAFunction`'s forward (on 16-token tiles);
  the four extra outputs are what it saves for the backward.
* ``openk3::kda_chunk_bwd(q, k, v, g, β, A_log, dt_bias, Aqk, Akk, q_rstd, k_rstd, do, scale, lower_bound)
  -> (dq, dk, dv, dg, dβ, dA_log, ddt_bias)``: its backward.

The forward op's registered autograd calls the backward op, so both are single nodes in a compiled graph, and
selective activation checkpointing can keep the forward op's outputs (:mod:`openk3.train.checkpointing`).
Same kernels, same bits as :func:`~openk3.ops.kda.chunk.chunk_kda` on that path.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K``/``V`` key/value dims, ``TT = B·T``.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.triton.chunk_index import CHUNK, fixed_length_index
from openk3.ops.kda.triton.dispatch import use_triton_chunk

Tensor = torch.Tensor


class _Context:
    """Stands in for an autograd context: receives ``save_for_backward`` and carries what backward reads."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _opts(scale: float, lower_bound: float) -> dict:
    return dict(scale=scale, lower_bound=lower_bound, use_l2norm=True, beta_sigmoid=True)


@torch.library.custom_op("openk3::kda_chunk_fwd", mutates_args=())
def kda_chunk_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    scale: float, lower_bound: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from openk3.ops.kda.triton.chunk_function import ChunkKDAFunction
    from openk3.ops.kda.triton.tile_forward import TILE

    B, T, H, _ = q.shape
    flat = [t.reshape(B * T, H, -1).contiguous() for t in (q, k, v, g)]
    ctx = _Context()
    o, _ = ChunkKDAFunction.forward(
        ctx, *flat, beta.reshape(B * T, H).contiguous(), A_log.contiguous(), dt_bias.contiguous(), None,
        fixed_length_index(B, T, q.device, CHUNK), fixed_length_index(B, T, q.device, TILE),
        scale, lower_bound, True, False, True,
    )  # fmt: skip
    kept = ctx.saved_tensors[8:]
    return (o.view(B, T, H, -1), *(t if t._base is None else t.clone() for t in kept))


@kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound):
    from openk3.ops.kda.triton.chunk_prepare import fp16_inverse

    B, T, H, _ = q.shape
    TT = B * T
    return (
        v.new_empty(v.shape),
        q.new_empty(TT, H, CHUNK),
        q.new_empty(TT, H, CHUNK, dtype=torch.float16 if fp16_inverse(q.dtype, True) else torch.float32),
        q.new_empty(TT, H, dtype=torch.float32),
        q.new_empty(TT, H, dtype=torch.float32),
    )


@torch.library.custom_op("openk3::kda_chunk_bwd", mutates_args=())
def kda_chunk_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor, Aqk: Tensor,
    Akk: Tensor, q_rstd: Tensor, k_rstd: Tensor, do: Tensor, scale: float, lower_bound: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from openk3.ops.kda.triton.chunk_function import ChunkKDAFunction
    from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY

    B, T, H, _ = q.shape
    flat = [t.reshape(B * T, H, -1).contiguous() for t in (q, k, v, g)]
    ctx = _Context()
    ctx.saved_tensors = (
        *flat, beta.reshape(B * T, H).contiguous(), A_log.contiguous(), dt_bias.contiguous(), None,
        Aqk, Akk, q_rstd, k_rstd,
    )  # fmt: skip
    ctx.index, ctx.opts, ctx.launch = (
        fixed_length_index(B, T, q.device, CHUNK),
        _opts(scale, lower_bound),
        DEFAULT_GEOMETRY,
    )
    dq, dk, dv, dg, dbeta, dA_log, ddt = ChunkKDAFunction.backward(
        ctx, do.reshape(B * T, H, -1).contiguous(), None
    )[:7]
    like = (q, k, v, g, beta, A_log, dt_bias)
    return tuple(d.reshape(x.shape).to(x.dtype) for d, x in zip((dq, dk, dv, dg, dbeta, dA_log, ddt), like))


@kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, Aqk, Akk, q_rstd, k_rstd, do, scale, lower_bound):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta, A_log, dt_bias))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, A_log, dt_bias, scale, lower_bound = inputs
    _, Aqk, Akk, q_rstd, k_rstd = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, Aqk, Akk, q_rstd, k_rstd)
    ctx.scale, ctx.lower_bound = scale, lower_bound


def _backward(ctx, do, *unused):
    grads = kda_chunk_bwd(*ctx.saved_tensors, do.contiguous(), ctx.scale, ctx.lower_bound)
    return (*grads, None, None)


kda_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


def cache_fixed_length_indexes(B: int, T: int, device: torch.device) -> None:
    """Build (or find) the chunk and tile indexes of ``B`` rows of ``T`` tokens in
    :func:`~openk3.ops.kda.triton.chunk_index.fixed_length_index`'s cache, for a caller outside a compiled
    region to run before it; the ops inside then find them there. Built inside instead, under Inductor's CUDA
    graphs (``mode="reduce-overhead"``), the first build would run in a warm-up whose allocations go to the
    graphs' private memory pool, and the six cached tensors (three per index) would outlive the warm-up
    untracked: Inductor then refuses to record ("tensor(s) in the cudagraph pool not tracked as outputs")."""
    from openk3.ops.kda.triton.chunk_index import fixed_length_index
    from openk3.ops.kda.triton.tile_forward import TILE

    fixed_length_index(B, T, device, CHUNK)
    fixed_length_index(B, T, device, TILE)


def use_train_op(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, cache, cu_seqlens) -> bool:
    """Whether a KDA layer call takes :func:`chunk_kda_train`: the Triton chunked path applies
    (:func:`~openk3.ops.kda.triton.dispatch.use_triton_chunk`), a gradient is needed, rows of equal length, no
    cache, ``dt_bias`` given, K ≥ 32."""
    from openk3.ops.kda.triton.dispatch import needs_grad

    if cache is not None or cu_seqlens is not None or dt_bias is None:
        return False
    return use_triton_chunk(
        q, k, v, g, beta, A_log=A_log, lower_bound=lower_bound, chunk_size=64, dt_bias=dt_bias
    ) and needs_grad(q, k, v, g, beta, A_log, dt_bias)


def chunk_kda_train(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, A_log: Tensor, dt_bias: Tensor,
    lower_bound: float, scale: float | None = None,
) -> Tensor:  # fmt: skip
    """``o`` ``[B, T, H, V]`` (``v.dtype``) of :func:`~openk3.ops.kda.chunk.chunk_kda` with
    ``use_qk_l2norm_in_kernel=True``, ``use_beta_sigmoid_in_kernel=True`` (``beta`` holds logits), the K3 gate
    (``A_log`` ``[H]``, ``dt_bias`` ``[H·K]``, ``lower_bound``), no initial or final state; differentiable
    through the custom ops above. q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``."""
    H = q.shape[2]
    return kda_chunk_fwd(
        q, k, v, g, beta, A_log[:H], dt_bias, q.shape[-1] ** -0.5 if scale is None else scale, lower_bound
    )[0]
