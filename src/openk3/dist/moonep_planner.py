"""The MoonEP-contract planner: every EP rank computes exactly ``S·K`` expert rows, whatever the routing.

MoonEP (Moonshot's EP library; the greedy planner of its readable torch reference, ``planning_reference.py``)
keeps the expert GEMMs static by moving the overflow of hot experts onto under-loaded ranks, which hold
*redundant* copies of those experts for one step. This is that planner as a pure, deterministic function of
the gathered counts, so every rank computes the same plan with no further communication.

Algorithm (``R`` ranks, ``E`` experts, ``epn = E/R`` experts homed per rank, expert ``e`` homed on rank
``e // epn``, capacity ``CAP = S·K``; each source rank sends exactly ``CAP`` (token, k) entries):

1. ``load[e] = Σ_src tpe[src, e]``; ``balance[h] = Σ_{e homed on h} load[e] − CAP`` (``Σ balance = 0``).
2. Start from every expert at home: ``alloc[e, home(e)] = load[e]``.
3. Greedy surplus → deficit: while ``max(balance) > 0``, the donor ``h = argmax(balance)`` fills the
   receiver ``u = argmin(balance)`` completely: ``quota[h, u] = −balance[u]``, ``balance[h] −= quota``,
   ``balance[u] = 0``. A receiver is zeroed for good, so each rank receives from at most one donor, and
   there are at most ``R`` rounds; at the end every balance is 0, i.e. every rank holds exactly ``CAP``.
4. Each donor splits its quotas into experts: repeatedly the largest remaining quota (receiver ``d``) takes
   ``min(rest, quota)`` entries of the donor's expert with the most entries still at home.

Ties break to the lowest index (``argmax`` / ``argmin`` return the first), so the plan is deterministic.
Consequences (tested): conservation ``alloc.sum(1) == load``; ``alloc.sum(0) == CAP`` on every rank; the
redundant experts of a rank all come from one donor, so there are at most ``epn`` of them; at most
``2·epn`` non-empty expert segments per rank.

Legend: ``R`` ranks, ``E`` experts, ``P = epn`` experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoonEPPlan:
    """One step's placement of expert rows.

    Attributes:
        alloc_ER: int64 ``[E, R]``: entries of expert ``e`` computed on rank ``d``.
        donor_R: int64 ``[R]``: the home rank whose experts rank ``d`` holds redundant copies of (``-1``: none).
        experts_to_copy_RP: int64 ``[R, epn]``: the redundant experts of each rank, ascending, ``-1``-padded.
        capacity: ``CAP = S·K``, rows every rank computes.
    """

    alloc_ER: torch.Tensor
    donor_R: torch.Tensor
    experts_to_copy_RP: torch.Tensor
    capacity: int

    @property
    def experts_per_rank(self) -> int:
        return self.experts_to_copy_RP.shape[1]


def plan_moonep(tpe_RE: torch.Tensor, capacity: int) -> MoonEPPlan:
    """Plan one step from the gathered per-source-rank, per-expert entry counts ``tpe_RE`` (int ``[R, E]``).

    ``capacity`` is ``S·K``, the entries each source sends (a token sends one entry per chosen expert, a
    repeated expert counting twice). Runs on the CPU in O(R² + E·R) Python steps (R ≤ a few hundred).
    Raises ``ValueError`` when ``E`` is not a multiple of ``R``, a count is negative, or a source rank's
    counts do not sum to ``capacity`` (the rank is named).
    """
    tpe = torch.as_tensor(tpe_RE).to(torch.int64).cpu()
    if tpe.ndim != 2:
        raise ValueError(f"tpe must be [R, E], got shape {tuple(tpe.shape)}")
    R, E = tpe.shape
    if E % R:
        raise ValueError(f"num_experts={E} is not divisible by the EP size R={R}")
    if (tpe < 0).any():
        raise ValueError("tpe has negative counts")
    sent = tpe.sum(1)
    bad = (sent != capacity).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rank {bad[0]} sends {int(sent[bad[0]])} entries, not capacity S·K = {capacity}")
    P = E // R
    load = tpe.sum(0).tolist()
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][e // P] = load[e]
    balance = [sum(load[h * P : (h + 1) * P]) - capacity for h in range(R)]
    quotas: dict[int, dict[int, int]] = {}
    donor = [-1] * R
    while True:
        h = max(range(R), key=lambda i: (balance[i], -i))
        if balance[h] <= 0:
            break
        u = min(range(R), key=lambda i: (balance[i], i))
        quotas.setdefault(h, {})[u] = -balance[u]
        donor[u] = h
        balance[h] += balance[u]
        balance[u] = 0
    for h, qs in sorted(quotas.items()):
        rest = {e: alloc[e][h] for e in range(h * P, (h + 1) * P)}
        while any(qs.values()):
            d = max(qs, key=lambda i: (qs[i], -i))
            e = max(rest, key=lambda i: (rest[i], -i))
            moved = min(rest[e], qs[d])
            rest[e] -= moved
            qs[d] -= moved
            alloc[e][h] -= moved
            alloc[e][d] += moved
    alloc_ER = torch.tensor(alloc, dtype=torch.int64)
    copies = torch.full((R, P), -1, dtype=torch.int64)
    for d in range(R):
        remote = [e for e in range(E) if alloc[e][d] > 0 and e // P != d]
        copies[d, : len(remote)] = torch.tensor(remote, dtype=torch.int64)
    return MoonEPPlan(alloc_ER, torch.tensor(donor, dtype=torch.int64), copies, capacity)
