"""The short convolutions' halo under context parallelism.

A causal depthwise convolution of width ``W`` reads the ``W − 1`` inputs before each token. A fragment whose
first document started earlier needs the ``W − 1`` tokens before its start, which sit at the end of earlier
fragments (possibly several, when fragments are shorter than ``W − 1``). Every rank contributes the last
``W − 1`` inputs of each of its fragments (all convolutions of the layer side by side, one tensor), one
differentiable all-gather shares them (:func:`~openk3.dist.cp_collectives.all_gather_flat`, whose backward
returns each tail's gradient to its rank), and each fragment runs the layer's own convolution over
``[halo | fragment]`` with the documents cut by global position, so a tap never reads another document
(``docs/references.md#kda-context-parallel``). Every rank joins the backward, needed or not.

Legend: ``L`` local tokens, ``C`` channels (all convolutions together), ``S`` fragments per rank, ``R`` halo
rows (``W − 1``), ``E`` rows of the extended local row (``S·R + L``).
"""

from __future__ import annotations

import torch

from openk3.dist.cp_collectives import all_gather_flat, keep_in_backward
from openk3.dist.cp_plan import ContextParallelPlan
from openk3.model.short_conv import ShortConvolution


def context_parallel_short_convolutions(
    convs: list[ShortConvolution], xs_1LC: list[torch.Tensor], plan: ContextParallelPlan, group=None
) -> list[torch.Tensor]:
    """Each ``convs[i](xs_1LC[i])`` (conv then SiLU) on this rank's tokens as on the unsharded row.

    Args:
        convs: convolutions of one kernel width ``W``. xs_1LC: their inputs ``[1, L, C_i]``, this rank's rows.
        plan: this rank's plan. group: the CP process group (None: the world).

    Returns:
        ``[1, L, C_i]`` outputs, in the inputs' dtype. Collective over ``group`` (forward and backward).
    """
    widths = {conv.kernel_size for conv in convs}
    if len(widths) != 1:
        raise ValueError(f"the convolutions must share one kernel width; got {sorted(widths)}")
    R = widths.pop() - 1
    x_LC = torch.cat(xs_1LC, dim=-1)[0]
    frags = plan.fragments[plan.rank]
    offsets = [0]
    for s, e in frags:
        offsets.append(offsets[-1] + e - s)
    tails = []
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        tail_RC = x_LC[max(a, b - R) : b]
        tails.append(torch.cat([tail_RC.new_zeros(R - tail_RC.shape[0], tail_RC.shape[1]), tail_RC]))
    gathered = all_gather_flat(torch.stack(tails), group)  # [W, S, R, C]
    rows_C = torch.cat([gathered.reshape(-1, x_LC.shape[1]), x_LC.new_zeros(1, x_LC.shape[1])])
    sentinel = rows_C.shape[0] - 1
    pieces, positions = [], []
    for (s, e), (a, b), sources in zip(
        frags, zip(offsets[:-1], offsets[1:], strict=True), plan.halo_sources(R), strict=True
    ):
        index = [sentinel if src is None else src[0] * R + src[1] for src in sources]
        pieces += [rows_C.index_select(0, torch.tensor(index, device=x_LC.device)), x_LC[a:b]]
        positions += list(range(s - R, e))
    x_EC = torch.cat(pieces) + keep_in_backward(gathered)
    cu_ext = _runs(plan, positions, [len(range(s - R, e)) for s, e in frags]).to(x_LC.device)
    keep = torch.cat(
        [
            torch.arange(i * R + a + R, i * R + b + R)
            for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))
        ]
    )
    keep = keep.to(x_LC.device)
    outs, c = [], 0
    for conv, x_1LC in zip(convs, xs_1LC, strict=True):
        width = x_1LC.shape[-1]
        y_1EC, _ = conv(x_EC[None, :, c : c + width], None, cu_ext)
        outs.append(y_1EC.index_select(1, keep))
        c += width
    return outs


def _runs(plan: ContextParallelPlan, positions: list[int], block_lens: list[int]) -> torch.Tensor:
    """``cu_seqlens`` of the extended row: a new run at each block start and wherever the document changes
    (positions before the stream form their own run)."""
    docs = [-1 if p < 0 else plan.document_of(p) for p in positions]
    starts = set()
    b = 0
    for n in block_lens:
        starts.add(b)
        b += n
    cu = [i for i in range(len(docs)) if i in starts or docs[i] != docs[i - 1]]
    return torch.tensor([*cu, len(docs)], dtype=torch.int64)
