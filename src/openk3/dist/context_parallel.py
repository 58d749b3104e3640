"""Context parallelism applied to a single-device model from outside (torchtitan's way).

``apply_context_parallel(model, group, layout)`` turns every KDA layer into :class:`ContextParallelKDA` and
every MLA layer into :class:`ContextParallelMLA` (same parameters, same state-dict names: only two seams of
each are overridden) and returns the :class:`ContextParallel` they share. Per sequence::

    cp = apply_context_parallel(model, group=cp_group, layout="zigzag")
    plan = cp.begin(cu_seqlens)            # the global document offsets of the packed row
    logits = model(plan.shard(ids_1T))     # this rank's tokens; logits of this rank's tokens
    loss = cross_entropy(logits, plan.shard(labels_1T))

* KDA: the short convolutions' halo (:mod:`~openk3.dist.cp_conv`) and the KCP core (:mod:`~openk3.dist.kcp`),
  one all-gather each per layer and direction;
* MLA: the latent all-gather with the global-position mask (:mod:`~openk3.dist.cp_mla`);
* everything else (embeddings, norms, Block AttnRes, the MoE, the head) is token-local and unchanged.

Under CP the model is called with ``cu_seqlens=None`` and no cache: the documents come from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from openk3.dist.cp_conv import context_parallel_short_convolutions
from openk3.dist.cp_mla import gather_latents
from openk3.dist.cp_plan import LAYOUTS, ContextParallelPlan
from openk3.dist.kcp import check_context_parallel_call, context_parallel_kda
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import MultiheadLatentAttention


@dataclass
class ContextParallel:
    """The CP group and layout shared by a model's CP layers, and the plan of the sequence being run.

    Attributes:
        group: the CP process group (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``.
        plan: set by :meth:`begin` before each forward; None until then.
    """

    group: object = None
    layout: str = "contiguous"
    plan: ContextParallelPlan | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")

    def begin(self, cu_seqlens: torch.Tensor | list[int]) -> ContextParallelPlan:
        """Plan the next packed sequence (global document offsets, the same on every rank) and return it.

        Raises ``ValueError`` (no collective) when the layout cannot split its length over the group."""
        offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.plan = ContextParallelPlan(tuple(offsets), world, rank, self.layout)
        return self.plan

    def current(self, local_len: int, batch: int) -> ContextParallelPlan:
        """The plan, checked against a layer's local row (raises ``ValueError`` before any collective)."""
        if self.plan is None:
            raise ValueError("context parallelism: call ContextParallel.begin(cu_seqlens) before the forward")
        check_context_parallel_call(self.plan, self.group, local_len, batch)
        return self.plan


def _refuse_extras(cache, cu_seqlens) -> None:
    if cache is not None or cu_seqlens is not None:
        raise ValueError(
            "under context parallelism the model runs without a cache and with cu_seqlens=None "
            "(the documents come from ContextParallel.begin)"
        )


class ContextParallelKDA(KimiDeltaAttention):
    """A KDA layer whose convolutions and core run over a sequence split across the CP group."""

    context_parallel: ContextParallel

    def short_convolutions(self, qkv_BT3P, conv_B3PW, cu_seqlens, keep):
        _refuse_extras(keep or None, cu_seqlens)  # keep: the layer was given a cache
        plan = self.context_parallel.current(qkv_BT3P.shape[1], qkv_BT3P.shape[0])
        convs = [self.q_conv1d, self.k_conv1d, self.v_conv1d]
        xs = list(qkv_BT3P.chunk(3, -1))
        q_BTP, k_BTP, v_BTP = context_parallel_short_convolutions(
            convs, xs, plan, self.context_parallel.group
        )
        return q_BTP, k_BTP, v_BTP, None

    def kda_core(self, q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, gate, cache, cu_seqlens):
        _refuse_extras(cache, cu_seqlens)
        cp = self.context_parallel
        o_BTHK = context_parallel_kda(
            q_BTHK, k_BTHK, v_BTHK, g_raw_BTHK, beta_logits_BTH, plan=cp.current(q_BTHK.shape[1], q_BTHK.shape[0]),
            group=cp.group, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate,
        )  # fmt: skip
        return o_BTHK, None


class ContextParallelMLA(MultiheadLatentAttention):
    """An MLA layer that attends over the latents of the whole sequence, gathered from the CP group."""

    context_parallel: ContextParallel

    def attended_latents(self, c_BTC, k_pe_BTr, cache, cu_seqlens):
        _refuse_extras(cache, cu_seqlens)
        cp = self.context_parallel
        plan = cp.current(c_BTC.shape[1], c_BTC.shape[0])
        return gather_latents(c_BTC, k_pe_BTr, plan, cp.group)


def apply_context_parallel(model: nn.Module, group=None, layout: str = "contiguous") -> ContextParallel:
    """Make every KDA and MLA layer of ``model`` context-parallel over ``group``; returns their shared
    :class:`ContextParallel`. Call before FSDP wraps the model. Raises ``ValueError`` for a KDA layer without
    the delta rule (the decay-only control mixer has no CP path)."""
    cp = ContextParallel(group=group, layout=layout)
    for module in model.modules():
        if type(module) is KimiDeltaAttention:
            if not module.delta_rule:
                raise ValueError(
                    "context parallelism needs the delta rule (linear_attn_config.delta_rule=True)"
                )
            module.__class__ = ContextParallelKDA
        elif type(module) is MultiheadLatentAttention:
            module.__class__ = ContextParallelMLA
        else:
            continue
        module.context_parallel = cp
    return cp
