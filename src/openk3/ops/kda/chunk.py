"""Chunked KDA for training and prefill: the WY/UT form in torch ops, differentiated by autograd.

Per chunk of ``C`` tokens starting from state ``S₀`` (``docs/references.md#kda-chunked-form``; fla
``chunk_kda`` names)::

    Γ = cumsum(g)                     K̃ = K ⊙ e^{Γ}    Q̃ = Q ⊙ e^{Γ}    K̂ = K ⊙ e^{Γ_C − Γ}
    L = Diag(β) Lkk,  Aqk             (chunk_intra.py: masked/anchored, all exponents ≤ 0)
    [W | U] = (I + L)⁻¹ Diag(β) [K̃ | V]                       (unit lower-triangular inverse)
    S_C = (Diag(e^{Γ_C}) − K̂ᵀ W) S₀ + K̂ᵀ U  =:  A S₀ + Bc     (chunk transition, an affine map)
    O = Q̃ S₀ + Aqk (U − W S₀)

Every chunk's ``A`` and ``Bc`` are built in one batch; only ``S ← A S + Bc`` loops over chunk slots in
Python; then all outputs are formed in one batch again.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` sequences,
``P`` chunks (flat list), ``C`` chunk length, ``M`` chunk slots per sequence,
``Z`` the ``N·H`` (sequence, head) pairs of the scan.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.chunk_intra import SUB_CHUNK, GateSums, gate_sums, intra_chunk_matrices
from openk3.ops.kda.inputs import KDAInputs, check_kda_args, prepare_kda_inputs
from openk3.ops.kda.layout import ChunkLayout
from openk3.ops.kda.triton.config import KDAOptions, LaunchConfig
from openk3.ops.kda.triton.dispatch import use_triton_chunk


def chunk_kda(
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
    chunk_size: int = 64,
    use_beta_sigmoid_in_kernel: bool = False,
    options: KDAOptions | None = None,
    launch: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by chunks; equals :func:`~openk3.ops.kda.naive.naive_recurrent_kda` up to rounding.

    Autograd gives the gradients of q, k, v, g, beta, ``initial_state`` and, with the gate in the op,
    ``A_log`` and ``dt_bias``; they are finite for any finite log-decay ≤ 0, however negative (−1e38
    included, whose chunk sums overflow fp32 to −inf), and for the K3 gate saturated with ``e^{A_log}``
    past fp32's range (:func:`~openk3.ops.kda.gate.kda_gate`), where they are fp64's limits.

    The torch path is causal bit for bit: changing any input at or after position ``t`` changes no output
    before ``t``, nor, for a loss on the outputs before ``t``, any gradient of an earlier input or of
    ``initial_state``, ``A_log``, ``dt_bias`` (:mod:`~openk3.ops.kda.chunk_intra`: a constant anchor).

    On CUDA tensors with Triton installed, the K3 gate in the op (``A_log`` given, ``−5 ≤ lower_bound < 0``),
    ``chunk_size = 64``, K and V in {16, 32, 64, 128} and fp16/bf16/fp32 inputs, the Triton kernels of
    :mod:`openk3.ops.kda.triton` run instead of the torch ops (same results up to bf16 rounding of the
    intermediates, own backward); everything else takes the torch path below.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-decay (natural log, ≤ 0); with ``A_log`` given, the raw gate pre-activation
            that :func:`~openk3.ops.kda.gate.kda_gate` turns into the log-decay inside the op.
        beta: ``[B, T, H]`` post-sigmoid delta-rule strength, in ``[0, 1]`` (logits with
            ``use_beta_sigmoid_in_kernel``). Not checked (a check would
            sync with the device); the CUDA path's fp16 operand bounds assume it (see
            :func:`openk3.ops.kda.triton.chunk_prepare.fp16_inverse`; at β = 1.9 with repeated keys the results
            stay finite but are 2% off in Triton's interpreter).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (K first) in the compute dtype, or None for zeros; ``N = B``, or the
            number of documents with ``cu_seqlens``.
        output_final_state: also return the ``[N, H, K, V]`` state after each sequence's last token.
        cu_seqlens: int64 ``[N+1]`` document offsets of a packed row (B must be 1); chunks never cross a
            document boundary and each document starts from its own initial state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (:func:`~openk3.ops.kda.l2norm.l2norm`).
        A_log: ``[H' ≥ H]`` gate parameter; when given the gate is applied in the op.
        dt_bias: ``[H*K]`` gate bias (needs ``A_log``).
        lower_bound: ``lb < 0`` selects the K3 gate ``lb·σ(...)``; None the Kimi-Linear softplus gate.
        chunk_size: tokens per chunk ``C``, a positive multiple of 16 (default 64). T need not be a multiple.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits and the op uses ``σ(beta)``, computed in the compute
            dtype (fp32, fp64 for fp64 inputs; inside the kernels on the GPU) rather than rounded to
            ``beta``'s dtype first (fla's flag of that name); the gradient is w.r.t. the logits. Default
            False.
        options, launch: the Triton kernels' memory/precision trades and launch geometry
            (:class:`~openk3.ops.kda.triton.config.KDAOptions`, :class:`~openk3.ops.kda.triton.config.LaunchConfig`;
            None: the defaults); the torch path has neither and ignores them.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``final_state`` ``[N, H, K, V]`` in the
        compute dtype (float64 when any input is float64, else float32 — also for fp16/bf16), or None. A NaN
        or inf in one token's inputs makes ``o`` non-finite from the start of that token's chunk on (16
        tokens in the GPU's tile forward; the chunk's matrix products give 0·NaN = NaN for its earlier rows
        too); earlier chunks stay finite.

    Raises:
        ValueError: on bad shapes, ``cu_seqlens`` (or ``B != 1`` with it), ``initial_state`` shape/dtype, gate
            arguments or ``chunk_size``.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_CHUNK}; got {chunk_size}")
    if use_triton_chunk(
        q, k, v, g, beta, A_log=A_log, lower_bound=lower_bound, chunk_size=chunk_size, dt_bias=dt_bias,
        initial_state=initial_state,
    ):  # fmt: skip
        seq_lens = check_kda_args(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound,
        )  # fmt: skip
        from openk3.ops.kda.triton.chunk_function import chunk_kda_triton

        return chunk_kda_triton(
            q, k, v, g, beta, scale=q.shape[-1] ** -0.5 if scale is None else scale,
            initial_state=initial_state, output_final_state=output_final_state, seq_lens=seq_lens,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            options=options, launch=launch,
        )  # fmt: skip
    x = prepare_kda_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    B, T = x.q.shape[:2]
    layout = ChunkLayout(B, T, x.seq_lens, chunk_size, x.q.device)
    o_PHCV, final_NHKV = _chunk_forward(x, layout)
    o_BTHV = layout.from_chunks(o_PHCV.transpose(1, 2))
    return o_BTHV.to(x.out_dtype), (final_NHKV if output_final_state else None)


def _chunk_forward(x: KDAInputs, layout: ChunkLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """All chunks at once except the state scan; returns ``(o_PHCV, final_NHKV)``."""
    q_PHCK, k_PHCK, v_PHCV, g_PHCK = (
        layout.to_chunks(t).transpose(1, 2).contiguous() for t in (x.q, x.k, x.v, x.g)
    )
    beta_PHC = layout.to_chunks(x.beta).transpose(1, 2)
    sums = gate_sums(g_PHCK)
    Aqk_PHCC, Lkk_PHCC = intra_chunk_matrices(q_PHCK, k_PHCK, sums)
    W_PHCK, U_PHCV = _wy_representation(Lkk_PHCC, k_PHCK, v_PHCV, beta_PHC, sums.prefix)
    A_PHKK, Bc_PHKV = _chunk_transitions(k_PHCK, sums, W_PHCK, U_PHCV)
    h0_NHKV = x.zero_state() if x.h0 is None else x.h0
    S0_PHKV, final_NHKV = _scan_states(layout, A_PHKK, Bc_PHKV, h0_NHKV)
    qg_PHCK = q_PHCK * sums.prefix.exp()
    o_PHCV = qg_PHCK @ S0_PHKV + Aqk_PHCC @ (U_PHCV - W_PHCK @ S0_PHKV)
    return o_PHCV, final_NHKV


def _wy_representation(Lkk_PHCC, k_PHCK, v_PHCV, beta_PHC, prefix_PHCK):
    """``W = T Diag(β) (K ⊙ e^{Γ})``, ``U = T Diag(β) V`` with ``T = (I + Diag(β) Lkk)⁻¹``."""
    beta_PHC1 = beta_PHC.unsqueeze(-1)
    eye_CC = torch.eye(Lkk_PHCC.shape[-1], dtype=Lkk_PHCC.dtype, device=Lkk_PHCC.device)
    # the explicit inverse then matmuls beat a solve with K + V right-hand sides on CPU (fwd and bwd)
    T_PHCC = torch.linalg.solve_triangular(beta_PHC1 * Lkk_PHCC, eye_CC, upper=False, unitriangular=True)
    W_PHCK = T_PHCC @ (beta_PHC1 * k_PHCK * prefix_PHCK.exp())
    U_PHCV = T_PHCC @ (beta_PHC1 * v_PHCV)
    return W_PHCK, U_PHCV


def _chunk_transitions(k_PHCK, sums: GateSums, W_PHCK, U_PHCV):
    """The affine state map of each chunk, ``S_C = A S₀ + Bc``: ``A = Diag(e^{Γ_C}) − K̂ᵀW``, ``Bc = K̂ᵀU``."""
    khatT_PHKC = (k_PHCK * sums.suffix.exp()).transpose(-1, -2)
    return torch.diag_embed(sums.prefix[..., -1, :].exp()) - khatT_PHKC @ W_PHCK, khatT_PHKC @ U_PHCV


def _scan_states(layout: ChunkLayout, A_PHKK, Bc_PHKV, h0_NHKV):
    """``S ← A S + Bc`` over the chunk slots of every sequence; returns (state at each chunk start, final).

    Empty slots (past a sequence's last chunk) hold the identity map, so the state passes through them.
    """
    _, H, K, V = Bc_PHKV.shape
    eye_HKK = torch.eye(K, dtype=A_PHKK.dtype, device=A_PHKK.device).expand(H, K, K)
    A_MNHKK = layout.to_grid(A_PHKK, fill=eye_HKK)
    Bc_MNHKV = layout.to_grid(Bc_PHKV, fill=Bc_PHKV.new_zeros(()))
    N = layout.N
    S_ZKV = h0_NHKV.reshape(N * H, K, V)
    starts = []
    # unbind, not A[m]: the backward of M selects would write M full-size zero tensors
    for A_NHKK, Bc_NHKV in zip(A_MNHKK.unbind(0), Bc_MNHKV.unbind(0), strict=True):
        starts.append(S_ZKV)
        S_ZKV = torch.baddbmm(Bc_NHKV.view(N * H, K, V), A_NHKK.view(N * H, K, K), S_ZKV)
    S0_MNHKV = torch.stack(starts).view(layout.M, N, H, K, V)
    return layout.from_grid(S0_MNHKV), S_ZKV.view(N, H, K, V)
