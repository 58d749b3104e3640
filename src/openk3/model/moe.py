"""Stable LatentMoE (K3) and the plain MoE block (Kimi-Linear), with batched routed experts.

K3 order (``docs/references.md#stable-latentmoe``)::

    r = router(x)                                  # full width D (7168)
    z = routed_expert_down_proj(x)                 # D -> latent L (3584)
    e = Σ_k w_k · Expert_k(z)                      # SiTU-GLU experts L -> F (3072) -> L
    y = routed_expert_up_proj(routed_expert_norm(e)) + shared_experts(x)   # shared: one MLP, width 2F

Kimi-Linear has no latent path and no norm: ``y = Σ_k w_k · Expert_k(x) + shared_experts(x)``.

Expert compute is batched: token-slots are sorted by expert and run through a grouped matmul
(``torch.nn.functional.grouped_mm`` with per-expert offsets), with no per-expert Python loop and no host
sync; dispatch and combine are permutations (gathers forward and backward, no atomic scatter-add).
:func:`experts_loop_reference` is the readable loop kept as the test oracle.

A few tokens (decode: token-slots ``N·k`` no more than the experts ``E``, no gradient, under
``torch.compile``) take :func:`gathered_experts` instead: each slot reads its own expert's rows, which
Inductor fuses into two reduction kernels (gate/up with the GLU; down with the weighted sum over the ``k``
slots) where the sorted path launches a dozen (sort, inverse permutation, offsets, two gathers, three grouped
GEMMs with their set-up kernels, the combine). With ``N·k ≤ E`` no more expert weights are read than the
grouped GEMM reads.

Quantised experts (``docs/quantization.md``): with ``RoutedExperts.qat`` set (``openk3 train --qat mxfp4``) the
GEMMs see MXFP4 fake-quantised weights and MXFP8 fake-quantised inputs, with straight-through gradients;
:class:`openk3.quant.experts.MXFP4RoutedExperts` keeps the weights packed and dequantises them per forward.

Legend: ``N`` tokens, ``D`` width, ``L`` expert input width (latent or D), ``F`` expert width,
``E`` experts, ``k`` experts per token, ``M = N·k`` token-slots, ``R`` rows of a gathered tensor (N or M).
Official names: expert ``j`` is ``experts.{j}.w1`` (gate, ``[F, L]``), ``w3`` (up, ``[F, L]``),
``w2`` (down, ``[L, F]``); here they are stacked as ``experts.w1 [E, F, L]`` etc. (see checkpoint/names.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.model.activations import glu
from openk3.model.mlp import MLP
from openk3.model.norm import RMSNorm
from openk3.model.packing import PackedProjection, pack_linears, packed_or_none, project
from openk3.model.router import MoEGate, RouterOutput, few_token_slots
from openk3.model.routing_stats import COUNT_DTYPE, RoutingStats, accumulate_histogram_, histogram_range
from openk3.quant.mxfp4 import mxfp4_ste, mxfp8_ste

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor, expert_M: torch.Tensor):
    """Row ``m`` of ``x_MI`` times ``w_EOI[expert_M[m]]ᵀ``; rows are sorted by expert, ``offs_E`` = cumsum."""
    w_EOI = w_EOI.to(x_MI.dtype)  # under autocast the activations are bf16 and the master weights fp32
    eager_cpu = x_MI.device.type == "cpu" and not torch.compiler.is_compiling()
    if x_MI.dtype in _GROUPED_MM_DTYPES and (eager_cpu or x_MI.dtype != torch.float32):
        return F.grouped_mm(x_MI, w_EOI.transpose(1, 2), offs=offs_E)
    # dtypes grouped_mm lacks (fp64, CUDA fp32, and fp32 traced by torch.compile, whose fake grouped_mm
    # takes bf16 only): a gathered batched matmul, still loop-free
    return torch.bmm(w_EOI[expert_M], x_MI.unsqueeze(-1)).squeeze(-1)


def grouped_expert_ffn(config, x_ML, w1_EFL, w3_EFL, w2_ELF, offs_E, expert_M, x_quant=None) -> torch.Tensor:
    """The GLU experts on rows sorted by expert: ``w2_e · glu(w1_e x, w3_e x)`` for row ``x`` of expert ``e``.

    ``offs_E`` (int32 ``[E]``) is the cumulative row count per expert, ``expert_M`` the expert of each row.
    ``x_quant`` (optional) maps each GEMM input (``x`` and the GLU output) to what the GEMM reads, e.g. MXFP8
    fake quantisation. Shared by :class:`RoutedExperts` and the expert-parallel module (``openk3.dist``),
    which passes its local experts and the rows it received. Returns ``[M, L]`` in ``x_ML.dtype``.
    """
    q = x_quant or (lambda t: t)
    x_ML = q(x_ML)
    gate_MF = _grouped_linear(x_ML, w1_EFL, offs_E, expert_M)
    up_MF = _grouped_linear(x_ML, w3_EFL, offs_E, expert_M)
    return _grouped_linear(q(glu(config, gate_MF, up_MF)), w2_ELF, offs_E, expert_M)


class SortedRows(torch.autograd.Function):
    """``out[m] = x[order[m] // k]``: rows of ``x`` in the sorted slot order, each row of ``x`` read ``k`` times
    (dispatch: ``k`` = experts per token; combine: ``k = 1``, a plain permutation). The backward gathers the
    gradient back through the inverse permutation ``rank`` and sums each row's ``k`` copies: gathers only, no
    atomic scatter-add, so the gradient is deterministic and summed in one reduction (autograd's backward of
    ``x[index]`` would be an ``index_put`` with accumulation)."""

    @staticmethod
    def forward(ctx, x_RL, order_M, rank_M, k: int):
        ctx.save_for_backward(rank_M)
        ctx.k = k
        return x_RL.index_select(0, order_M // k if k > 1 else order_M)

    @staticmethod
    def backward(ctx, g_ML):
        (rank_M,) = ctx.saved_tensors
        g_RkL = g_ML.index_select(0, rank_M).view(-1, ctx.k, g_ML.shape[-1])
        return (g_RkL.sum(1) if ctx.k > 1 else g_RkL.squeeze(1)), None, None, None


def combine_sorted(z_NL, weights_Nk, indices_Nk, num_experts: int, expert_ffn) -> torch.Tensor:
    """``Σ_k weights[n,k] · y[n,k]``, shape ``[N, L]`` in ``z_NL.dtype``, where the token-slots are sorted by
    expert and ``y_ML = expert_ffn(x_ML, offs_E, expert_M)`` computes them (rows of ``z`` in that order, the
    int32 cumulative row count per expert, the expert of each row).

    Dispatch and combine are permutations (``order_M`` sorts the slots by expert, ``rank_M`` is its inverse):
    gathers forward and backward, no host sync, no atomic scatter; the ``k`` weighted outputs of a token are
    summed in one reduction, in fp32 for bf16/fp16 (one rounding to ``z_NL.dtype`` at the end)."""
    N, k = indices_Nk.shape
    expert_M, order_M = torch.sort(indices_Nk.reshape(-1), stable=True)
    rank_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(N * k, device=order_M.device))
    experts_E = torch.arange(num_experts, device=z_NL.device)
    offs_E = torch.searchsorted(expert_M, experts_E, right=True, out_int32=True)  # rows of experts ≤ e
    y_ML = expert_ffn(SortedRows.apply(z_NL, order_M, rank_M, k), offs_E, expert_M)
    y_NkL = SortedRows.apply(y_ML, rank_M, order_M, 1).view(N, k, -1)
    acc = torch.promote_types(y_NkL.dtype, torch.float32)
    return (y_NkL.to(acc) * weights_Nk.to(acc).unsqueeze(-1)).sum(1).to(z_NL.dtype)


def combine_experts(config, z_NL, weights_Nk, indices_Nk, w1_EFL, w3_EFL, w2_ELF, x_quant=None):
    """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]`` in ``z_NL.dtype``: sorts the
    token-slots by expert and runs :func:`grouped_expert_ffn` on them (:func:`combine_sorted`)."""

    def expert_ffn(x_ML, offs_E, expert_M):
        return grouped_expert_ffn(config, x_ML, w1_EFL, w3_EFL, w2_ELF, offs_E, expert_M, x_quant)

    return combine_sorted(z_NL, weights_Nk, indices_Nk, w1_EFL.shape[0], expert_ffn)


def gathered_experts(config, z_NL, weights_Nk, indices_Nk, w1_EFL, w3_EFL, w2_ELF) -> torch.Tensor:
    """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]`` in ``z_NL.dtype``, written as
    reductions over the gathered weights rather than sorted slots and grouped GEMMs::

        gate[n,k,f] = Σ_l w1[i_nk, f, l] · z[n, l]          (up likewise with w3)
        y[n, l]     = Σ_{k,f} w2[i_nk, l, f] · (weights[n,k] · glu(gate, up)[n,k,f])

    Sums in fp32 (fp64 for fp64), the GLU's inputs rounded to ``z_NL.dtype`` as a GEMM's outputs are. Eager,
    ``w[indices]`` copies the chosen experts' weights; under ``torch.compile`` Inductor reads them in place
    inside the reductions, so this is the small-batch path of :meth:`RoutedExperts.forward` there only."""
    acc = torch.promote_types(z_NL.dtype, torch.float32)
    x_N11L = z_NL.to(acc)[:, None, None, :]
    gate_NkF = (w1_EFL[indices_Nk].to(acc) * x_N11L).sum(-1).to(z_NL.dtype)
    up_NkF = (w3_EFL[indices_Nk].to(acc) * x_N11L).sum(-1).to(z_NL.dtype)
    h_NkF = glu(config, gate_NkF, up_NkF).to(acc) * weights_Nk.to(acc)[..., None]
    return (w2_ELF[indices_Nk].to(acc) * h_NkF[:, :, None, :]).sum((1, 3)).to(z_NL.dtype)


class RoutedExperts(nn.Module):
    """``E`` SiTU/SwiGLU experts stored stacked: ``w1, w3 [E, F, L]`` and ``w2 [E, L, F]``.

    ``qat`` (default ``False``; :func:`openk3.quant.qat.enable_qat` sets it): the forward reads MXFP4
    fake-quantised weights and MXFP8 fake-quantised GEMM inputs, with straight-through gradients."""

    def __init__(self, config, input_size: int) -> None:
        super().__init__()
        E, F_, L = config.num_experts, config.moe_intermediate_size, input_size
        self.config = config
        self.w1 = nn.Parameter(torch.empty(E, F_, L))
        self.w3 = nn.Parameter(torch.empty(E, F_, L))
        self.w2 = nn.Parameter(torch.empty(E, L, F_))
        self.qat = False

    def forward(self, z_NL: torch.Tensor, weights_Nk: torch.Tensor, indices_Nk: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[n,k] · Expert_{indices[n,k]}(z[n])``, shape ``[N, L]``, in ``z_NL.dtype``: through
        :func:`gathered_experts` for a few tokens without gradient under ``torch.compile`` (``N·k ≤ E``: the
        decode step), else sorted slots and grouped GEMMs (:func:`combine_experts`)."""
        w = (self.w1, self.w3, self.w2)
        if few_token_slots(indices_Nk.numel(), self.w1.shape[0]) and not self.qat:
            return gathered_experts(self.config, z_NL, weights_Nk, indices_Nk, *w)
        if self.qat:
            return combine_experts(self.config, z_NL, weights_Nk, indices_Nk, *map(mxfp4_ste, w), mxfp8_ste)
        return combine_experts(self.config, z_NL, weights_Nk, indices_Nk, *w)


def experts_loop_reference(experts: RoutedExperts, z_NL, weights_Nk, indices_Nk) -> torch.Tensor:
    """Readable per-expert loop (host syncs); the test oracle for :meth:`RoutedExperts.forward`."""
    out = torch.zeros_like(z_NL)
    for e in range(experts.w1.shape[0]):
        token, slot = torch.nonzero(indices_Nk == e, as_tuple=True)
        if token.numel() == 0:
            continue
        x = z_NL[token]
        h = glu(experts.config, x @ experts.w1[e].t(), x @ experts.w3[e].t())
        out.index_add_(0, token, (h @ experts.w2[e].t()) * weights_Nk[token, slot, None].to(x.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """``block_sparse_moe``: router + routed experts (+ latent path, K3) + shared experts.

    Routing statistics (:mod:`openk3.model.routing_stats`): after :meth:`track_routing`, every forward in
    training mode adds its routing to the block's own non-persistent buffers ``routing_counts_E`` (int32
    ``[E]``) and ``routing_margin_hist_EB`` (int32 ``[E, B]``); :meth:`routing_stats` returns views of them,
    :meth:`reset_routing_stats` zeroes them. Load balancing reads them and writes the router's bias; the
    block itself never changes the bias. Forwards in eval mode (evaluation, generation) are not counted.
    """

    def __init__(self, config) -> None:
        super().__init__()
        D = config.hidden_size
        self.gate = MoEGate(config, D)
        if config.is_latent_moe:
            L = config.routed_expert_hidden_size
            self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.experts = RoutedExperts(config, config.expert_input_size)
        self.shared_experts = (
            MLP(config, D, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )
        self.is_latent = config.is_latent_moe
        self.register_buffer("routing_counts_E", None, persistent=False)
        self.register_buffer("routing_margin_hist_EB", None, persistent=False)
        self.register_buffer("routing_margin_range", None, persistent=False)  # fp64 [2]: lo, bin width
        self.register_buffer("routing_range_set", None, persistent=False)  # bool []: routing_range_fixed
        self.routing_range_fixed = False
        self.packed: PackedProjection | None = None
        """The latent down projection and the shared experts' gate and up as one GEMM (:meth:`pack_projections`)."""

    def pack_projections(self) -> None:
        """Pack ``routed_expert_down_proj`` with the shared experts' ``gate_proj`` and ``up_proj`` (they read
        the same input) into one matrix, read by forwards without gradient; the shared experts get the view of
        their rows as their own pack. Nothing to do without a latent path or shared experts (the router runs
        in fp32 and stays apart)."""
        shared = self.shared_experts
        if not self.is_latent or shared is None:
            return
        self.packed = pack_linears([self.routed_expert_down_proj, shared.gate_proj, shared.up_proj])
        L = self.packed.sizes[0]
        shared.packed = PackedProjection.of(self.packed.weight[L:], (shared.gate_proj, shared.up_proj))

    # ------------------------------------------------------------------------------------ routing statistics
    def track_routing(self, bins: int) -> None:
        """Start counting the routing of training-mode forwards: loads, and with ``bins ≥ 1`` (and ``k < E``)
        the histogram of required biases over ``bins`` bins. Allocates zeroed buffers on the bias's device,
        replacing any earlier ones (call it after casting the model: ``Module.to(dtype)`` would also cast the
        fp64 range buffer). Raises ``ValueError`` for ``bins`` that is not an int ``≥ 0``."""
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 0:
            raise ValueError(f"bins={bins!r} is invalid: use an int >= 0 (0 counts the loads only)")
        bias_E = self.gate.e_score_correction_bias
        E, device = bias_E.shape[0], bias_E.device
        self.routing_counts_E = torch.zeros(E, dtype=COUNT_DTYPE, device=device)
        with_hist = bins > 0 and self.gate.top_k < E
        self.routing_margin_hist_EB = (
            torch.zeros(E, bins, dtype=COUNT_DTYPE, device=device) if with_hist else None
        )
        self.routing_margin_range = torch.zeros(2, dtype=torch.float64, device=device) if with_hist else None
        self.routing_range_set = torch.zeros((), dtype=torch.bool, device=device) if with_hist else None
        self.routing_range_fixed = False

    def routing_stats(self) -> RoutingStats:
        """Views of the statistics counted since the last reset. Raises ``RuntimeError`` if the block does
        not track its routing (:meth:`track_routing` not called)."""
        if self.routing_counts_E is None:
            raise RuntimeError("this MoE block does not track its routing: call track_routing(bins) first")
        rng = self.routing_margin_range
        return RoutingStats(
            expert_counts_E=self.routing_counts_E,
            margin_hist_EB=self.routing_margin_hist_EB,
            margin_lo=None if rng is None else rng[0],
            margin_width=None if rng is None else rng[1],
            range_fixed=self.routing_range_fixed,
            top_k=self.gate.top_k,
        )

    def fix_routing_range(self) -> None:
        """Fix the histogram range from the current bias (done by the first counted forward after a reset;
        load balancing calls it for a step in which this block counted nothing). No-op without a histogram."""
        if self.routing_margin_hist_EB is not None:
            lo, width = histogram_range(
                self.gate.e_score_correction_bias, self.routing_margin_hist_EB.shape[1]
            )
            self.set_routing_range(lo, width)

    def set_routing_range(self, lo: torch.Tensor, width: torch.Tensor) -> None:
        """Fix the histogram range to ``lo`` and bin width ``width`` (fp64 0-dim; a resumed balancer's)."""
        self.routing_margin_range.copy_(torch.stack([lo, width]))
        self.routing_range_set.fill_(True)
        self.routing_range_fixed = True

    def reset_routing_stats(self) -> None:
        """Zero the counts; the next counted forward fixes a new histogram range."""
        for buf in (self.routing_counts_E, self.routing_margin_hist_EB, self.routing_range_set):
            if buf is not None:
                buf.zero_()
        self.routing_range_fixed = False

    def count_routing(self, routing: RouterOutput) -> None:
        """Add one routing decision to the statistics (the forward calls it in training mode); no host sync.

        The first counted forward after a reset fixes the histogram range from the bias. It decides that on the
        device (``routing_range_set``), not with a Python branch on :attr:`routing_range_fixed`, so a compiled
        layer has one graph for the first and the later forwards instead of two."""
        self.routing_counts_E.add_(routing.counts_E.to(COUNT_DTYPE))
        if self.routing_margin_hist_EB is None:
            return
        rng = self.routing_margin_range
        lo, width = histogram_range(self.gate.e_score_correction_bias, self.routing_margin_hist_EB.shape[1])
        rng.copy_(torch.where(self.routing_range_set, rng, torch.stack([lo, width])))
        self.routing_range_set.fill_(True)
        self.routing_range_fixed = True
        r_NE = routing.cutoff_N.detach()[:, None] - routing.scores_NE.detach()  # required bias α_i − s_ij
        ones_N = torch.ones(r_NE.shape[0], dtype=COUNT_DTYPE, device=r_NE.device)
        lo, width = self.routing_margin_range.unbind(0)
        accumulate_histogram_(self.routing_margin_hist_EB, r_NE, lo, width, ones_N)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.gate(x_ND)
        if self.training and self.routing_counts_E is not None:
            self.count_routing(routing)
        packed = packed_or_none(self.packed)
        if packed is not None:  # one GEMM for the latent input and the shared experts' gate and up
            z_NL, gate_NF, up_NF = packed(x_ND)
            shared_ND = self.shared_experts.down(gate_NF, up_NF)
        else:
            z_NL = self.routed_expert_down_proj(x_ND) if self.is_latent else x_ND
            shared_ND = self.shared_experts(x_ND) if self.shared_experts is not None else None
        e_NL = self.experts(z_NL, routing.weights_Nk, routing.indices_Nk)
        if self.is_latent:
            if self.routed_expert_norm is not None:
                e_NL = self.routed_expert_norm(e_NL)
            e_NL = project(e_NL, self.routed_expert_up_proj)
        if shared_ND is not None:
            e_NL = e_NL + shared_ND
        return e_NL.reshape(x_BTD.shape)
