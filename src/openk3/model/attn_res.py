"""Block Attention Residuals (AttnRes) as K3 wires them (``docs/references.md#block-attention-residuals``;
arXiv 2603.15031).

Depth mixing replaces the residual add: each sublayer reads a softmax-weighted mix of the completed
*block* sums ``b_0 .. b_{n-1}`` (``b_0`` = the token embedding) and the running partial sum of the current
block. The weights come from a learned per-layer pseudo-query ``w`` (``*_res_proj``, ``[1, D]``) scored
against RMS-normalised sources (``*_res_norm``, gain γ)::

    V = [b_0, …, b_{n-1}, partial]            # N sources
    score_i = RMSNorm_nogain(V_i) · (γ ⊙ w)
    h = Σ_i softmax(score)_i · V_i             # in fp32, cast back

A block is ``attn_res_block_size`` **decoder layers** (K3: 12, so 93 layers give 8 blocks); the
embedding is appended as block 0 at layer 0. The final output mix comes before the final norm.

Two-phase inference (:class:`TwoPhaseAttnRes`, the AttnRes paper's inference schedule,
``docs/references.md#block-attention-residuals``): the pseudo-queries do not depend on the input, so all
mixes that read the same completed blocks are scored against them in one batched pass (phase 1, per query:
the blocks' own mix ``μ_b = Σ softmax(z)_i v_i`` and their log-sum-exp ``ℓ_b = log Σ e^{z_i}``); each mix then
folds in its partial sum ``v_p`` with logit ``z_p`` (phase 2): the softmax over all ``N`` sources gives the
partial the weight ``p = e^{z_p} / (e^{ℓ_b} + e^{z_p}) = σ(z_p − ℓ_b)`` and the blocks together ``1 − p``, so::

    h = μ_b + σ(z_p − ℓ_b) · (v_p − μ_b)          # one lerp

Equal to :func:`attn_res_mix` up to rounding; the server's forward uses it. The contractions are products and
sums (fused reductions under ``torch.compile``, where an ``einsum``/``addmv`` of a decode step's few rows ran
as slow fp32 cuBLAS GEMMs and GEMVs); phase 1 eagerly stays an ``einsum``.

Legend: ``B`` batch, ``T`` tokens, ``D`` width, ``N`` sources (or completed blocks), ``Q`` mixes that read
one block set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.norm import RMSNorm, rms_normalize


def attn_res_mix(
    blocks: list[torch.Tensor], partial_BTD: torch.Tensor, norm: RMSNorm, proj: nn.Linear
) -> torch.Tensor:
    """Mix ``blocks`` (each ``[B, T, D]``) and ``partial_BTD`` with pseudo-query ``proj.weight`` ``[1, D]``.

    Returns ``[B, T, D]`` in ``partial_BTD.dtype``; the scores, softmax and sum run in fp32 (fp64 stays fp64),
    under autocast too: both contractions are products and sums, which autocast leaves in fp32 (a ``@`` or
    ``einsum`` would run in bf16 there, as a matrix-vector product and a batched product of ``N ≤ 8`` sources
    that cuBLAS runs on its slow paths: 192 + 192 + 192 gemv/sgemm calls, 55 ms of a k3-1b training step on an
    H200). Under ``torch.compile`` each becomes one fused reduction.
    """
    V_NBTD = torch.stack([*blocks, partial_BTD])
    compute = torch.float64 if V_NBTD.dtype == torch.float64 else torch.float32
    V_NBTD = V_NBTD.to(compute)
    query_D = norm.weight.to(compute) * proj.weight[0].to(compute)
    score_NBT = (rms_normalize(V_NBTD, norm.eps) * query_D).sum(-1)
    p_NBT = torch.softmax(score_NBT, dim=0)
    return (p_NBT[..., None] * V_NBTD).sum(0).to(partial_BTD.dtype)


def make_res_pair(hidden_size: int, eps: float) -> tuple[RMSNorm, nn.Linear]:
    """One AttnRes site: ``(*_res_norm, *_res_proj)``; the pseudo-query starts at zero (uniform mix)."""
    proj = nn.Linear(hidden_size, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return RMSNorm(hidden_size, eps), proj


@dataclass
class MixSite:
    """One AttnRes mix of the model: its norm and pseudo-query, and how many completed blocks it reads."""

    norm: RMSNorm
    proj: nn.Linear
    num_blocks: int
    index: int = 0
    """Position of this mix among the mixes that read the same blocks (its row of the query stack)."""


def attn_res_sites(backbone: nn.Module) -> list[MixSite]:
    """Every mix :meth:`~openk3.model.modeling.KimiLinearModel.forward` runs, in the order of the K3 wiring
    (``docs/references.md#decoder-wiring``): each layer's ``self_attention_res`` (from the second layer on) and
    ``mlp_res`` mixes, then the output mix; ``index`` numbered within each block count."""
    sites: list[MixSite] = []
    n = 0
    for i, layer in enumerate(backbone.layers):
        if n:
            sites.append(MixSite(layer.self_attention_res_norm, layer.self_attention_res_proj, n))
        if i % layer.block_size == 0:
            n += 1
        sites.append(MixSite(layer.mlp_res_norm, layer.mlp_res_proj, n))
    sites.append(MixSite(backbone.output_attn_res_norm, backbone.output_attn_res_proj, n))
    counts: dict[int, int] = {}
    for site in sites:
        site.index = counts.get(site.num_blocks, 0)
        counts[site.num_blocks] = site.index + 1
    return sites


class TwoPhaseAttnRes:
    """:func:`attn_res_mix`'s drop-in for one forward (same call), computing phase 1 once per block count.

    ``sites`` from :func:`attn_res_sites`; a mix is found by its ``proj`` module. Scores in fp32 (fp64 stays).
    Raises ``ValueError`` when the norms reading one block set differ in eps, or a mix is not a site or reads
    another number of blocks than its site."""

    def __init__(self, sites: list[MixSite]) -> None:
        self.sites = {id(s.proj): s for s in sites}
        self.groups: dict[int, list[MixSite]] = {}
        for s in sorted(sites, key=lambda s: s.index):
            self.groups.setdefault(s.num_blocks, []).append(s)
        for group in self.groups.values():
            if any(s.norm.eps != group[0].norm.eps for s in group):
                raise ValueError("AttnRes norms reading one block set must share eps for the two-phase mix")
        self.stats: dict[int, tuple[torch.Tensor, ...]] = {}

    def _phase1(
        self, blocks: list[torch.Tensor], compute: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``q_QD`` (the group's queries), ``neg_lse_QBT`` (−ℓ_b) and ``mix_QBTD`` (μ_b), all in ``compute``, each
        unbound into its ``Q`` rows (a mix then takes its row without an operator)."""
        group = self.groups[len(blocks)]
        gain_QD = torch.stack([s.norm.weight for s in group]).to(compute)
        q_QD = gain_QD * torch.stack([s.proj.weight[0] for s in group]).to(compute)
        v_NBTD = torch.stack(blocks).to(compute)
        x_NBTD = rms_normalize(v_NBTD, group[0].norm.eps)
        if torch.compiler.is_compiling():  # products and sums, each one fused reduction (see attn_res_mix)
            z_QNBT = (q_QD[:, None, None, None, :] * x_NBTD).sum(-1)
            mix_QBTD = (torch.softmax(z_QNBT, 1)[..., None] * v_NBTD).sum(1)
        else:  # eagerly the products would hold Q·N·B·T·D numbers (a prefill chunk: gigabytes)
            z_QNBT = torch.einsum("qd,nbtd->qnbt", q_QD, x_NBTD)
            mix_QBTD = torch.einsum("qnbt,nbtd->qbtd", torch.softmax(z_QNBT, 1), v_NBTD)
        return q_QD.unbind(0), torch.logsumexp(z_QNBT, 1).neg().unbind(0), mix_QBTD.unbind(0)

    def __call__(
        self, blocks: list[torch.Tensor], partial_BTD: torch.Tensor, norm: RMSNorm, proj: nn.Linear
    ) -> torch.Tensor:
        site = self.sites.get(id(proj))
        if site is None or site.num_blocks != len(blocks):
            raise ValueError(f"no AttnRes site reads {len(blocks)} blocks with this pseudo-query")
        compute = torch.float64 if partial_BTD.dtype == torch.float64 else torch.float32
        if site.num_blocks not in self.stats:
            self.stats[site.num_blocks] = self._phase1(blocks, compute)
        q_D, neg_lse_BT, mix_BTD = (rows[site.index] for rows in self.stats[site.num_blocks])
        v_BTD = partial_BTD.to(compute)
        z_BT = neg_lse_BT + (rms_normalize(v_BTD, site.norm.eps) * q_D).sum(-1)
        p_BT1 = torch.sigmoid(z_BT)[..., None]  # σ(z_p − ℓ_b)
        return torch.lerp(mix_BTD, v_BTD, p_BT1).to(partial_BTD.dtype)
