"""Next-token cross-entropy fused with the LM head, by chunks of tokens: no ``[N, V]`` fp32 logits for the batch.

The plain loss ``F.cross_entropy(lm_head(h).float(), y)`` holds the batch's logits in fp32 plus their softmax
and its gradient: ``N·V·12`` bytes (k3-1b, 16 × 2048 tokens, V = 32,768: 12.9 GB). :class:`ChunkedLMHeadLoss`
computes, for each chunk of ``C`` tokens::

    z_CV = (h_CD @ W_VDᵀ) in the compute dtype, then fp32          # the logits of the chunk only
    loss += Σ_c logsumexp(z_c) − z_c[y_c]
    dz_CV = softmax(z_CV) − onehot(y_C)                             # fp32
    dh_CD = dz_CV.to(compute) @ W_VD;   dW_VD += dz_CVᵀ.to(compute) @ h_CD   (accumulated in fp32)

(fp64 throughout for fp64) in the forward, and keeps only ``dh`` ``[N, D]`` and ``dW`` ``[V, D]`` for the backward, which scales them by
the incoming gradient ``/ N`` (the loss is the mean). Peak extra memory: one chunk's ``C·V·12`` bytes.

The compute dtype is what autocast would use for the head's matmul (bf16 under CUDA autocast); the logits are
rounded to it before the fp32 softmax, as the plain path's ``lm_head(h).float()`` does, so the loss is the
same number up to the summation order. ``dW`` sums the chunks in fp32, where the plain path rounds the
whole batch's bf16 product once.

Legend: ``N`` tokens, ``D`` width, ``V`` vocabulary, ``C`` tokens per chunk.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 8192
"""Tokens per chunk: 8192 × 32,768 × 12 bytes = 3.2 GB of chunk logits at most (fp32 logits, softmax, grad)."""


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of ``h_ND @ W_VDᵀ`` against ``y_N``; see the module docstring."""

    @staticmethod
    def forward(ctx, h_ND, W_VD, y_N, compute_dtype, chunk_tokens):
        N = h_ND.shape[0]
        needs = ctx.needs_input_grad
        W_c = W_VD.to(compute_dtype)
        acc = torch.promote_types(compute_dtype, torch.float32)  # fp32, fp64 for fp64
        total = torch.zeros((), dtype=acc, device=h_ND.device)
        dh_ND = torch.empty_like(h_ND) if needs[0] else None
        dW_VD = torch.zeros(W_VD.shape, dtype=acc, device=W_VD.device) if needs[1] else None
        with torch.autocast(h_ND.device.type, enabled=False):
            for start in range(0, N, chunk_tokens):
                h_CD = h_ND[start : start + chunk_tokens].to(compute_dtype)
                y_C = y_N[start : start + chunk_tokens]
                z_CV = (h_CD @ W_c.t()).to(acc)
                lse_C = torch.logsumexp(z_CV, dim=-1)
                total += (lse_C - z_CV.gather(1, y_C[:, None]).squeeze(1)).sum()
                if dh_ND is None and dW_VD is None:
                    continue
                dz_CV = torch.exp(z_CV.sub_(lse_C[:, None]))  # softmax, in place of the logits
                dz_CV[torch.arange(y_C.shape[0], device=y_C.device), y_C] -= 1.0
                dz_CV = dz_CV.to(compute_dtype)
                if dh_ND is not None:
                    dh_ND[start : start + chunk_tokens] = (dz_CV @ W_c).to(h_ND.dtype)
                if dW_VD is not None:
                    dW_VD += (dz_CV.t() @ h_CD).to(acc)
        ctx.save_for_backward(dh_ND, dW_VD)
        ctx.N, ctx.W_dtype = N, W_VD.dtype
        return total / N

    @staticmethod
    def backward(ctx, grad_loss):
        dh_ND, dW_VD = ctx.saved_tensors
        scale = grad_loss / ctx.N
        dh = None if dh_ND is None else dh_ND * scale.to(dh_ND.dtype)
        dW = None if dW_VD is None else (dW_VD * scale).to(ctx.W_dtype)
        return dh, dW, None, None, None


def lm_head_loss(
    h_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    y_BT: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 scalar; fp64 for fp64 ``compute_dtype``) of the head ``weight_VD`` on hidden states ``h_BTD``.

    Args:
        h_BTD: final hidden states ``[B, T, D]`` (after the final norm), any float dtype.
        weight_VD: the LM head weight ``[V, D]``.
        y_BT: int64 targets in ``[0, V)``.
        compute_dtype: dtype of the head's matmul; ``None``: autocast's dtype when autocast is on for
            ``h_BTD``'s device, else ``h_BTD``'s dtype.
        chunk_tokens: tokens per chunk (>= 1).

    Raises ``ValueError`` for mismatched shapes or ``chunk_tokens < 1``.
    """
    if h_BTD.shape[:-1] != y_BT.shape or h_BTD.shape[-1] != weight_VD.shape[1]:
        raise ValueError(
            f"lm_head_loss: hidden states {tuple(h_BTD.shape)}, head {tuple(weight_VD.shape)} and targets "
            f"{tuple(y_BT.shape)} do not fit ([B, T, D], [V, D], [B, T])"
        )
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"lm_head_loss: chunk_tokens={chunk_tokens!r} must be an int >= 1")
    if compute_dtype is None:
        kind = h_BTD.device.type
        on = torch.is_autocast_enabled(kind) if kind in ("cpu", "cuda") else False
        compute_dtype = torch.get_autocast_dtype(kind) if on else h_BTD.dtype
    return ChunkedLMHeadLoss.apply(
        h_BTD.flatten(0, 1), weight_VD, y_BT.flatten(), compute_dtype, chunk_tokens
    )
