"""KCP: the KDA core over one sequence split across the ranks of a context-parallel group.

For one rank holding fragments of the stream (:class:`~openk3.dist.cp_plan.ContextParallelPlan`),
``docs/references.md#kda-context-parallel``:

**Forward** (no autograd graph except the local op's):

1. **summaries**: for each local fragment whose last piece's document goes on past the fragment, the map
   ``[M | E]`` (``[H, K, K + V]``, compute dtype) of that piece
   (:func:`~openk3.ops.kda.summary.segment_summaries`: the torch chunk factors on the CPU, the Triton kernels'
   inference forward on CUDA); zeros for the others. Never differentiated (see the backward), so nothing of
   them is kept;
2. **one all-gather** of the ``[S, H, K, K + V]`` slots, flat (:func:`~openk3.dist.cp_collectives.all_gather_flat`):
   ``H·K·(K+V)·4·S`` bytes sent per rank in fp32 (12 MiB for K3's 96 heads of 128, contiguous layout),
   whatever the sequence length;
3. **fold**: each local fragment's first piece, when it continues a document, enters with the state of its
   chain folded from zero (``S ← M_j S + E_j``, compute dtype: fp32, or fp64 for fp64 inputs);
4. **local run**: the ordinary :func:`~openk3.ops.kda.chunk.chunk_kda` over the local pieces with those entry
   states (the Triton kernels on CUDA when they apply), keeping its graph and the pieces' final states.

**Backward** (the reverse summaries): the cotangent ``dS_exit`` of a fragment's exit state is a fold of the
later fragments' entry-state cotangents through the transposed maps, ``dS_exit(c) = F_{j₁} + M_{j₁}ᵀ(F_{j₂} +
M_{j₂}ᵀ(…))`` over the fragments ``j₁, j₂, …`` whose chains hold ``c`` (stream order), where ``F_j`` is the
cotangent of ``j``'s entry state from ``j``'s own outputs. So:

1. the local backward of ``dO`` (exit cotangents zero) gives the inputs' gradients and ``F`` of each local
   fragment's first piece;
2. **one all-gather** of the ``[S, H, K, V]`` ``F`` (``H·K·V·4·S`` bytes per rank);
3. each rank folds ``dS_exit`` of its own summarised fragments from the gathered ``F`` and the forward's
   ``M`` (Horner, compute dtype);
4. a second local backward, of those ``dS_exit`` as the final states' cotangents (``dO`` zero), adds the
   gradients that reach the inputs through ``M`` and ``E``: ``S_exit = M S_in + E`` with ``S_in`` held (its
   cotangent already went to the predecessors in 3). Only ranks with a summarised fragment run it.

Its extra cost per step over an unsharded op is one summary forward without a graph plus at most one local
backward, instead of differentiating the summaries; the result equals autograd through the forward's steps
(tests: fp64 to 1e-12). Every rank runs the backward's all-gather (the op's output always depends on its
inputs).

Legend: ``T`` global tokens, ``L`` local tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``S`` slots
(fragments) per rank, ``W`` ranks, ``J = W·S`` all slots, ``N`` local pieces, ``X = K + V``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from openk3.dist.cp_collectives import all_gather_flat
from openk3.dist.cp_plan import ContextParallelPlan
from openk3.ops.kda import chunk_kda
from openk3.ops.kda.inputs import compute_dtype_of
from openk3.ops.kda.summary import fold_from_zero, segment_summaries


def summary_bytes(heads: int, key_dim: int, value_dim: int, slots: int = 1, element_size: int = 4) -> int:
    """Bytes one rank sends in the KCP forward all-gather of one layer: ``S·H·K·(K+V)`` summary values (fp32 by
    default), independent of the sequence length; each rank receives ``W`` times that. The backward's
    all-gather of the entry-state cotangents sends ``S·H·K·V`` values."""
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
    names = tuple(n for n, val in op_kwargs.items() if isinstance(val, torch.Tensor))
    static = {n: val for n, val in op_kwargs.items() if n not in names}
    inputs = (q, k, v, g, beta, *(op_kwargs[n] for n in names))
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    call = _Call(plan, group, chunk_size, static, names, differentiable)
    return _ContextParallelKDA.apply(call, *inputs)


@dataclass(frozen=True)
class _Call:
    """The non-tensor arguments of one KCP call: ``static`` keyword arguments of the op, the ``names`` of
    its tensor keyword arguments (passed positionally after q, k, v, g, beta), and whether autograd records
    the call (else the local op runs without a graph: the inference path)."""

    plan: ContextParallelPlan
    group: object
    chunk_size: int
    static: dict
    names: tuple[str, ...]
    differentiable: bool


class _ContextParallelKDA(torch.autograd.Function):
    """Forward and reverse-summary backward of the KCP core (module docstring); the local op's own graph is
    built inside the forward on detached copies of the inputs and differentiated twice in the backward."""

    @staticmethod
    def forward(ctx, call: _Call, *inputs: torch.Tensor) -> torch.Tensor:
        plan = call.plan
        q, k, v, g, beta, *params = inputs
        kwargs = dict(call.static, **dict(zip(call.names, params, strict=True)))
        _, _, H, K = q.shape
        V = v.shape[-1]
        dtype = compute_dtype_of(q, k, v, g, beta)
        slots = plan.local_slots()
        pieces = plan.fragment_pieces
        slots_SHKX = _local_summaries(
            (q, k, v, g, beta), plan.local_cu_seqlens, pieces, [s in plan.needed_slots for s in slots],
            call.chunk_size, kwargs, (H, K, V), dtype,
        )  # fmt: skip
        all_JHKX = all_gather_flat(slots_SHKX, call.group).reshape(-1, H, K, K + V)
        h0 = [all_JHKX.new_zeros(H, K, V)] * (len(plan.local_cu_seqlens) - 1)
        for slot, (first, _) in zip(slots, pieces, strict=True):
            if chain := plan.chain(slot):
                h0[first] = fold_from_zero(all_JHKX[chain])
        continues = call.differentiable and any(plan.chain(slot) for slot in slots)
        with torch.set_grad_enabled(call.differentiable):
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            h0_NHKV = torch.stack(h0).requires_grad_(continues)
            o, final_NHKV = chunk_kda(
                *leaves[:5], initial_state=h0_NHKV, output_final_state=True,
                cu_seqlens=plan.local_cu_seqlens.to(q.device), chunk_size=call.chunk_size, **call.static,
                **dict(zip(call.names, leaves[5:], strict=True)),
            )  # fmt: skip
        ctx.call = call
        ctx.graph = (leaves, h0_NHKV, o, final_NHKV, all_JHKX[..., :K]) if call.differentiable else None
        return o.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, dO: torch.Tensor):
        call, (leaves, h0_NHKV, o, final_NHKV, M_JHKK) = ctx.call, ctx.graph
        ctx.graph = None
        plan = call.plan
        slots = plan.local_slots()
        pieces = plan.fragment_pieces
        summarised = [s in plan.needed_slots for s in slots]
        wanted = [t for t in leaves if t.requires_grad]
        targets = wanted + ([h0_NHKV] if h0_NHKV.requires_grad else [])
        grads = torch.autograd.grad(o, targets, dO, retain_graph=any(summarised), allow_unused=True)
        dh0_NHKV = grads[-1] if h0_NHKV.requires_grad else None
        zero_HKV = final_NHKV.new_zeros(final_NHKV.shape[1:])
        F = [zero_HKV] * len(slots)
        for i, (slot, (first, _)) in enumerate(zip(slots, pieces, strict=True)):
            if plan.chain(slot) and dh0_NHKV is not None:
                F[i] = dh0_NHKV[first]
        F_JHKV = all_gather_flat(torch.stack(F), call.group).flatten(0, 1)
        grads = list(grads[: len(wanted)])
        if any(summarised):
            dfinal = [torch.zeros_like(zero_HKV)] * final_NHKV.shape[0]
            for slot, (_, last), want in zip(slots, pieces, summarised, strict=True):
                if want:
                    dfinal[last] = exit_cotangent(plan, slot, M_JHKK, F_JHKV)
            more = torch.autograd.grad(final_NHKV, wanted, torch.stack(dfinal), allow_unused=True)
            grads = [_add(a, b) for a, b in zip(grads, more, strict=True)]
        out = iter(grads)
        return None, *(next(out) if t.requires_grad else None for t in leaves)


def exit_cotangent(
    plan: ContextParallelPlan, slot: int, M_JHKK: torch.Tensor, F_JHKV: torch.Tensor
) -> torch.Tensor:
    """``dS_exit`` ``[H, K, V]`` of ``slot``'s last piece: ``F_{j₁} + M_{j₁}ᵀ(F_{j₂} + M_{j₂}ᵀ(…))`` over the
    slots ``j₁, j₂, …`` whose chains hold ``slot``, in stream order (Horner from the last; each ``j`` but the
    last lies wholly inside the document, so ``M_j`` is its whole map).

    Args:
        plan: the plan (chains are global). slot: a slot some chain holds. M_JHKK: every slot's ``M``.
        F_JHKV: every slot's entry-state cotangent from its own outputs (zeros where it has no chain).
    """
    after = sorted(
        (j for j in range(M_JHKK.shape[0]) if slot in plan.chain(j)), key=lambda j: plan.slot_range(j)[0]
    )
    G_HKV = F_JHKV[after[-1]]
    for j in reversed(after[:-1]):
        G_HKV = F_JHKV[j] + M_JHKK[j].transpose(-1, -2) @ G_HKV
    return G_HKV


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


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
    summaries_RHKX = segment_summaries(
        *picked, cu_seqlens=cu, chunk_size=chunk_size, **_summary_kwargs(op_kwargs)
    )
    out, r = [], 0
    for want in wanted:
        out.append(summaries_RHKX[r] if want else zero_HKX)
        r += want
    return torch.stack(out)


def _summary_kwargs(op_kwargs: dict) -> dict:
    """The op's keyword arguments that change the state map (``scale`` only scales q)."""
    return {n: val for n, val in op_kwargs.items() if n != "scale"}
