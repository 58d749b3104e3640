"""Expert load balancing through the router bias: Quantile Balancing (K3) and the DeepSeek sign rule.

The bias ``block_sparse_moe.gate.e_score_correction_bias`` only steers selection (``s + b``); the
routed weights use the unbiased scores ``s`` (``docs/references.md#router``). It is a buffer, so no
optimizer owns it; :class:`QuantileBalancer` rewrites it once per optimizer step from the routing
statistics each MoE block counted over that step's micro-batches (:mod:`openk3.model.routing_stats`;
sources: ``docs/references.md#quantile-balancing``).

**Quantile Balancing (QB)** (Kimi K3 technical report, section 2.3.3 and appendix D; J. Su, kexue.fm/archives/11619). The router
selects with a biased top-``(k+1)``; the ``(k+1)``-th biased score of token ``i`` is its cutoff ``α_i``
(:attr:`RouterOutput.cutoff_N`). Expert ``j`` beats that cutoff when ``s_ij + b_j > α_i``, i.e. when
``b_j > r_ij`` with the *required bias* ``r_ij = α_i − s_ij``. With ``m`` tokens, target load
``q = m·k/n``, the new bias is the ``(k/n)``-quantile of ``{r_ij}_i`` (about ``q`` tokens have
``r_ij < b_j``), then mean-centred: ``b ← b − mean(b)``. The rule overwrites the bias.

Histogram estimator (exact up to one bin width). The histogrammed variable is ``r_ij`` itself. Because
scores lie in ``[0, 1]`` (sigmoid, or softmax) and ``α_i = s_ij* + b_j*`` for some expert ``j*``,
``α_i ∈ [min(b), max(b) + 1]`` and so ``r_ij ∈ [lo, hi] = [min(b) − 1, max(b) + 1]``, where ``b`` is the
bias the forward passes of the step used. With ``B`` bins of width ``w = (hi − lo)/B``, value ``r`` goes
to bin ``⌊(r − lo)/w⌋`` (clamped to ``[0, B−1]``, so ``r = hi`` lands in the last bin). Per expert, with
``C`` counted tokens, cumulative counts ``F_β = Σ_{β' ≤ β} h_β'`` and target ``t = ⌈C·k/n⌉``:

* ``β`` = the first bin with ``F_β ≥ t``; it holds ``r_(t)``, the ``t``-th smallest ``r_ij`` (every value
  in a lower bin is smaller, and fewer than ``t`` of them exist);
* linear interpolation of the CDF inside that bin: ``pos = β + (t − F_{β−1}) / h_β ∈ (β, β+1]``;
* ``b_raw = lo + pos·w``, so ``|b_raw − r_(t)| ≤ w``;
* ``b = b_raw − mean(b_raw) = (pos − mean(pos))·w``: the offset ``lo`` is shared by all experts of a layer
  and cancels in the mean-centring.

A layer that counted no token in the step (no training-mode forward) keeps its old bias instead of
becoming NaN. Every counted token adds one
``r_ij`` to *every* expert's histogram, so all experts of a layer have the same ``C``. A layer with
``k ≥ n`` (every expert chosen, cutoff ``−inf``) is left alone: its bias cannot change the routing.

**DeepSeek sign rule** (DeepSeek-V3 report arXiv 2412.19437; mean-centred Δ as in torchtitan):
``Δ_j = γ·sign(mean_load − load_j)``, ``Δ ← Δ − mean(Δ)``, ``b ← b + Δ`` (``γ`` default ``1e-3``).

**Max violation** per layer (Wang et al. arXiv 2408.15664): ``maxvio = max_j load_j / mean_load − 1``
from the step's routed-token counts (0 for a layer that counted no token).

Distributed: if ``torch.distributed`` is initialised, :meth:`QuantileBalancer.step` issues exactly one
``all_reduce(SUM)`` over one flat int32 buffer that holds every layer's histogram and load counts
(all ranks must call ``step`` together). The model forward never communicates.

Launches: each MoE block counts its own routing in its forward (two scatters per micro-batch: loads and
histogram). On an accelerator, :meth:`QuantileBalancer.step` stacks consecutive layers with the same
``(E, k)`` (all MoE layers of a K3 model) into one quantile computation and one ``_foreach_copy_`` of the
biases (up to :data:`BATCH_ELEMENTS` elements at a time), with the same integers and the same fp64
arithmetic as layer by layer; on the CPU, layers go one at a time.

Legend: ``E`` experts (``n``), ``k`` experts per token, ``B`` histogram
bins, ``L`` MoE layers, ``1`` a kept size-1 dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.moe import SparseMoeBlock
from openk3.model.router import RouterOutput
from openk3.model.routing_stats import accumulate_histogram_, histogram_range

__all__ = [
    "METHODS",
    "QuantileBalancer",
    "accumulate_histogram_",
    "histogram_range",
    "max_violation",
    "quantile_from_histogram",
    "required_bias",
    "sign_rule_delta",
]

METHODS = ("quantile", "sign")
BATCH_ELEMENTS = 1 << 26
"""Off the CPU, consecutive layers with the same ``(E, k)`` are processed together in :meth:`QuantileBalancer.step`,
at most this many histogram elements (``layers·E·B``) at a time: a few launches per step instead of a dozen per
layer, with bounded temporary memory."""


def layers_per_chunk(elements_per_layer: int, device: torch.device) -> int:
    """How many same-shape layers one batched balancing op covers: 1 on the CPU, else as many as fit in
    :data:`BATCH_ELEMENTS` (at least 1)."""
    if device.type == "cpu":
        return 1
    return max(1, BATCH_ELEMENTS // max(1, elements_per_layer))


def required_bias(router: RouterOutput) -> torch.Tensor:
    """``r_ij = α_i − s_ij``: the bias expert ``j`` needs to beat token ``i``'s cutoff, fp32 ``[N, E]``."""
    return router.cutoff_N.detach()[:, None] - router.scores_NE.detach()


def quantile_from_histogram(
    hist_EB: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert, the ``⌈C·k/E⌉``-th smallest histogrammed value, by linear interpolation inside its bin.

    ``hist_EB``: ``[..., E, B]`` counts; ``lo``, ``width``: fp64 ``[...]`` (0-dim for one layer).
    Returns ``(b_raw_E, count_E)``: fp64 ``[..., E]`` values ``lo + pos·w`` (not mean-centred; within one
    bin width of the exact order statistic), and int64 ``[..., E]`` counts ``C``. For ``C = 0`` the value
    is ``lo`` (callers keep the old bias there). See the module docstring for the formula.
    """
    E, B = hist_EB.shape[-2:]
    hist_EB = hist_EB.to(torch.int64)
    cum_EB = hist_EB.cumsum(-1)
    count_E = cum_EB[..., -1]
    target_E1 = ((count_E * k + E - 1) // E)[..., None]  # ⌈C·k/E⌉, exact integer arithmetic
    bin_E1 = torch.searchsorted(cum_EB, target_E1, side="left").clamp_(max=B - 1)
    in_bin_E1 = hist_EB.gather(-1, bin_E1)
    below_E1 = cum_EB.gather(-1, bin_E1) - in_bin_E1
    frac_E1 = (target_E1 - below_E1).to(torch.float64) / in_bin_E1.clamp(min=1).to(torch.float64)
    pos_E = (bin_E1.to(torch.float64) + frac_E1).squeeze(-1)
    return lo[..., None] + pos_E * width[..., None], count_E


def sign_rule_delta(loads_E: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3 update ``Δ = γ·sign(mean_load − load)``, mean-centred over the last dim; fp64 ``[..., E]``.

    Zero loads → Δ = 0.
    """
    loads = loads_E.to(torch.float64)
    delta_E = gamma * torch.sign(loads.mean(-1, keepdim=True) - loads)
    return delta_E - delta_E.mean(-1, keepdim=True)


def max_violation(loads_E: torch.Tensor) -> torch.Tensor:
    """``max_j load_j / mean_load − 1`` over the last dim, fp64 ``[...]``; 0 where no token was routed."""
    loads = loads_E.to(torch.float64)
    mean = loads.mean(-1)
    return torch.where(mean > 0, loads.amax(-1) / mean.clamp(min=1e-300) - 1.0, torch.zeros_like(mean))


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` that only views a single tensor (no copy for a one-layer chunk)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _chunks(start: int, stop: int, size: int):
    """``range(start, stop)`` in consecutive pieces of at most ``size`` (>= 1) indices."""
    for i in range(start, stop, size):
        yield i, min(i + size, stop)


class QuantileBalancer:
    """Balances every :class:`SparseMoeBlock` of ``model`` by rewriting its ``e_score_correction_bias``.

    The balancer switches on each block's routing statistics (``block.track_routing(bins)``); the blocks count
    every training-mode forward themselves (:mod:`openk3.model.routing_stats`). Once per optimizer step call
    :meth:`step` (or let :meth:`attach_to` do it in an optimizer step pre-hook): it reads each block's
    :meth:`~SparseMoeBlock.routing_stats`, updates the bias and resets the statistics.

    Args:
        model: any module containing ``SparseMoeBlock``s.
        method: ``"quantile"`` (QB, overwrite) or ``"sign"`` (DeepSeek-V3 rule, additive).
        bins: histogram bins per expert (QB; the K3 report's 1000). Memory ``L·E·bins·4`` bytes.
        gamma: sign-rule step size (the DeepSeek-V3 report's 1e-3).
        process_group: group for the step's all-reduce (the data/loss mesh); ``None`` = default group.

    Raises ``ValueError`` for an unknown method, ``bins < 1``, ``gamma < 0``, a model without MoE blocks,
    or MoE biases on different devices (at :meth:`step`). Constraints: one process group per balancer; the
    bias must not be changed by anything else between the first counted forward of a step and :meth:`step`
    (the histogram range is fixed from the bias then; values outside it are clamped to the edge bins).
    Padding tokens are counted like any other: pack sequences (``cu_seqlens``) rather than pad them. With
    activation checkpointing, a recomputed forward would be counted twice.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str = "quantile",
        bins: int = 1000,
        gamma: float = 1e-3,
        process_group=None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r} is invalid: use one of {METHODS}")
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins={bins!r} is invalid: use an int >= 1 (the K3 report uses 1000)")
        if not gamma >= 0:
            raise ValueError(f"gamma={gamma!r} is invalid: use a number >= 0 (DeepSeek-V3 uses 1e-3)")
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
        if not named:
            raise ValueError("model has no SparseMoeBlock: nothing to balance")
        self.method, self.bins, self.gamma, self.process_group = method, bins, float(gamma), process_group
        self.layer_names = [name for name, _ in named]
        self.blocks = [m for _, m in named]
        for block in self.blocks:
            block.track_routing(bins if method == "quantile" else 0)
        self.num_steps = 0
        self.last_stats: dict | None = None
        # runs of consecutive layers with the same (E, k): their quantiles are computed stacked
        self._runs: list[tuple[int, int, int, int]] = []  # (first layer, end layer, E, k)
        for i, block in enumerate(self.blocks):
            E, k = block.gate.num_experts, block.gate.top_k
            if self._runs and self._runs[-1][2:] == (E, k):
                self._runs[-1] = (self._runs[-1][0], i + 1, E, k)
            else:
                self._runs.append((i, i + 1, E, k))

    def _counts(self) -> list[torch.Tensor]:
        """Every block's count buffers in the flat order of :meth:`state_dict`: all histograms, then all
        loads."""
        stats = [block.routing_stats() for block in self.blocks]
        hists = [st.margin_hist_EB for st in stats if st.margin_hist_EB is not None]
        return hists + [st.expert_counts_E for st in stats]

    def _all_reduce(self) -> None:
        """Sum every block's counts over the process group in one ``all_reduce`` (one flat buffer)."""
        counts = self._counts()
        flat = torch.cat([c.reshape(-1) for c in counts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
        torch._foreach_copy_(
            counts,
            [f.view_as(c) for f, c in zip(flat.split([c.numel() for c in counts]), counts, strict=True)],
        )

    # -------------------------------------------------------------------------------------------- per step
    def step(self) -> dict:
        """All-reduce the step's counts (if distributed), update every bias in place, reset the counts.

        Returns (and keeps in :attr:`last_stats`) ``{"maxvio": float, "maxvio_per_layer": {name: float},
        "tokens": int}``: the max violation of the loads routed during the step (old bias), per layer and
        the largest, and the tokens counted per layer (all ranks). One host sync, for the stats.
        """
        devices = {block.gate.e_score_correction_bias.device for block in self.blocks}
        if len(devices) != 1:
            raise ValueError(
                f"MoE biases live on several devices {sorted(map(str, devices))}: use one balancer "
                "per device (e.g. per pipeline stage)"
            )
        device = devices.pop()
        for block in self.blocks:
            if block.routing_counts_E.device != device:  # the model moved after the balancer was built
                block.track_routing(self.bins if self.method == "quantile" else 0)
        if dist.is_available() and dist.is_initialized():
            self._all_reduce()
        stats = []
        for block in self.blocks:
            if not block.routing_range_fixed:  # this rank counted nothing; all-reduced counts may exist
                block.fix_routing_range()
            stats.append(block.routing_stats())
        biases, maxvio_L = [block.gate.e_score_correction_bias for block in self.blocks], []
        with torch.no_grad():
            for run_first, run_end, E, k in self._runs:
                quantile = self.method == "quantile" and k < E
                per_chunk = layers_per_chunk(E * self.bins if quantile else E, device)
                for first, end in _chunks(run_first, run_end, per_chunk):
                    loads_LE = _stack([st.expert_counts_E for st in stats[first:end]])
                    bias_L = biases[first:end]
                    if self.method == "sign":
                        delta_LE = sign_rule_delta(loads_LE, self.gamma)
                        torch._foreach_add_(bias_L, list(delta_LE.to(bias_L[0].dtype).unbind(0)))
                    elif quantile:
                        raw_LE, count_LE = quantile_from_histogram(
                            _stack([st.margin_hist_EB for st in stats[first:end]]),
                            _stack([st.margin_lo for st in stats[first:end]]),
                            _stack([st.margin_width for st in stats[first:end]]),
                            k,
                        )
                        # every counted token reaches every expert's histogram: count is all-zero or all-C
                        old_LE = torch.stack(bias_L).to(torch.float64)
                        new_LE = torch.where(count_LE > 0, raw_LE - raw_LE.mean(-1, keepdim=True), old_LE)
                        torch._foreach_copy_(bias_L, list(new_LE.to(bias_L[0].dtype).unbind(0)))
                    maxvio_L.append(max_violation(loads_LE))
        tokens = stats[0].expert_counts_E.sum().to(torch.float64) / stats[0].top_k
        *values, tokens = torch.cat([*maxvio_L, tokens[None]]).tolist()  # the one host sync
        for block in self.blocks:
            block.reset_routing_stats()
        self.num_steps += 1
        self.last_stats = {
            "maxvio": max(values),
            "maxvio_per_layer": dict(zip(self.layer_names, values, strict=True)),
            "tokens": round(tokens),
        }
        return self.last_stats

    def attach_to(self, optimizer: torch.optim.Optimizer):
        """Run :meth:`step` in ``optimizer``'s step pre-hook; returns the handle."""

        def hook(_optimizer, _args, _kwargs) -> None:
            self.step()

        return optimizer.register_step_pre_hook(hook)

    # ---------------------------------------------------------------------------------------------- resume
    def _histogram_blocks(self) -> list[SparseMoeBlock]:
        return [b for b in self.blocks if b.routing_margin_hist_EB is not None]

    def state_dict(self) -> dict:
        """The counts of the step in progress, so a resumed run steps to the same bias (the bias itself is in
        the model's state dict). ``counts``: one flat int32 tensor, every histogram then every load (``None``
        between steps); ``lo``/``width``: fp64 ``[layers with a histogram]``."""
        pending = any(b.routing_range_fixed for b in self.blocks) or any(
            bool(b.routing_counts_E.any()) for b in self.blocks
        )
        hist_blocks = self._histogram_blocks()
        return {
            "method": self.method,
            "bins": self.bins,
            "layer_names": list(self.layer_names),
            "num_steps": self.num_steps,
            "pending": pending,
            "counts": torch.cat([c.reshape(-1) for c in self._counts()]) if pending else None,
            "lo": torch.stack([b.routing_margin_range[0] for b in hist_blocks])
            if pending and hist_blocks
            else None,
            "width": torch.stack([b.routing_margin_range[1] for b in hist_blocks])
            if pending and hist_blocks
            else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` if method, bins or layer names differ."""
        for key, mine in (("method", self.method), ("bins", self.bins), ("layer_names", self.layer_names)):
            if state[key] != mine:
                raise ValueError(f"balancer state has {key}={state[key]!r} but this balancer has {mine!r}")
        self.num_steps = int(state["num_steps"])
        for block in self.blocks:
            block.reset_routing_stats()
        if state["counts"] is None:
            return
        counts = self._counts()
        flat = state["counts"].to(counts[0].device)
        torch._foreach_copy_(
            counts,
            [f.view_as(c) for f, c in zip(flat.split([c.numel() for c in counts]), counts, strict=True)],
        )
        if state["lo"] is not None:
            for block, lo, width in zip(self._histogram_blocks(), state["lo"], state["width"], strict=True):
                block.set_routing_range(lo, width)
