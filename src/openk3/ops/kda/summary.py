"""Segment summaries: the affine state map of a whole segment of KDA tokens, and their algebra.

Every KDA token maps the state affinely (``docs/references.md#kda-context-parallel``)::

    S_t = A_t S_{t−1} + B_t,    A_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}),    B_t = β_t k_t v_tᵀ

so a segment of L tokens maps its entry state ``S_in`` to its exit state ``S_out = M S_in + E`` with
``M = A_L⋯A_1`` (K×K) and ``E`` the exit state from ``S_in = 0`` (K×V). A summary packs them per head as
``[M | E]``, ``[..., K, K + V]`` (K first, like the state). Composition is associative::

    (M₂, E₂) ∘ (M₁, E₁) = (M₂ M₁, M₂ E₁ + E₂)

and its cotangent map is the transpose: ``dS_in = Mᵀ dS_out``. Context parallelism
(:mod:`openk3.dist.kcp`) folds the summaries of the segments before a rank's first token from zero into that
rank's entry state.

One path per device, as :func:`~openk3.ops.kda.chunk.chunk_kda` dispatches
(:func:`~openk3.ops.kda.triton.dispatch.use_triton_chunk`):

* **torch** (CPU, and every case the kernels do not take): from the chunked op's own factors
  (:mod:`openk3.ops.kda.chunk`): each chunk's map ``S_C = A S₀ + Bc`` (``A = Diag(e^{Γ_C}) − K̂ᵀW``,
  ``Bc = K̂ᵀU``), composed over the chunks of each segment as a tree (adjacent pairs, level by level:
  ``⌈log₂ M⌉`` batched products), in the compute dtype (fp32, fp64 for fp64 inputs; never a 16-bit type).
  Differentiable by autograd.
* **Triton** (CUDA): the map is affine in the state and each value column evolves alone (``B_t`` is linear
  in ``v_t``, ``A_t`` acts on the key side only), so ``[M | E]`` is the final state of the ordinary chunked
  op run on the augmented value ``[0 | v]`` (``K + V`` columns) from the entry state ``[I | 0]``
  (:func:`kernel_summaries`): the same kernels, forward and backward, no new one. The kernels take value
  widths in {16, 32, 64, 128}, so the columns go in one call when ``K + V`` is one of them (K = V = 64), else
  in two (``M`` from ``I`` with zero values, ``E`` from zero with ``v``: K3's K = V = 128). The output ``o``
  of those calls is computed and dropped (its gradient is zero).

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` segments, ``P`` chunks,
``C`` chunk length, ``M`` chunk slots per segment, ``Z`` the ``N·H`` (segment, head) pairs, ``J`` summaries
in a chain, ``X = K + V`` the packed ``[M | E]`` width.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.chunk import _chunk_transitions, _wy_representation
from openk3.ops.kda.chunk_intra import gate_sums, intra_chunk_matrices
from openk3.ops.kda.inputs import check_kda_args, prepare_kda_inputs
from openk3.ops.kda.layout import ChunkLayout
from openk3.ops.kda.triton.dispatch import SUPPORTED_DIMS, use_triton_chunk


def segment_summaries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """``[M | E]`` of each segment: the map ``S_out = M S_in + E`` of its tokens.

    Takes the arguments of :func:`~openk3.ops.kda.chunk.chunk_kda` (``q`` is read only by the argument checks:
    the state map does not depend on it), each segment being a batch row or a document of ``cu_seqlens``.
    An empty segment has ``M = I``, ``E = 0``. Where :func:`~openk3.ops.kda.chunk.chunk_kda` runs the Triton
    kernels (CUDA, the K3 gate in the op, ``chunk_size = 64``, supported dims) the summaries come from them
    (:func:`kernel_summaries`), else from the torch chunk factors.

    Returns:
        ``[N, H, K, K + V]`` in the compute dtype (float64 for float64 inputs, else float32).

    Raises:
        ValueError: as :func:`~openk3.ops.kda.chunk.chunk_kda`.
    """
    if use_triton_chunk(
        q, k, v, g, beta, A_log=A_log, lower_bound=lower_bound, chunk_size=chunk_size, dt_bias=dt_bias
    ):
        return kernel_summaries(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        )  # fmt: skip
    x = prepare_kda_inputs(
        q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    B, T, H, K = x.k.shape
    V = x.v.shape[-1]
    layout = ChunkLayout(B, T, x.seq_lens, chunk_size, x.k.device)
    eye_HKK = torch.eye(K, dtype=x.k.dtype, device=x.k.device).expand(H, K, K)
    if layout.P == 0:
        return torch.cat([eye_HKK, x.k.new_zeros(H, K, V)], dim=-1).expand(layout.N, H, K, K + V).clone()
    k_PHCK, v_PHCV, g_PHCK = (layout.to_chunks(t).transpose(1, 2).contiguous() for t in (x.k, x.v, x.g))
    beta_PHC = layout.to_chunks(x.beta).transpose(1, 2)
    sums = gate_sums(g_PHCK)
    _, Lkk_PHCC = intra_chunk_matrices(k_PHCK, k_PHCK, sums)
    W_PHCK, U_PHCV = _wy_representation(Lkk_PHCC, k_PHCK, v_PHCV, beta_PHC, sums.prefix)
    A_PHKK, Bc_PHKV = _chunk_transitions(k_PHCK, sums, W_PHCK, U_PHCV)
    identity_HKX = torch.cat([eye_HKK, x.k.new_zeros(H, K, V)], dim=-1)
    X_MNHKX = layout.to_grid(torch.cat([A_PHKK, Bc_PHKV], dim=-1), fill=identity_HKX)
    return _compose_tree(X_MNHKX, identity_HKX)


def kernel_summaries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
    use_beta_sigmoid_in_kernel: bool,
) -> torch.Tensor:
    """``[M | E]`` of each segment from the Triton chunked op: the final states of the augmented value
    ``[0 | v]`` from the entry state ``[I | 0]`` (module docstring), one call when ``K + V`` is a kernel
    width, else one for the ``M`` columns and one for ``E``. Differentiable (the kernels' own backward: the
    cotangent of ``[M | E]`` enters as the final state's). ``q`` is read by the argument checks only.

    Takes the K3 gate in the op (``A_log``, ``−5 ≤ lower_bound < 0``), K and V in {16, 32, 64, 128},
    fp16/bf16/fp32 inputs: the cases where :func:`~openk3.ops.kda.triton.dispatch.use_triton_chunk` holds
    (and any device under ``TRITON_INTERPRET=1``).

    Returns:
        fp32 ``[N, H, K, K + V]`` (``N``: batch rows, or documents of ``cu_seqlens``).

    Raises:
        ValueError: as :func:`~openk3.ops.kda.chunk.chunk_kda`.
    """
    from openk3.ops.kda.triton.chunk_function import chunk_kda_triton

    seq_lens = check_kda_args(
        q, k, v, g, beta, initial_state=None, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound,
    )  # fmt: skip
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if seq_lens is None else len(seq_lens)
    eye_KK = torch.eye(K, dtype=torch.float32, device=k.device)
    zero_BTHK = v.new_zeros(B, T, H, K)
    zero_KV = eye_KK.new_zeros(K, V)
    if K + V in SUPPORTED_DIMS:
        calls = [(torch.cat([zero_BTHK, v], dim=-1), torch.cat([eye_KK, zero_KV], dim=-1))]
    else:
        calls = [(zero_BTHK, eye_KK), (v, zero_KV)]
    finals = []
    for value_BTHW, entry_KW in calls:
        _, final_NHKW = chunk_kda_triton(
            k.detach(), k, value_BTHW, g, beta, scale=1.0,
            initial_state=entry_KW.expand(N, H, K, entry_KW.shape[-1]).contiguous(), output_final_state=True,
            seq_lens=seq_lens, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        )  # fmt: skip
        finals.append(final_NHKW)
    return torch.cat(finals, dim=-1)


def _compose_tree(X_MNHKX: torch.Tensor, identity_HKX: torch.Tensor) -> torch.Tensor:
    """The composite of the ``M`` chunk maps of every segment, in order: pairs composed level by level
    (``⌈log₂ M⌉`` batched products instead of ``M`` dependent ones; the association changes, the map does not).
    Empty cells hold the identity map."""
    while X_MNHKX.shape[0] > 1:
        if X_MNHKX.shape[0] % 2:
            X_MNHKX = torch.cat([X_MNHKX, identity_HKX.expand(1, *X_MNHKX.shape[1:])])
        X_MNHKX = compose(X_MNHKX[0::2], X_MNHKX[1::2])
    return X_MNHKX[0]


def compose(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The summary of ``first`` then ``second`` (``[..., K, K + V]`` each): ``[M₂M₁ | M₂E₁ + E₂]``."""
    K = first.shape[-2]
    M2 = second[..., :K]
    out = M2 @ first
    return torch.cat([out[..., :K], out[..., K:] + second[..., K:]], dim=-1)


def apply_summary(summary: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """``M S_in + E`` for a summary ``[..., K, K + V]`` and states ``[..., K, V]``."""
    K = summary.shape[-2]
    return summary[..., :K] @ S_in + summary[..., K:]


def fold_from_zero(chain_J: torch.Tensor) -> torch.Tensor:
    """The state after the ``J`` segments of a chain ``[J, ..., K, K + V]`` (in order) entered from zero:
    ``S ← M_j S + E_j`` from ``S = 0``; ``[..., K, V]`` (zeros for an empty chain)."""
    K = chain_J.shape[-2]
    S = chain_J.new_zeros(*chain_J.shape[1:-1], chain_J.shape[-1] - K)
    for summary in chain_J.unbind(0):
        S = apply_summary(summary, S)
    return S
