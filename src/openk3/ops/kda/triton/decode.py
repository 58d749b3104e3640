"""KDA decode on the GPU: the per-token recurrence (docs/references.md#kda-recurrence) on fp32 states kept in a pool, updated in place.

One program per (value block, sequence, head) holds ``S [K, BV]`` of its state slot in fp32 registers and
steps through the sequence's tokens (one for decoding; a few to verify draft tokens or to prefill a short
suffix)::

    S ← Diag(e^{g_t}) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ (scale·q_t)

The gate is applied in the kernel: the K3 lower-bounded gate (``lower_bound``), the Kimi-Linear softplus gate
(``A_log`` without ``lower_bound``) or none (``g`` already the log-decay). ``slot_idx`` maps each sequence to
its row of the pool, as a server's state cache needs (vLLM's ``ssm_state_indices``); a negative slot skips
the sequence (its outputs are written as zeros, no state is touched). With ``steps`` the kernel also stores
the state after every token (a speculative verification keeps them to roll back to the last accepted one).

Legend: ``N`` sequences, ``T`` tokens per sequence, ``H`` heads, ``K``/``V`` key/value dims, ``BV`` value
block, ``S`` state slots of the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.inputs import check_step_states
from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, DecodeLaunch

GATE_NONE, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
"""Gate kinds of :func:`kda_decode_kernel` (constexpr ``GATE``)."""


@triton.jit
def kda_decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, state, slot_idx, o, cu_seqlens, steps,
    scale, lower_bound, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_SLOTS: tl.constexpr, BETA_SIGMOID: tl.constexpr, STORE_STEPS: tl.constexpr,
):  # fmt: skip
    """Grid ``(V/BV, N·H)``. Tokens of sequence ``n`` are rows ``[n·T, (n+1)·T)`` of the flat token axis,
    or ``[cu_seqlens[n], cu_seqlens[n+1])`` with ``IS_VARLEN``; ``state`` is fp32 ``[S, H, K, V]``; with
    ``STORE_STEPS``, ``steps`` fp32 ``[tokens, H, K, V]`` receives the state after each token."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    if HAS_SLOTS:
        slot = tl.load(slot_idx + i_n).to(tl.int64)
    else:
        slot = i_n.to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    if GATE != 0:
        A_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        else:
            bias = tl.zeros([K], dtype=tl.float32)
    if slot >= 0:
        p_state = (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(state + p_state)
        for t in range(bos, eos):
            p_tk = (t * H + i_h) * K + o_k
            b_q = tl.load(q + p_tk).to(tl.float32)
            b_k = tl.load(k + p_tk).to(tl.float32)
            b_x = tl.load(g + p_tk).to(tl.float32)
            b_v = tl.load(v + (t * H + i_h) * V + o_v).to(tl.float32)
            b_b = tl.load(beta + t * H + i_h).to(tl.float32)
            if BETA_SIGMOID:
                b_b = tl.sigmoid(b_b)
            if USE_L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
            if GATE == 2:
                b_x = lower_bound * tl.sigmoid(A_h * (b_x + bias))
            elif GATE == 1:
                b_z = b_x + bias
                b_x = -A_h * tl.where(b_z > 20.0, b_z, tl.log(1.0 + tl.exp(b_z)))
            b_S = b_S * tl.exp(b_x)[:, None]
            b_delta = b_b * (b_v - tl.sum(b_k[:, None] * b_S, axis=0))
            b_S = b_S + b_k[:, None] * b_delta[None, :]
            b_o = tl.sum((b_q * scale)[:, None] * b_S, axis=0)
            tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty))
            if STORE_STEPS:
                tl.store(steps + (t * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_S)
        tl.store(state + p_state, b_S)
    else:
        for t in range(bos, eos):
            tl.store(o + (t * H + i_h) * V + o_v, tl.zeros([BV], dtype=o.dtype.element_ty))


def _gate_kind(A_log: torch.Tensor | None, lower_bound: float | None) -> int:
    if A_log is None:
        return GATE_NONE
    return GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND


def launch_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_idx: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    o: torch.Tensor,
    *,
    num_seqs: int,
    tokens_per_seq: int,
    scale: float,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    use_l2norm: bool,
    beta_sigmoid: bool = False,
    steps: torch.Tensor | None = None,
    launch: DecodeLaunch = DEFAULT_GEOMETRY.decode,
) -> None:
    """Launch :func:`kda_decode_kernel` on flat ``[tokens, H, ·]`` tensors (the arguments unchecked: see the
    callers; ``steps``: fp32 ``[tokens, H, K, V]`` for the state after each token, or ``None``; ``launch``:
    the value block by program count)."""
    H, K = q.shape[-2:]
    V = v.shape[-1]
    BV = min(V, launch.small_bv if num_seqs * H < launch.large_programs else launch.large_bv)
    kda_decode_kernel[(triton.cdiv(V, BV), num_seqs * H)](
        q, k, v, g, beta, A_log, dt_bias, state, slot_idx, o, cu_seqlens, steps,
        scale, 0.0 if lower_bound is None else lower_bound, tokens_per_seq,
        H=H, K=K, V=V, BV=BV, GATE=_gate_kind(A_log, lower_bound), HAS_BIAS=dt_bias is not None,
        USE_L2NORM=use_l2norm, IS_VARLEN=cu_seqlens is not None, HAS_SLOTS=slot_idx is not None,
        BETA_SIGMOID=beta_sigmoid, STORE_STEPS=steps is not None,
        num_warps=4 if K * BV >= 128 * 64 else 2, num_stages=1,
    )  # fmt: skip


def fused_recurrent_kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_idx: torch.Tensor | None,
    *,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    step_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode (or verify) ``T`` new tokens for ``N`` sequences whose fp32 states live in a pool; updates
    ``state_pool[slot_idx[n]]`` in place (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Args:
        q, k, g: ``[N, T, H, K]``; ``g`` is the raw gate with ``A_log`` given (K3 gate with
            ``lower_bound``, Kimi-Linear softplus gate without), else the log-decay (natural log, ≤ 0).
        v: ``[N, T, H, V]``. beta: ``[N, T, H]`` post-sigmoid (logits with ``use_beta_sigmoid_in_kernel``).
        state_pool: fp32 ``[S, H, K, V]`` (K first), contiguous; rows ``slot_idx`` are read and overwritten.
        slot_idx: int32/int64 ``[N]`` pool rows, distinct; a negative entry skips that sequence (zeros out);
            ``None``: rows ``0 … N−1`` (no index tensor to build).
        scale: multiplies q; default ``K ** -0.5``.
        A_log: ``[H' ≥ H]`` (first H used); dt_bias: ``[H*K]`` or None; lower_bound: ``lb < 0`` or None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(Σx² + 1e-6)``, default True).
        use_beta_sigmoid_in_kernel: apply ``σ`` to ``beta`` in the kernel (default False).
        out: optional contiguous ``[N, T, H, V]`` output buffer (v's dtype).
        step_states: optional contiguous fp32 ``[N, T, H, K, V]`` that receives the state after each token
            (not for skipped sequences).

    Returns:
        ``o`` ``[N, T, H, V]`` in v's dtype (``out`` when given).

    Raises:
        ValueError: on shape, dtype, contiguity or device mismatches.
    """
    N, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (N, T, H) or beta.shape != (N, T, H):
        raise ValueError(
            f"q, k, g must be [N, T, H, K], v [N, T, H, V], beta [N, T, H]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, g {list(g.shape)}, v {list(v.shape)}, beta {list(beta.shape)}"
        )
    if state_pool.dtype != torch.float32 or state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        raise ValueError(f"state_pool must be fp32 [S, {H}, {K}, {V}]; got {state_pool.dtype} "
                         f"{list(state_pool.shape)}")  # fmt: skip
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is updated in place)")
    if slot_idx is not None and (slot_idx.shape != (N,) or slot_idx.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slot_idx must be int32/int64 [{N}]; got {slot_idx.dtype} {list(slot_idx.shape)}")
    if A_log is None and (dt_bias is not None or lower_bound is not None):
        raise ValueError("dt_bias / lower_bound need A_log (the gate in the kernel)")
    check_step_states(step_states, (N, T, H, K, V), torch.float32)
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {v.dtype} {list(v.shape)}; got {out.dtype} {list(out.shape)}"
                         f"{'' if out.is_contiguous() else ', strided'}")  # fmt: skip
    # contiguous whatever v's strides: the kernel writes o as flat [tokens, H, V] (empty_like would copy a
    # strided v's layout, e.g. the server's T-fastest conv outputs, and the rows would land out of place)
    o = v.new_empty(v.shape) if out is None else out
    launch_decode(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
        slot_idx, None, o, num_seqs=N, tokens_per_seq=T, scale=K**-0.5 if scale is None else scale,
        A_log=None if A_log is None else A_log[:H], dt_bias=dt_bias, lower_bound=lower_bound,
        use_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel, steps=step_states,
    )  # fmt: skip
    return o


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    num_seqs: int,
    use_qk_l2norm_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~openk3.ops.kda.fused_recurrent.fused_recurrent_kda` on the GPU (arguments already checked
    there): the decode kernel on a copy of the initial states, out of place."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = (
        initial_state.clone(memory_format=torch.contiguous_format)
        if initial_state is not None
        else q.new_zeros(num_seqs, H, K, V, dtype=torch.float32)
    )
    flat = [t.contiguous() for t in (q, k, v, g, beta)]
    o = flat[2].new_empty(flat[2].shape)  # contiguous, as the kernel writes it
    launch_decode(
        *flat, state, None, cu_seqlens, o, num_seqs=num_seqs, tokens_per_seq=T, scale=scale,
        A_log=None if A_log is None else A_log[:H], dt_bias=dt_bias, lower_bound=lower_bound,
        use_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    return o, (state if output_final_state else None)
