"""The dropless all-to-all token dispatcher for expert parallelism (the oracle of the EP tests).

Per MoE layer, on each rank of an EP group of ``R`` ranks (rank ``r`` holds experts ``r·P … r·P + P − 1``,
``P = E/R``), following torchtitan's standard dispatcher:

1. **permute**: the rank's ``(token, k)`` entries sorted by global expert (stable), so by destination rank
   and then by local expert;
2. **count exchange**: an ``all_to_all_single`` of the per-expert counts ``[R, P]``; then one host sync
   (``.tolist()``) for the split sizes the token exchange needs (NCCL and gloo both take host split sizes);
3. **token exchange**: an autograd ``all_to_all_single`` of the rows at the width of ``z`` (the latent
   width for K3's LatentMoE);
4. **expert-major permute** of the received rows (source-major on arrival), grouped experts, the inverse
   permute, the reverse all-to-all;
5. **combine**: the entries back in ``(token, k)`` order, each output times its routing weight in fp32, the
   ``k`` products of a token summed in one reduction, cast back to ``z``'s dtype.

Both permutes go through the dense path's own gather (:class:`~openk3.model.moe.SortedRows`: gathers
forward and backward, each token's ``k`` gradient rows summed in one reduction), so the arithmetic, and its
order, is the dense block's.

No token is dropped and nothing is padded; the receive buffer's size follows the routing (``Σ`` of what
the rank's experts were chosen for), which is what the MoonEP-contract dispatcher fixes to ``S·K``.
In fp32 the result is bitwise the dense :class:`~openk3.model.moe.RoutedExperts` on the concatenated batch:
each expert sees its rows in the same order (source rank, then token), and each token sums its ``k``
products (and gradient rows) in the same ``(token, k)`` order as :func:`~openk3.model.moe.combine_sorted`.

Legend: ``N`` local tokens, ``k`` experts per token, ``M = N·k`` entries, ``L`` width, ``R`` EP ranks,
``P`` experts per rank, ``Q`` rows received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from openk3.model.moe import SortedRows, grouped_expert_ffn


@dataclass
class Dispatched:
    """What :func:`dispatch` hands the local experts, and what :func:`combine` needs to undo it.

    Attributes:
        x_QL: received rows, sorted by local expert (``[Q, L]``).
        offs_P: int32 ``[P]`` cumulative rows per local expert.
        expert_Q: local expert of each received row (int64 ``[Q]``).
        order_M: the permutation that sorted the local entries by expert.
        rank_M: its inverse (the sorted position of each ``(token, k)`` entry).
        token_M: token of each sorted local entry.
        perm_Q: received position of each expert-major row.
        send_splits, recv_splits: rows sent to / received from each rank (host ints).
        bytes_sent: bytes of token rows this rank sent (for the benchmark).
    """

    x_QL: torch.Tensor
    offs_P: torch.Tensor
    expert_Q: torch.Tensor
    order_M: torch.Tensor
    rank_M: torch.Tensor
    token_M: torch.Tensor
    perm_Q: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    bytes_sent: int


def dispatch(
    z_NL: torch.Tensor, indices_Nk: torch.Tensor, num_experts: int, group: dist.ProcessGroup
) -> Dispatched:
    """Send each entry's row to the rank holding its expert; return the rows grouped by local expert."""
    R = dist.get_world_size(group)
    P = num_experts // R
    k = indices_Nk.shape[1]
    expert_M = indices_Nk.reshape(-1)
    order_M = torch.argsort(expert_M, stable=True)
    rank_M = torch.empty_like(order_M).scatter_(
        0, order_M, torch.arange(order_M.numel(), device=order_M.device)
    )
    token_M = order_M // k
    counts_RP = torch.bincount(expert_M, minlength=num_experts).view(R, P)
    recv_counts_RP = torch.empty_like(counts_RP)
    dist.all_to_all_single(recv_counts_RP, counts_RP, group=group)
    send_splits = counts_RP.sum(1).tolist()  # the host sync the split sizes need
    recv_splits = recv_counts_RP.sum(1).tolist()
    x_ML = SortedRows.apply(z_NL, order_M, rank_M, k)
    x_QL = all_to_all_single_autograd(x_ML, recv_splits, send_splits, group)
    # arrival order: source rank, then local expert; make it expert-major (stable keeps source order)
    local_Q = torch.repeat_interleave(
        torch.arange(P, device=z_NL.device).repeat(R), recv_counts_RP.reshape(-1), output_size=x_QL.shape[0]
    )
    perm_Q = torch.argsort(local_Q, stable=True)
    offs_P = torch.cumsum(recv_counts_RP.sum(0), 0).to(torch.int32)
    return Dispatched(
        x_QL[perm_Q],
        offs_P,
        local_Q[perm_Q],
        order_M,
        rank_M,
        token_M,
        perm_Q,
        send_splits,
        recv_splits,
        x_ML.numel() * x_ML.element_size(),
    )


def combine(y_QL: torch.Tensor, weights_Nk: torch.Tensor, d: Dispatched, group: dist.ProcessGroup, N: int):
    """Return each entry's expert output to its token: ``Σ_k w[n,k]·y`` in fp32, ``[N, L]`` in ``y``'s dtype."""
    back_QL = torch.empty_like(y_QL).index_copy(0, d.perm_Q, y_QL)  # inverse of the expert-major permute
    y_ML = all_to_all_single_autograd(back_QL, d.send_splits, d.recv_splits, group)
    y_NkL = SortedRows.apply(y_ML, d.rank_M, d.order_M, 1).view(N, weights_Nk.shape[1], -1)
    acc = torch.promote_types(y_NkL.dtype, torch.float32)
    return (y_NkL.to(acc) * weights_Nk.to(acc).unsqueeze(-1)).sum(1).to(y_QL.dtype)


def alltoall_experts(
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
) -> torch.Tensor:
    """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])`` (``[N, L]``, ``z``'s dtype) over the EP ``group``:
    :func:`dispatch`, the local experts (``w1, w3 [P, F, L]``, ``w2 [P, L, F]``; GEMM inputs through
    ``x_quant`` as in :func:`~openk3.model.moe.grouped_expert_ffn`), :func:`combine`."""
    d = dispatch(z_NL, indices_Nk, num_experts, group)
    y_QL = grouped_expert_ffn(config, d.x_QL, w1_PFL, w3_PFL, w2_PLF, d.offs_P, d.expert_Q, x_quant)
    return combine(y_QL, weights_Nk, d, group, z_NL.shape[0])
