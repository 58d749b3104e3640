"""KCP: the KDA core over one sequence split across the ranks of a context-parallel group.

For one rank holding fragments of the stream (:class:`~openk3.dist.cp_plan.ContextParallelPlan`),
``docs/references.md#kda-context-parallel``:

1. **summaries**: for each local fragment whose last piece's document goes on past the fragment, the map
   ``[M | E]`` (``[H, K, K + V]``, compute dtype) of that piece from its chunk factors
   (:func:`~openk3.ops.kda.summary.segment_summaries`, activation-checkpointed: recomputed in the
   backward); zeros for the others;
2. **one all-gather** of the ``[S, H, K, K + V]`` slots, flat (:func:`~openk3.dist.cp_collectives.all_gather_flat`):
   ``H·K·(K+V)·4·S`` bytes sent per rank in fp32 (12 MiB for K3's 96 heads of 128, contiguous layout),
   whatever the sequence length;
3. **fold**: each local fragment's first piece, when it continues a document, enters with the state of its
   chain folded from zero (``S ← M_j S + E_j``, compute dtype: fp32, or fp64 for fp64 inputs);
4. **local run**: the ordinary :func:`~openk3.ops.kda.chunk.chunk_kda` over the local pieces with those entry
   states (the Triton kernels on CUDA when they apply).

**Backward**: autograd's transpose of the same steps: the local backward gives the entry states' cotangents,
the fold's backward carries them through ``Mᵀ`` to the predecessors' summaries, the all-gather's backward
(one reduce-scatter) returns each summary's cotangent to its rank, and the summaries' backward reaches that
rank's inputs. Every rank joins the reduce-scatter (:func:`~openk3.dist.cp_collectives.keep_in_backward`).

Legend: ``T`` global tokens, ``L`` local tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``S`` slots
(fragments) per rank, ``W`` ranks, ``N`` local pieces, ``X = K + V``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from openk3.dist.cp_collectives import all_gather_flat, keep_in_backward
from openk3.dist.cp_plan import ContextParallelPlan
from openk3.ops.kda import chunk_kda
from openk3.ops.kda.inputs import compute_dtype_of
from openk3.ops.kda.summary import fold_from_zero, segment_summaries


def summary_bytes(heads: int, key_dim: int, value_dim: int, slots: int = 1, element_size: int = 4) -> int:
    """Bytes one rank sends in the KCP all-gather of one layer, one direction: ``S·H·K·(K+V)`` summary values
    (fp32 by default), independent of the sequence length; each rank receives ``W`` times that."""
    return slots * heads * key_dim * (key_dim + value_dim) * element_size


def check_context_parallel_call(plan: ContextParallelPlan, group, local_len: int, batch: int) -> None:
    """Raise ``ValueError`` (before any collective) when the local row does not fit the plan or the group.

    Args:
        plan: this rank's plan. group: the CP process group (None: the world).
        local_len: tokens in the local row. batch: rows (must be 1: one packed sequence).
    """
    size = dist.get_world_size(group)
    if size != plan.world:
        raise ValueError(f"the CP group has {size} ranks but the plan was built for world={plan.world}")
    if dist.get_rank(group) != plan.rank:
        raise ValueError(
            f"this rank is {dist.get_rank(group)} in the CP group but the plan is for rank {plan.rank}"
        )
    if batch != 1:
        raise ValueError(f"context parallelism splits one packed sequence (B = 1); got B = {batch}")
    if local_len != plan.local_len:
        raise ValueError(
            f"the local row has {local_len} tokens but the plan gives this rank {plan.local_len} "
            f"(T={plan.total} over {plan.world} ranks, {plan.layout})"
        )


def context_parallel_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    plan: ContextParallelPlan,
    group=None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    **op_kwargs,
) -> torch.Tensor:
    """KDA over this rank's tokens of a sequence split by ``plan``; collective over ``group``.

    Args:
        q, k: ``[1, L, H, K]``; v: ``[1, L, H, V]``; g: ``[1, L, H, K]``; beta: ``[1, L, H]``: this rank's
            tokens (:meth:`~openk3.dist.cp_plan.ContextParallelPlan.shard` of the global row).
        plan: this rank's plan (the same ``cu_seqlens``, world and layout on every rank).
        group: the CP process group (None: the default group).
        initial_state, output_final_state: not supported under CP (a document's start and end may be on any
            rank); passing them raises.
        chunk_size: chunk length of the local op and of the summaries.
        **op_kwargs: the gate and normalisation arguments of :func:`~openk3.ops.kda.chunk.chunk_kda`
            (``scale``, ``use_qk_l2norm_in_kernel``, ``A_log``, ``dt_bias``, ``lower_bound``,
            ``use_beta_sigmoid_in_kernel``).

    Returns:
        ``o`` ``[1, L, H, V]`` in ``v.dtype``: this rank's rows of the unsharded op's output.

    Raises:
        ValueError: before any collective, for an ``initial_state`` or ``output_final_state``, a local row that
            does not match the plan, or a group of another size (and the op's own argument errors).
    """
    if initial_state is not None or output_final_state:
        raise ValueError(
            "context_parallel_kda cannot honour initial_state / output_final_state: a document's first and last "
            "tokens may sit on any rank; run without them (each document starts from zero)"
        )
    check_context_parallel_call(plan, group, q.shape[1], q.shape[0])
    _, _, H, K = q.shape
    V = v.shape[-1]
    dtype = compute_dtype_of(q, k, v, g, beta)
    cu_local = plan.local_cu_seqlens.to(q.device)
    pieces = plan.fragment_pieces
    needed = plan.needed_slots
    slots_SHKX = _local_summaries(
        (q, k, v, g, beta), plan.local_cu_seqlens, pieces, [s in needed for s in plan.local_slots()], chunk_size, op_kwargs,
        (H, K, V), dtype,
    )  # fmt: skip
    gathered_WSHKX = all_gather_flat(
        slots_SHKX, group, anchors=_tensors(q, k, v, g, beta, *op_kwargs.values())
    )
    all_JHKX = gathered_WSHKX.reshape(-1, H, K, K + V)
    zero_HKV = all_JHKX.new_zeros(H, K, V)
    h0 = [zero_HKV] * (len(cu_local) - 1)
    for slot, (first, _) in zip(plan.local_slots(), pieces, strict=True):
        chain = plan.chain(slot)
        if chain:
            h0[first] = fold_from_zero(all_JHKX[chain])
    h0_NHKV = torch.stack(h0) + keep_in_backward(gathered_WSHKX)
    o, _ = chunk_kda(
        q, k, v, g, beta, initial_state=h0_NHKV, cu_seqlens=cu_local, chunk_size=chunk_size, **op_kwargs
    )
    return o


def _local_summaries(tensors, cu_host, pieces, wanted, chunk_size, op_kwargs, dims, dtype) -> torch.Tensor:
    """``[S, H, K, K + V]``: the summary of each local fragment's last piece where ``wanted``, else zeros
    (``cu_host``: the local pieces' offsets on the host, read without a device sync)."""
    H, K, V = dims
    q = tensors[0]
    rows = [
        (int(cu_host[last]), int(cu_host[last + 1]))
        for (_, last), want in zip(pieces, wanted, strict=True)
        if want
    ]
    zero_HKX = q.new_zeros(H, K, K + V, dtype=dtype)
    if not rows:
        return zero_HKX.expand(len(pieces), H, K, K + V).clone()
    index = torch.cat([torch.arange(a, b) for a, b in rows]).to(q.device)
    ends = torch.tensor([b - a for a, b in rows]).cumsum(0)
    cu = torch.cat([ends.new_zeros(1), ends]).to(q.device)
    picked = [t.index_select(1, index) for t in tensors]
    # recomputed in the backward (after the local op's backward has freed its activations), so a rank's peak
    # holds the local op's activations or the summary's, not both
    summaries_RHKX = checkpoint(
        segment_summaries, *picked, use_reentrant=False, cu_seqlens=cu, chunk_size=chunk_size,
        **_summary_kwargs(op_kwargs),
    )  # fmt: skip
    out, r = [], 0
    for want in wanted:
        out.append(summaries_RHKX[r] if want else zero_HKX)
        r += want
    return torch.stack(out)


def _tensors(*values) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in values if isinstance(t, torch.Tensor))


def _summary_kwargs(op_kwargs: dict) -> dict:
    """The op's keyword arguments that change the state map (``scale`` only scales q)."""
    return {n: val for n, val in op_kwargs.items() if n != "scale"}
