"""Decode-time KDA: the recurrence of ``docs/references.md#kda-recurrence``, vectorised over sequences and
heads, looping only over tokens.

Meant for a few new tokens per sequence (typically one) on top of a cached state; for long prompts use
:func:`~openk3.ops.kda.chunk.chunk_kda`. It shares :func:`~openk3.ops.kda.naive.kda_step` with the
reference, so the two cannot drift. Packed documents (``cu_seqlens``) are padded to the longest one with
identity tokens (see :mod:`openk3.ops.kda.layout`), so all of them advance together.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` sequences,
``L`` tokens of the longest sequence.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.inputs import check_kda_args, prepare_kda_inputs
from openk3.ops.kda.layout import ChunkLayout
from openk3.ops.kda.naive import recurrent_scan
from openk3.ops.kda.triton.dispatch import use_triton_recurrent


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the recurrence, for decoding (fla ``fused_recurrent_kda``, ``docs/references.md#kda-decode``).

    Arguments, shapes, dtypes and errors are those of :func:`~openk3.ops.kda.naive.naive_recurrent_kda`:
    q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; ``initial_state`` and the returned
    ``final_state`` ``[N, H, K, V]`` in the compute dtype (float32, or float64 for float64 inputs); ``o``
    ``[B, T, H, V]`` in ``v.dtype``. No gradient is needed at decode time, but the result is the same (and
    differentiable) with grad enabled. ``use_beta_sigmoid_in_kernel``: ``beta`` holds logits and the op uses
    ``σ(beta)`` in the compute dtype, as :func:`~openk3.ops.kda.chunk.chunk_kda` (default False).

    On CUDA tensors with Triton installed and no gradient needed, the Triton decode kernel
    (:mod:`openk3.ops.kda.triton.decode`, any gate, K and V in {16, 32, 64, 128}) runs instead, on a copy of
    ``initial_state``; a server updating a state pool in place calls
    :func:`~openk3.ops.kda.triton.decode.fused_recurrent_kda_decode` directly.

    Raises:
        ValueError: on bad shapes, ``cu_seqlens``, ``initial_state`` dtype or gate arguments.
    """
    if use_triton_recurrent(q, k, v, g, beta, initial_state=initial_state):
        seq_lens = check_kda_args(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound,
        )  # fmt: skip
        from openk3.ops.kda.triton.decode import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(
            q, k, v, g, beta, scale=q.shape[-1] ** -0.5 if scale is None else scale,
            initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=None if seq_lens is None else cu_seqlens.to(torch.int64),
            num_seqs=q.shape[0] if seq_lens is None else len(seq_lens),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        )  # fmt: skip
    x = prepare_kda_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    B, T = x.q.shape[:2]
    longest = T if x.seq_lens is None else max(x.seq_lens)
    layout = ChunkLayout(B, T, x.seq_lens, chunk_size=longest, device=x.q.device)
    seqs_NL = [_one_chunk_per_seq(layout, t) for t in (x.q, x.k, x.v, x.g, x.beta)]
    h0_NHKV = x.zero_state() if x.h0 is None else x.h0
    o_NLHV, final_NHKV = recurrent_scan(h0_NHKV, *seqs_NL)
    o_BTHV = layout.from_chunks(layout.from_grid(o_NLHV.unsqueeze(0)))
    return o_BTHV.to(x.out_dtype), (final_NHKV if output_final_state else None)


def _one_chunk_per_seq(layout: ChunkLayout, x_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T, *]`` → ``[N, L, *]``: each sequence padded to ``L`` with identity (zero) tokens."""
    x_PL = layout.to_chunks(x_BT)
    return layout.to_grid(x_PL, x_PL.new_zeros(())).squeeze(0)
