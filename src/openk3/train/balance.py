"""Expert load balancing through the router bias: Quantile Balancing (K3) and the DeepSeek sign rule.

The bias ``block_sparse_moe.gate.e_score_correction_bias`` only steers selection (``s + b``); the
routed weights use the unbiased scores ``s`` (reference/architecture.md §1.7). It is a buffer, so no
optimizer owns it; :class:`QuantileBalancer` rewrites it once per optimizer step from what the
micro-batches of that step routed (reference/architecture.md §6).

**Quantile Balancing (QB)** (K3 report §2.3.3 and App. D; J. Su, kexue.fm/archives/11619). The router
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

A layer that counted no token in the step (all padding, or never observed) keeps its old bias instead
of becoming NaN; padding tokens are excluded through ``valid_mask``. Every counted token adds one
``r_ij`` to *every* expert's histogram, so all experts of a layer have the same ``C``. A layer with
``k ≥ n`` (every expert chosen, cutoff ``−inf``) is left alone: its bias cannot change the routing.

**DeepSeek sign rule** (DeepSeek-V3 report arXiv 2412.19437; mean-centred Δ as in torchtitan):
``Δ_j = γ·sign(mean_load − load_j)``, ``Δ ← Δ − mean(Δ)``, ``b ← b + Δ`` (``γ`` default ``1e-3``).

**Max violation** per layer (Wang et al. arXiv 2408.15664): ``maxvio = max_j load_j / mean_load − 1``
from the step's routed-token counts (0 for a layer that counted no token).

Distributed: if ``torch.distributed`` is initialised, :meth:`QuantileBalancer.step` issues exactly one
``all_reduce(SUM)`` over one flat int32 buffer that holds every layer's histogram and load counts
(all ranks must call ``step`` together). The model forward never communicates.

Launches: on an accelerator, consecutive layers with the same ``(E, k)`` (all MoE layers of a K3 model)
are stacked, so :meth:`QuantileBalancer.observe` costs one scatter for their loads and one for their
histograms per micro-batch, and :meth:`QuantileBalancer.step` one quantile computation and one
``_foreach_copy_`` of the biases (up to :data:`BATCH_ELEMENTS` elements at a time), with the same integers
and the same fp64 arithmetic as layer by layer. On the CPU, where launches are cheap and a layer's
histogram stays in cache, layers go one at a time (stacking 15 k3-small layers made ``observe`` 3× slower).

Legend: ``N`` tokens of one micro-batch, ``E`` experts (``n``), ``k`` experts per token, ``B`` histogram
bins, ``L`` MoE layers, ``1`` a kept size-1 dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.moe import SparseMoeBlock
from openk3.model.router import RouterOutput

METHODS = ("quantile", "sign")
COUNT_DTYPE = torch.int32
"""Histograms and loads are int32 (exact up to 2^31 − 1 tokens per expert per step, all ranks summed)."""
BATCH_ELEMENTS = 1 << 26
"""Off the CPU, consecutive layers with the same ``(E, k)`` are processed together, at most this many
elements (``layers·N·E`` in :meth:`QuantileBalancer.observe`, ``layers·E·B`` in
:meth:`QuantileBalancer.step`) at a time: a few launches per step instead of a dozen per layer, with
bounded temporary memory."""


def layers_per_chunk(elements_per_layer: int, device: torch.device) -> int:
    """How many same-shape layers one batched balancing op covers: 1 on the CPU, else as many as fit in
    :data:`BATCH_ELEMENTS` (at least 1)."""
    if device.type == "cpu":
        return 1
    return max(1, BATCH_ELEMENTS // max(1, elements_per_layer))


def histogram_range(bias_E: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo = min(b) − 1`` and bin width ``w = (max(b) − min(b) + 2) / bins`` over the last dim, fp64.

    ``bias_E``: ``[..., E]`` (one layer, or ``[L, E]`` stacked layers); returns two fp64 tensors ``[...]``.
    """
    b = bias_E.detach().to(torch.float64)
    lo = b.amin(-1) - 1.0
    return lo, (b.amax(-1) + 1.0 - lo) / bins


def required_bias(router: RouterOutput) -> torch.Tensor:
    """``r_ij = α_i − s_ij``: the bias expert ``j`` needs to beat token ``i``'s cutoff, fp32 ``[N, E]``."""
    return router.cutoff_N.detach()[:, None] - router.scores_NE.detach()


def accumulate_histogram_(
    hist_EB: torch.Tensor, r_NE: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, valid_N: torch.Tensor
) -> None:
    """Add each valid token's ``r_ij`` to bin ``clamp(⌊(r_ij − lo)/w⌋, 0, B−1)`` of ``hist_EB[j]``, in place.

    ``hist_EB``: contiguous int32 ``[..., E, B]``; ``r_NE``: float ``[..., N, E]``; ``lo``, ``width``: fp64
    ``[...]`` (one per leading index, e.g. per layer); ``valid_N``: int32 ``[N]`` of 0/1 (the count each
    token adds). Leading dims batch several layers into one scatter. Binning runs in ``r_NE``'s dtype;
    no host sync. A NaN score lands in bin 0 and ±inf in the end bins (the trainer stops on a non-finite
    loss before it gets here; this only keeps the index in range).
    """
    E, B = hist_EB.shape[-2:]
    lo_11 = lo.to(r_NE.dtype)[..., None, None]
    width_11 = width.to(r_NE.dtype)[..., None, None]
    bin_NE = ((r_NE - lo_11) / width_11).floor_().nan_to_num_(nan=0.0).clamp_(0, B - 1).to(torch.int64)
    row_1E = torch.arange(hist_EB.numel() // B, device=bin_NE.device).view(*hist_EB.shape[:-2], 1, E)
    flat_NE = bin_NE + row_1E * B  # index of (leading, expert, bin) in the flat histogram
    counts_NE = valid_N[:, None].expand(flat_NE.shape)
    hist_EB.view(-1).scatter_add_(0, flat_NE.reshape(-1), counts_NE.reshape(-1))


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

    Usage per optimizer step: after each micro-batch forward call :meth:`observe` (with the boolean
    ``valid_mask`` of non-padding tokens, ``[B, T]`` or ``[N]``); once per optimizer step call :meth:`step`
    (or let :meth:`attach_to` do it in an optimizer step pre-hook).

    Args:
        model: any module containing ``SparseMoeBlock``s; their ``record_router`` is switched on.
        method: ``"quantile"`` (QB, overwrite) or ``"sign"`` (DeepSeek-V3 rule, additive).
        bins: histogram bins per expert (QB; the K3 report's 1000). Memory ``L·E·bins·4`` bytes.
        gamma: sign-rule step size (the DeepSeek-V3 report's 1e-3).
        process_group: group for the step's all-reduce (the data/loss mesh); ``None`` = default group.

    Raises ``ValueError`` for an unknown method, ``bins < 1``, ``gamma < 0``, a model without MoE blocks,
    or MoE biases on different devices. Constraints: one process group per balancer; the bias must not be
    changed by anything else between the first :meth:`observe` of a step and :meth:`step` (the histogram
    range is fixed from the bias at the step's first observe; values outside it are clamped to the edge bins).
    With activation checkpointing, the recomputed forward re-records the same routing, which the next
    :meth:`observe`/:meth:`discard` or forward replaces; nothing is counted twice.
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
            block.record_router = True
        self.num_steps = 0
        self.last_stats: dict | None = None
        self._counts_flat: torch.Tensor | None = None  # int32: all histograms, then all loads
        self._runs: list[tuple[int, int, int, int]] = []  # (first layer, end layer, E, k)
        self._expert_starts: list[int] = []
        self._hist_size = 0
        self._lo_L: torch.Tensor | None = None  # fp64 [L], range of the step being accumulated
        self._width_L: torch.Tensor | None = None
        self._pending = False  # a step is being accumulated (range fixed)

    # --------------------------------------------------------------------------------------------- buffers
    def _biases(self) -> list[torch.Tensor]:
        return [block.gate.e_score_correction_bias for block in self.blocks]

    def _num_experts(self) -> list[int]:
        return [block.gate.num_experts for block in self.blocks]

    def _ensure_buffers(self) -> None:
        devices = {b.device for b in self._biases()}
        if len(devices) != 1:
            raise ValueError(
                f"MoE biases live on several devices {sorted(map(str, devices))}: use one balancer "
                "per device (e.g. per pipeline stage)"
            )
        device = devices.pop()
        if self._counts_flat is None:
            E_L = self._num_experts()
            hist_size = sum(E_L) * self.bins if self.method == "quantile" else 0
            self._counts_flat = torch.zeros(hist_size + sum(E_L), dtype=COUNT_DTYPE, device=device)
        elif self._counts_flat.device != device:
            self._counts_flat = self._counts_flat.to(device)
            if self._lo_L is not None:
                self._lo_L, self._width_L = self._lo_L.to(device), self._width_L.to(device)
        else:
            return
        self._make_layout()

    def _make_layout(self) -> None:
        E_L = self._num_experts()
        k_L = [block.gate.top_k for block in self.blocks]
        # runs of consecutive layers with the same (E, k): their histograms and loads are adjacent in
        # the flat buffer, so a run is one [layers, E, B] / [layers, E] view
        self._runs = []
        for i, (E, k) in enumerate(zip(E_L, k_L, strict=True)):
            if self._runs and self._runs[-1][2:] == (E, k):
                self._runs[-1] = (self._runs[-1][0], i + 1, E, k)
            else:
                self._runs.append((i, i + 1, E, k))
        self._expert_starts = [0]  # first expert row of each layer in the flat buffer
        for E in E_L:
            self._expert_starts.append(self._expert_starts[-1] + E)
        self._hist_size = self._expert_starts[-1] * self.bins if self.method == "quantile" else 0

    def _hist(self, first: int, end: int) -> torch.Tensor:
        """Histograms of layers ``first..end−1`` (one run): int32 view ``[layers, E, B]``."""
        a, b = self._expert_starts[first] * self.bins, self._expert_starts[end] * self.bins
        return self._counts_flat[a:b].view(end - first, -1, self.bins)

    def _loads(self, first: int, end: int) -> torch.Tensor:
        """Routed-token counts of layers ``first..end−1`` (one run): int32 view ``[layers, E]``."""
        a, b = self._expert_starts[first], self._expert_starts[end]
        return self._counts_flat[self._hist_size + a : self._hist_size + b].view(end - first, -1)

    def _fix_ranges(self) -> None:
        biases = self._biases()
        lo_L, width_L = [], []
        for first, end, _, _ in self._runs:
            lo, width = histogram_range(torch.stack(biases[first:end]), self.bins)
            lo_L.append(lo)
            width_L.append(width)
        self._lo_L, self._width_L = torch.cat(lo_L), torch.cat(width_L)

    # ------------------------------------------------------------------------------------- per micro-batch
    def observe(self, valid_mask: torch.Tensor | None = None) -> None:
        """Count the last forward's routing of every MoE block, then drop it (``last_router_output = None``).

        ``valid_mask``: bool, ``[B, T]`` or ``[N]`` with ``N = B·T`` tokens per block, True = real token;
        ``None`` counts every token. Raises ``RuntimeError`` if a block recorded nothing (no forward since
        the last observe) and ``ValueError`` for a mask of the wrong dtype or size. No host sync.
        """
        self._ensure_buffers()
        if self.method == "quantile" and not self._pending:
            self._fix_ranges()
        self._pending = True
        routers = []
        for name, block in zip(self.layer_names, self.blocks, strict=True):
            if block.last_router_output is None:
                raise RuntimeError(f"{name}: no router output recorded; run a forward pass before observe()")
            routers.append(block.last_router_output)
        valid_of: dict[int, torch.Tensor] = {}  # tokens N -> int32 [N] counts, built once per N
        for run_first, run_end, E, k in self._runs:
            N = routers[run_first].indices_Nk.shape[0]
            per_chunk = layers_per_chunk(N * E, self._counts_flat.device)
            for first, end in _chunks(run_first, run_end, per_chunk):
                shapes = {r.indices_Nk.shape for r in routers[first:end]}
                pieces = [(first, end)] if len(shapes) == 1 else [(i, i + 1) for i in range(first, end)]
                for a, b in pieces:
                    self._observe_layers(routers[a:b], a, b, E, k, valid_mask, valid_of)
        for block in self.blocks:
            block.last_router_output = None

    def _observe_layers(self, routers, first: int, end: int, E: int, k: int, valid_mask, valid_of) -> None:
        """Count layers ``first..end−1`` (same ``E``, ``k`` and tokens ``N``): one scatter for their loads,
        one for their histograms."""
        N = routers[0].indices_Nk.shape[0]
        if N not in valid_of:
            valid_of[N] = self._valid_counts(valid_mask, N, routers[0].indices_Nk.device)
        valid_N = valid_of[N]
        idx_LNk = _stack([r.indices_Nk for r in routers])
        layer_L11 = torch.arange(end - first, device=idx_LNk.device).view(-1, 1, 1)
        flat_LNk = idx_LNk + layer_L11 * E  # expert row in the [layers, E] loads view
        self._loads(first, end).view(-1).scatter_add_(
            0, flat_LNk.reshape(-1), valid_N[:, None].expand(flat_LNk.shape).reshape(-1)
        )
        if self.method == "quantile" and k < E:
            cutoff_LN1 = _stack([r.cutoff_N.detach() for r in routers])[..., None]
            r_LNE = cutoff_LN1 - _stack([r.scores_NE.detach() for r in routers])  # required_bias
            accumulate_histogram_(
                self._hist(first, end), r_LNE, self._lo_L[first:end], self._width_L[first:end], valid_N
            )

    @staticmethod
    def _valid_counts(valid_mask: torch.Tensor | None, N: int, device) -> torch.Tensor:
        if valid_mask is None:
            return torch.ones(N, dtype=COUNT_DTYPE, device=device)
        if valid_mask.dtype != torch.bool:
            raise ValueError(
                f"valid_mask has dtype {valid_mask.dtype}: use a bool tensor (True = real token)"
            )
        if valid_mask.numel() != N:
            raise ValueError(
                f"valid_mask has {valid_mask.numel()} entries but the MoE blocks routed {N} tokens"
            )
        return valid_mask.reshape(-1).to(device=device, dtype=COUNT_DTYPE)

    def discard(self) -> None:
        """Drop every block's recorded routing without counting it (e.g. after an evaluation forward)."""
        for block in self.blocks:
            block.last_router_output = None

    # -------------------------------------------------------------------------------------------- per step
    def step(self) -> dict:
        """All-reduce the step's counts (if distributed), update every bias in place, reset the counts.

        Returns (and keeps in :attr:`last_stats`) ``{"maxvio": float, "maxvio_per_layer": {name: float},
        "tokens": int}``: the max violation of the loads routed during the step (old bias), per layer and
        the largest, and the valid tokens counted per layer (all ranks). One host sync, for the stats.
        """
        self._ensure_buffers()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self._counts_flat, op=dist.ReduceOp.SUM, group=self.process_group)
        if self.method == "quantile" and not self._pending:
            self._fix_ranges()  # this rank observed nothing; the all-reduced histograms may still hold counts
        biases, maxvio_L = self._biases(), []
        with torch.no_grad():
            for run_first, run_end, E, k in self._runs:
                quantile = self.method == "quantile" and k < E
                per_chunk = layers_per_chunk(E * self.bins if quantile else E, self._counts_flat.device)
                for first, end in _chunks(run_first, run_end, per_chunk):
                    loads_LE, bias_L = self._loads(first, end), biases[first:end]
                    if self.method == "sign":
                        delta_LE = sign_rule_delta(loads_LE, self.gamma)
                        torch._foreach_add_(bias_L, list(delta_LE.to(bias_L[0].dtype).unbind(0)))
                    elif quantile:
                        raw_LE, count_LE = quantile_from_histogram(
                            self._hist(first, end), self._lo_L[first:end], self._width_L[first:end], k
                        )
                        # every counted token reaches every expert's histogram: count is all-zero or all-C
                        old_LE = torch.stack(bias_L).to(torch.float64)
                        new_LE = torch.where(count_LE > 0, raw_LE - raw_LE.mean(-1, keepdim=True), old_LE)
                        torch._foreach_copy_(bias_L, list(new_LE.to(bias_L[0].dtype).unbind(0)))
                    maxvio_L.append(max_violation(loads_LE))
        tokens = self._loads(0, 1).sum().to(torch.float64) / self.blocks[0].gate.top_k
        *values, tokens = torch.cat([*maxvio_L, tokens[None]]).tolist()  # the one host sync
        self._counts_flat.zero_()
        self._pending = False
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
    def state_dict(self) -> dict:
        """Accumulators of the step in progress, so a resumed run steps to the same bias (bias itself is in
        the model's state dict). Tensors are cloned; the histogram is ``None`` between steps."""
        return {
            "method": self.method,
            "bins": self.bins,
            "layer_names": list(self.layer_names),
            "num_steps": self.num_steps,
            "pending": self._pending,
            "counts": self._counts_flat.clone() if self._pending else None,
            "lo": self._lo_L.clone() if self._pending and self._lo_L is not None else None,
            "width": self._width_L.clone() if self._pending and self._width_L is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` if method, bins or layer names differ."""
        for key, mine in (("method", self.method), ("bins", self.bins), ("layer_names", self.layer_names)):
            if state[key] != mine:
                raise ValueError(f"balancer state has {key}={state[key]!r} but this balancer has {mine!r}")
        self._ensure_buffers()
        self.num_steps = int(state["num_steps"])
        self._pending = bool(state["pending"])
        device = self._counts_flat.device
        if state["counts"] is None:
            self._counts_flat.zero_()
        else:
            self._counts_flat.copy_(state["counts"].to(device))
        if state["lo"] is None:
            self._lo_L = self._width_L = None
        else:
            self._lo_L, self._width_L = state["lo"].to(device).clone(), state["width"].to(device).clone()
