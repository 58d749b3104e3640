"""MLA under context parallelism: all-gather the latents, mask by global position.

Every query needs every earlier key of its document. K3's MLA keys and values are functions of the per-token
latent ``[c | k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 = 576 numbers), far fewer than the
expanded per-head keys and values (``H·(n + r + v)``), so the latents are what moves
(``docs/references.md#kda-context-parallel``): one differentiable all-gather
(:func:`~openk3.dist.cp_collectives.all_gather_flat`; its backward returns each latent's gradient to its
rank), then the layer's own attention over all ``W·L`` gathered tokens with the mask
``pos_q ≥ pos_k and doc(q) = doc(k)`` by global position, so no reordering is needed for zig-zag. The
positions are never rotated (NoPE), so nothing else depends on where a token sits.

Legend: ``L`` local tokens (queries), ``S = W·L`` gathered tokens (keys), ``C`` kv_lora_rank, ``r`` qk_rope,
``W`` ranks.
"""

from __future__ import annotations

import torch

from openk3.dist.cp_collectives import all_gather_flat
from openk3.dist.cp_plan import ContextParallelPlan


def gather_latents(
    c_1LC: torch.Tensor, k_pe_1Lr: torch.Tensor, plan: ContextParallelPlan, group=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c_1SC, k_pe_1Sr, mask_LS)``: every rank's latents (rank order) and the boolean mask (True = attend)
    of this rank's queries over them. Collective over ``group``, forward and backward."""
    C = c_1LC.shape[-1]
    latent_1LX = torch.cat([c_1LC, k_pe_1Lr.to(c_1LC.dtype)], dim=-1)
    gathered_W1LX = all_gather_flat(latent_1LX, group)
    latent_1SX = gathered_W1LX.reshape(1, -1, latent_1LX.shape[-1])
    device = c_1LC.device
    key_pos_S = torch.cat([plan.positions(r) for r in range(plan.world)]).to(device)
    query_pos_L = plan.positions().to(device)
    cu = torch.tensor(plan.cu_seqlens, dtype=torch.int64, device=device)
    doc_S = torch.searchsorted(cu[1:], key_pos_S, right=True)
    doc_L = torch.searchsorted(cu[1:], query_pos_L, right=True)
    mask_LS = (query_pos_L[:, None] >= key_pos_S[None, :]) & (doc_L[:, None] == doc_S[None, :])
    return latent_1SX[..., :C], latent_1SX[..., C:].to(k_pe_1Lr.dtype), mask_LS
