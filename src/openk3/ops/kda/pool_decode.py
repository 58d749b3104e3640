"""KDA decode on a state pool, in place: the entry point a server calls for ``T`` new tokens per sequence whose
recurrent states live in rows of one preallocated tensor (vLLM's ``ssm_state_indices``).

On CUDA with Triton (no gradient, head dims the kernels take) it is the Triton decode kernel
(:func:`~openk3.ops.kda.triton.decode.fused_recurrent_kda_decode`), which reads and overwrites the pool rows
in registers. Elsewhere the same recurrence (``docs/references.md#kda-recurrence``) runs in torch, in place
on the rows: ``S ← Diag(e^g) S`` as one ``mul_``, ``S ← S + β k (v − Sᵀk)ᵀ`` as one ``baddbmm_``,
``o = Sᵀ(scale·q)`` as one ``bmm`` — the order of :func:`~openk3.ops.kda.naive.kda_step` (the reference it is
tested against), with no state-sized temporary. Neither path synchronises with the host, so a CUDA graph can
capture it.

Both run inside one torch custom op, ``openk3::kda_pool_decode`` (:func:`kda_pool_decode`: it declares the pool
and ``step_states`` mutated and has a fake implementation giving ``o``'s shape), so ``torch.compile`` traces a
model through the call as one node without a graph break, and Inductor writes the pool in place (no copy of
the states). The argument checks stay outside, in :func:`fused_recurrent_kda_pool`, on static shapes.

Legend: ``N`` sequences, ``T`` tokens per sequence, ``H`` heads, ``K`` key dim, ``V`` value dim, ``S`` pool
rows.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.inputs import check_step_states
from openk3.ops.kda.l2norm import l2norm
from openk3.ops.kda.triton.dispatch import use_triton_recurrent

Tensor = torch.Tensor


def fused_recurrent_kda_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_idx: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = False,
    step_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``T`` tokens of ``N`` sequences; the state of sequence ``n`` is ``state_pool[slot_idx[n]]``
    (``state_pool[n]`` without ``slot_idx``), read and overwritten in place.

    Args:
        q, k, g: ``[N, T, H, K]``; ``g`` is the raw gate when ``A_log`` is given (K3 gate with
            ``lower_bound``, Kimi-Linear softplus gate without, :func:`~openk3.ops.kda.gate.kda_gate`), else
            the log-decay (natural log, ≤ 0).
        v: ``[N, T, H, V]``. beta: ``[N, T, H]`` post-sigmoid (logits with ``use_beta_sigmoid_in_kernel``).
        state_pool: ``[S, H, K, V]`` (K first), contiguous; fp32 (fp64 also on the torch path).
        slot_idx: int64/int32 ``[N]`` distinct pool rows, or None for rows ``0 … N−1``.
        scale: multiplies q; default ``K ** -0.5``.
        A_log: ``[H' ≥ H]``; dt_bias: ``[H*K]`` or None; lower_bound: ``lb < 0`` or None.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (default True, as the model layers).
        use_beta_sigmoid_in_kernel: ``beta`` holds logits (default False).
        step_states: optional contiguous ``[N, T, H, K, V]`` in the pool's dtype that receives the state after
            each token (a speculative verification rolls back to one of them).

    Returns:
        ``o`` ``[N, T, H, V]`` in ``v.dtype``.

    Raises:
        ValueError: shapes that disagree, a non-contiguous pool or one of another dtype than fp32/fp64,
            ``slot_idx`` of the wrong shape or dtype, gate arguments without ``A_log``.
    """
    N, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (N, T, H) or beta.shape != (N, T, H):
        raise ValueError(
            f"q, k, g must be [N, T, H, K], v [N, T, H, V], beta [N, T, H]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, g {list(g.shape)}, v {list(v.shape)}, beta {list(beta.shape)}"
        )
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        raise ValueError(f"state_pool must be [S, {H}, {K}, {V}]; got {list(state_pool.shape)}")
    if state_pool.dtype not in (torch.float32, torch.float64) or not state_pool.is_contiguous():
        raise ValueError(
            f"state_pool must be a contiguous fp32 or fp64 tensor (updated in place); got {state_pool.dtype}"
        )
    if slot_idx is not None and (slot_idx.shape != (N,) or slot_idx.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slot_idx must be int32/int64 [{N}]; got {slot_idx.dtype} {list(slot_idx.shape)}")
    if A_log is None and (dt_bias is not None or lower_bound is not None):
        raise ValueError("dt_bias / lower_bound need A_log (the gate applied in the op)")
    check_step_states(step_states, (N, T, H, K, V), state_pool.dtype)
    scale = K**-0.5 if scale is None else scale
    return torch.ops.openk3.kda_pool_decode(
        q, k, v, g, beta, state_pool, slot_idx, A_log, dt_bias, scale, lower_bound,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, step_states,
    )  # fmt: skip


@torch.library.custom_op("openk3::kda_pool_decode", mutates_args=("state_pool", "step_states"))
def kda_pool_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, slot_idx: Tensor | None,
    A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
    use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, step_states: Tensor | None,
) -> Tensor:  # fmt: skip
    """The op behind :func:`fused_recurrent_kda_pool` (arguments checked there, ``scale`` resolved): the
    Triton kernel where :func:`~openk3.ops.kda.triton.dispatch.use_triton_recurrent` says so (imported only
    then), else the torch recurrence. Overwrites the pool rows (and ``step_states``) in place; returns a new
    contiguous ``o``. No autograd formula: a decode op."""
    N, T = q.shape[:2]
    if state_pool.dtype == torch.float32 and use_triton_recurrent(q, k, v, g, beta, initial_state=state_pool):
        from openk3.ops.kda.triton.decode import fused_recurrent_kda_decode

        return fused_recurrent_kda_decode(
            q, k, v, g, beta, state_pool, slot_idx, scale=scale, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, step_states=step_states,
        )  # fmt: skip
    dtype = state_pool.dtype
    g = kda_gate(g.to(dtype), A_log, dt_bias, lower_bound).to(dtype) if A_log is not None else g.to(dtype)
    beta = beta.to(dtype).sigmoid() if use_beta_sigmoid_in_kernel else beta.to(dtype)
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    S_NHKV = state_pool[:N] if slot_idx is None else state_pool[slot_idx]
    o = []
    for t in range(T):
        o.append(_step_(S_NHKV, q[:, t], k[:, t], v[:, t].to(dtype), g[:, t], beta[:, t]))
        if step_states is not None:
            step_states[:, t].copy_(S_NHKV)
    if slot_idx is not None:
        state_pool[slot_idx] = S_NHKV
    return torch.stack(o, 1).to(v.dtype)


@kda_pool_decode.register_fake
def _(q, k, v, g, beta, state_pool, slot_idx, A_log, dt_bias, scale, lower_bound, l2norm_qk, sigmoid_beta,
      step_states):  # fmt: skip
    return v.new_empty(v.shape)


def _step_(
    S_NHKV: torch.Tensor,
    q_NHK: torch.Tensor,
    k_NHK: torch.Tensor,
    v_NHV: torch.Tensor,
    g_NHK: torch.Tensor,
    beta_NH: torch.Tensor,
) -> torch.Tensor:
    """One token on contiguous states, in place; inputs prepared (q scaled) in ``S``'s dtype. Returns
    ``o [N, H, V]``."""
    N, H, K, V = S_NHKV.shape
    S_PKV = S_NHKV.view(N * H, K, V)
    S_NHKV.mul_(g_NHK.exp().unsqueeze(-1))
    kS_P1V = torch.bmm(k_NHK.reshape(N * H, 1, K), S_PKV)
    delta_P1V = beta_NH.reshape(N * H, 1, 1) * (v_NHV.reshape(N * H, 1, V) - kS_P1V)
    S_PKV.baddbmm_(k_NHK.reshape(N * H, K, 1), delta_P1V)
    return torch.bmm(q_NHK.reshape(N * H, 1, K), S_PKV).view(N, H, V)
