"""The MoonEP-contract dispatcher: executes :func:`~openk3.dist.moonep_planner.plan_moonep`'s plan.

Every EP rank computes exactly ``C = S·K`` expert rows per MoE layer, in a receive buffer ``[C, L]`` grouped
by expert, whatever the routing: the overflow of hot experts is computed on under-loaded ranks that hold
*redundant* copies of those experts for this forward. Same contract as Moonshot's MoonEP (fixed buffer,
redundant experts from one donor, same-rank dedupe), built here on plain ``torch.distributed`` collectives so
it runs on gloo and NCCL. Per MoE layer, on each rank ``s`` of an EP group of ``R`` ranks (``P = E/R``
experts homed per rank, expert ``e`` on rank ``e // P``):

1. **plan** (:func:`route`): the per-expert entry counts are all-gathered (``[R, E]``, one fixed-size
   collective), copied to the host (**host sync 1**: the planner is a Python function of the counts) and
   planned; ``S·K`` must be the same on every rank (else ``ValueError`` on every rank). Entry ``j`` of
   expert ``e`` in the global order (source rank, then the source's token order) is computed on the rank
   whose slice of ``alloc[e]`` (ranks in ascending order) holds ``j``, at a buffer row every rank can
   compute from the plan. The buffer of rank ``d`` holds its ``P`` home experts' segments, then the
   segments of its redundant experts (``experts_to_copy[d]``), each segment in the global entry order.
2. **same-rank dedupe**: a token whose entries go to the same rank sends its row there once; each entry
   sends (buffer row, index of its token's row, routing weight). The number of distinct rows per
   destination is exchanged with one ``all_to_all_single`` and read on the host (**host sync 2**: gloo's and
   NCCL's ``all_to_all_single`` take host split sizes; the entry counts need none, they follow from the plan).
3. **redundant-expert weights**: each donor sends the ``w1, w3, w2`` of the experts its receivers copy
   (one autograd ``all_to_all_single``, split sizes from the plan). The backward of that exchange returns
   the copies' gradients to the donor, where autograd adds them to the home experts' gradients.
4. **experts**: the rows are gathered into the buffer ``[C, L]`` (the backward sums the gradients of a
   deduplicated row's entries) and run through :func:`~openk3.model.moe.grouped_expert_ffn` over ``2P``
   expert slots (home, then copies zero-padded to ``P``): static shapes ``[C, L]`` and ``[2P, F, L]``.
5. **combine**: each entry's output times its routing weight in fp32, summed per (source token) on the
   computing rank, rounded once to the activation dtype and returned along the dedupe's rows (the reverse
   exchange); the source adds its ranks' partial sums in fp32.

The result equals the dense MoE and the all-to-all dispatcher up to fp32 rounding of the sums (a token's
entries are added per rank first; a redundant expert's weight gradient is summed on two ranks); the
expert outputs of each row are the dense path's. Dispatch is at the width of ``z`` (the latent width for
K3's LatentMoE).

Legend: ``N = S`` local tokens, ``k = K`` experts per token, ``M = N·k`` local entries, ``C`` entries
computed per rank (``= M``), ``U`` distinct (token, destination) rows sent, ``Q`` rows received,
``L`` dispatch width, ``F`` expert width, ``R`` EP ranks, ``E`` experts, ``P = E/R``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor, all_to_all_single_autograd

from openk3.dist.moonep_planner import MoonEPPlan, plan_moonep
from openk3.model.moe import grouped_expert_ffn


@dataclass
class MoonEPRoute:
    """One MoE layer's routing under the plan: what the dispatch, the weight copies and the combine send.

    Attributes:
        plan: the step's :class:`MoonEPPlan` (the same on every rank).
        token_U: local token of each distinct row sent, grouped by destination rank (int64 ``[U]``).
        entry_order_M: local entries (flat ``n·k + j``) grouped by destination rank (int64 ``[M]``).
        meta_M2: per sent entry, its buffer row at the destination and its row's index among the rows
            sent to that destination (int64 ``[M, 2]``, in ``entry_order_M``'s order).
        send_rows, recv_rows: distinct rows sent to / received from each rank (host ints).
        send_entries, recv_entries: entries sent to / received from each rank (host ints, from the plan).
        slot_sizes: rows of each of this rank's ``2P`` expert slots (host ints; sum ``C``).
        copy_send_idx: local experts this rank sends as redundant copies, grouped by receiver (int64).
        copy_send, copy_recv: experts sent to / received from each rank (host ints).
    """

    plan: MoonEPPlan
    token_U: torch.Tensor
    entry_order_M: torch.Tensor
    meta_M2: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]
    send_entries: list[int]
    recv_entries: list[int]
    slot_sizes: list[int]
    copy_send_idx: torch.Tensor
    copy_send: list[int]
    copy_recv: list[int]

    def rows_sent_remote(self, rank: int) -> int:
        """Distinct rows this rank sends to other ranks (the dispatch's wire traffic, in rows)."""
        return sum(self.send_rows) - self.send_rows[rank]


def dispatch_layout(plan: MoonEPPlan, tpe_RE: torch.Tensor):
    """Host-side tables every rank derives from the plan: ``[E, R]`` start of rank ``d``'s slice of expert
    ``e``'s entries, ``[E, R]`` buffer start of that slice at ``d``, ``[R, 2P]`` slot sizes, and the
    ``[R_src, R_dst]`` entry counts."""
    alloc = plan.alloc_ER  # [E, R]
    E, R = alloc.shape
    P = E // R
    slice_end = alloc.cumsum(1)
    slice_start = slice_end - alloc
    slot_expert = torch.cat([torch.arange(E).view(R, P), plan.experts_to_copy_RP], 1)  # [R, 2P], -1 unused
    ranks = torch.arange(R).view(R, 1).expand(R, 2 * P)
    slot_sizes = torch.where(slot_expert >= 0, alloc[slot_expert.clamp(min=0), ranks], 0)
    slot_start = slot_sizes.cumsum(1) - slot_sizes
    buf_start = torch.zeros(E, R, dtype=torch.int64)
    used = slot_expert >= 0
    buf_start[slot_expert[used], ranks[used]] = slot_start[used]
    first = tpe_RE.cumsum(0) - tpe_RE  # [R, E] global index of source s's first entry of e
    lo = torch.maximum(first[:, :, None], slice_start[None])
    hi = torch.minimum((first + tpe_RE)[:, :, None], slice_end[None])
    entries_RR = (hi - lo).clamp(min=0).sum(1)  # [R_src, R_dst]
    return slice_start, slice_end, buf_start, slot_sizes, entries_RR


def route(indices_Nk: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> MoonEPRoute:
    """Plan this layer and compute where each local entry goes (steps 1-2 of the module docstring).

    Collective over ``group``: an all-gather of the counts, one small all-to-all. Two host syncs. Raises
    ``ValueError`` on every rank when the ranks route different numbers of entries ``S·K``.
    """
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E = num_experts
    P = E // R
    device = indices_Nk.device
    N, k = indices_Nk.shape
    expert_M = indices_Nk.reshape(-1)
    M = expert_M.numel()
    counts_E = torch.bincount(expert_M, minlength=E)
    tpe_RE = (
        all_gather_tensor(counts_E, 0, group).view(R, E).cpu()
    )  # host sync 1: the planner runs on the host
    sent = tpe_RE.sum(1)
    if (sent != sent[0]).any():
        raise ValueError(
            f"MoonEP needs the same S·K entries on every EP rank; the ranks route {sent.tolist()} "
            "(equal micro-batches per rank)"
        )
    plan = plan_moonep(tpe_RE, int(sent[0]))
    slice_start, slice_end, buf_start, slot_sizes, entries_RR = dispatch_layout(plan, tpe_RE)
    # destination rank and buffer row of each local entry (device)
    order_M = torch.argsort(expert_M, stable=True)
    e_M = expert_M[order_M]
    first_E = (tpe_RE.cumsum(0) - tpe_RE)[rank].to(device)
    within_M = torch.arange(M, device=device) - (counts_E.cumsum(0) - counts_E)[e_M]
    pos_M = first_E[e_M] + within_M
    dest_M = (pos_M[:, None] >= slice_end.to(device)[e_M]).sum(1)
    row_M = buf_start.to(device)[e_M, dest_M] + pos_M - slice_start.to(device)[e_M, dest_M]
    dest_flat = torch.empty_like(dest_M).index_copy_(0, order_M, dest_M)
    row_flat = torch.empty_like(row_M).index_copy_(0, order_M, row_M)
    # same-rank dedupe: one row per distinct (destination, token), sorted by destination then token
    token_flat = torch.arange(M, device=device) // k
    pairs_U, which_M = torch.unique(dest_flat * N + token_flat, return_inverse=True)
    dest_U = pairs_U // N
    rows_R = torch.bincount(dest_U, minlength=R)
    recv_rows_R = torch.empty_like(rows_R)
    dist.all_to_all_single(recv_rows_R, rows_R, group=group)
    send_rows, recv_rows = torch.stack([rows_R, recv_rows_R]).tolist()  # host sync 2: split sizes
    local_U = which_M - (rows_R.cumsum(0) - rows_R)[dest_flat]
    entry_order_M = torch.argsort(dest_flat, stable=True)
    meta_M2 = torch.stack([row_flat, local_U], 1)[entry_order_M]
    donor = plan.donor_R.tolist()
    copies = plan.experts_to_copy_RP
    receivers = [d for d in range(R) if donor[d] == rank]
    copy_send_idx = (
        torch.cat([copies[d][copies[d] >= 0] - rank * P for d in receivers])
        if receivers
        else torch.zeros(0, dtype=torch.int64)
    )
    n_copies = (copies >= 0).sum(1).tolist()
    return MoonEPRoute(
        plan=plan,
        token_U=pairs_U % N,
        entry_order_M=entry_order_M,
        meta_M2=meta_M2,
        send_rows=send_rows,
        recv_rows=recv_rows,
        send_entries=entries_RR[rank].tolist(),
        recv_entries=entries_RR[:, rank].tolist(),
        slot_sizes=slot_sizes[rank].tolist(),
        copy_send_idx=copy_send_idx.to(device),
        copy_send=[n_copies[d] if donor[d] == rank else 0 for d in range(R)],
        copy_recv=[n_copies[rank] if donor[rank] == s else 0 for s in range(R)],
    )


def _redundant_weights(w1_PFL, w3_PFL, w2_PLF, r: MoonEPRoute, group):
    """This rank's expert stacks over ``2P`` slots: home experts, then the redundant copies received from
    the donor (zero-padded to ``P``). Differentiable: the copies' gradients go back to the donor."""
    P, F, L = w1_PFL.shape
    if int(r.plan.donor_R.max()) < 0:  # no rank copies: no exchange (the plan is the same on every rank)
        copies = w1_PFL.new_zeros(0, 3 * F * L)
    else:  # every rank of the group takes part when any rank copies
        packed = torch.cat([w.reshape(P, -1) for w in (w1_PFL, w3_PFL, w2_PLF)], 1)[r.copy_send_idx]
        copies = all_to_all_single_autograd(packed, r.copy_recv, r.copy_send, group)
    pad = w1_PFL.new_zeros(P - copies.shape[0], copies.shape[1])
    c1, c3, c2 = torch.cat([copies, pad]).split(F * L, 1)
    return (
        torch.cat([w1_PFL, c1.reshape(P, F, L)]),
        torch.cat([w3_PFL, c3.reshape(P, F, L)]),
        torch.cat([w2_PLF, c2.reshape(P, L, F)]),
    )


def moonep_experts(
    config,
    z_NL: torch.Tensor,
    weights_Nk: torch.Tensor,
    indices_Nk: torch.Tensor,
    w1_PFL: torch.Tensor,
    w3_PFL: torch.Tensor,
    w2_PLF: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
    x_quant=None,
    r: MoonEPRoute | None = None,
) -> torch.Tensor:
    """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])`` (``[N, L]``, ``z``'s dtype) over the EP ``group``,
    this rank holding experts ``rank·P … rank·P + P − 1`` (``w1, w3 [P, F, L]``, ``w2 [P, L, F]``).

    Same contract as :func:`openk3.dist.dispatch.alltoall_experts` (``x_quant`` included). ``r`` is this
    layer's :func:`route` (computed here when ``None``; the benchmark times it apart). All ranks of ``group`` must call together.
    """
    if r is None:
        r = route(indices_Nk, num_experts, group)
    P = w1_PFL.shape[0]
    device = z_NL.device
    x_UL = z_NL[r.token_U]
    x_QL = all_to_all_single_autograd(x_UL, r.recv_rows, r.send_rows, group)
    w_M = weights_Nk.reshape(-1)[r.entry_order_M].float()
    w_C = all_to_all_single_autograd(w_M, r.recv_entries, r.send_entries, group)
    meta_C2 = torch.empty(sum(r.recv_entries), 2, dtype=torch.int64, device=device)
    dist.all_to_all_single(meta_C2, r.meta_M2, r.recv_entries, r.send_entries, group=group)
    src_C = torch.repeat_interleave(
        torch.arange(len(r.recv_entries), device=device),
        torch.tensor(r.recv_entries, device=device),
        output_size=meta_C2.shape[0],
    )
    recv_offset = torch.tensor(r.recv_rows, device=device).cumsum(0) - torch.tensor(
        r.recv_rows, device=device
    )
    buf_order = torch.argsort(meta_C2[:, 0])  # received entry of each buffer row
    q_C = (recv_offset[src_C] + meta_C2[:, 1])[buf_order]  # received row of each buffer row
    x_CL = x_QL[q_C]
    slots = torch.tensor(r.slot_sizes, device=device)
    offs = slots.cumsum(0).to(torch.int32)
    slot_C = torch.repeat_interleave(torch.arange(2 * P, device=device), slots, output_size=x_CL.shape[0])
    w1, w3, w2 = _redundant_weights(w1_PFL, w3_PFL, w2_PLF, r, group)
    y_CL = grouped_expert_ffn(config, x_CL, w1, w3, w2, offs, slot_C, x_quant)
    partial_QL = torch.zeros(x_QL.shape[0], y_CL.shape[1], dtype=torch.float32, device=device)
    partial_QL = partial_QL.index_add(0, q_C, y_CL.float() * w_C[buf_order, None]).to(y_CL.dtype)
    back_UL = all_to_all_single_autograd(partial_QL, r.send_rows, r.recv_rows, group)
    out_NL = torch.zeros(z_NL.shape[0], back_UL.shape[1], dtype=torch.float32, device=device)
    return out_NL.index_add(0, r.token_U, back_UL.float()).to(z_NL.dtype)
