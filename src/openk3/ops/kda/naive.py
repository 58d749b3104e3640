"""Reference KDA: the token-by-token recurrence, in float64 when the inputs are float64.

Per head, with state ``S ∈ R^{K×V}`` (``docs/references.md#kda-recurrence``; Kimi Linear, arXiv 2510.26692)::

    S ← Diag(exp(g_t)) S                       # decay first, per key channel
    S ← S + (β_t k_t) ⊗ (v_t − Sᵀ k_t)         # delta rule on the decayed state
    o_t = Sᵀ (scale · q_t)                     # read after the update

This is the oracle of the tests: every op of this folder is checked against it, gradient by gradient
(autograd differentiates the loop). Unlike fla's ``naive_recurrent_kda`` it does not force float32, and it
supports ``cu_seqlens``, the in-op l2norm and the in-op gates.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` sequences.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.inputs import KDAInputs, prepare_kda_inputs


def kda_step(
    S_NHKV: torch.Tensor,
    q_NHK: torch.Tensor,
    k_NHK: torch.Tensor,
    v_NHV: torch.Tensor,
    g_NHK: torch.Tensor,
    beta_NH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the KDA recurrence for ``N`` sequences at once; out of place, differentiable.

    Args:
        S_NHKV: state before the token.
        q_NHK: query, already multiplied by ``scale``. k_NHK: key. v_NHV: value.
        g_NHK: log-decay (natural log, ≤ 0). beta_NH: delta-rule strength (post-sigmoid).

    Returns:
        ``(S_NHKV, o_NHV)``: the state after the token and the token's output, in the inputs' dtype.
    """
    S_NHKV = S_NHKV * g_NHK.exp().unsqueeze(-1)
    kS_NHV = (k_NHK.unsqueeze(-2) @ S_NHKV).squeeze(-2)
    delta_NHV = beta_NH.unsqueeze(-1) * (v_NHV - kS_NHV)
    S_NHKV = S_NHKV + k_NHK.unsqueeze(-1) * delta_NHV.unsqueeze(-2)
    o_NHV = (q_NHK.unsqueeze(-2) @ S_NHKV).squeeze(-2)
    return S_NHKV, o_NHV


def recurrent_scan(
    S_NHKV: torch.Tensor,
    q_NTHK: torch.Tensor,
    k_NTHK: torch.Tensor,
    v_NTHV: torch.Tensor,
    g_NTHK: torch.Tensor,
    beta_NTH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`kda_step` over ``T`` tokens; returns ``(o_NTHV, S_NHKV)`` (final state)."""
    o_list = []
    for t in range(q_NTHK.shape[1]):
        token = (q_NTHK[:, t], k_NTHK[:, t], v_NTHV[:, t], g_NTHK[:, t], beta_NTH[:, t])
        S_NHKV, o_NHV = kda_step(S_NHKV, *token)
        o_list.append(o_NHV)
    return torch.stack(o_list, dim=1), S_NHKV


def naive_recurrent_kda(
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
    """KDA by the per-token recurrence: the exact, slow reference; differentiable by autograd.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-decay (natural log, ≤ 0); with ``A_log`` given, the raw gate pre-activation
            that :func:`~openk3.ops.kda.gate.kda_gate` turns into the log-decay inside the op.
        beta: ``[B, T, H]`` post-sigmoid delta-rule strength (logits with ``use_beta_sigmoid_in_kernel``).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (K first) in the compute dtype, or None for zeros; ``N = B``, or the
            number of documents with ``cu_seqlens``.
        output_final_state: also return the ``[N, H, K, V]`` state after the last token.
        cu_seqlens: int64 ``[N+1]`` document offsets of a packed row (B must be 1); each document starts
            from its own initial state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (:func:`~openk3.ops.kda.l2norm.l2norm`).
        A_log: ``[H' ≥ H]`` gate parameter; when given the gate is applied in the op.
        dt_bias: ``[H*K]`` gate bias (needs ``A_log``).
        lower_bound: ``lb < 0`` selects the K3 gate ``lb·σ(...)``; None the Kimi-Linear softplus gate.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits and the op uses ``σ(beta)`` in the compute dtype
            (the flag of :func:`~openk3.ops.kda.chunk.chunk_kda`; default False).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``final_state`` ``[N, H, K, V]`` in the
        compute dtype (float64 when any input is float64, else float32), or None.

    Raises:
        ValueError: on bad shapes, ``cu_seqlens``, ``initial_state`` dtype or gate arguments.
    """
    x = prepare_kda_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    o_BTHV, final_NHKV = _run_per_sequence(x)
    return o_BTHV.to(x.out_dtype), (final_NHKV if output_final_state else None)


def _run_per_sequence(x: KDAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    h0_NHKV = x.zero_state() if x.h0 is None else x.h0
    tensors = (x.q, x.k, x.v, x.g, x.beta)
    if x.seq_lens is None:
        return recurrent_scan(h0_NHKV, *tensors)
    o_list, final_list, start = [], [], 0
    for n, length in enumerate(x.seq_lens):
        doc = [t[:, start : start + length] for t in tensors]
        o_1THV, S_1HKV = recurrent_scan(h0_NHKV[n : n + 1], *doc) if length else (doc[2], h0_NHKV[n : n + 1])
        o_list.append(o_1THV)
        final_list.append(S_1HKV)
        start += length
    return torch.cat(o_list, dim=1), torch.cat(final_list)
