"""Per-Head Muon + AdamW in one optimizer (``KimiMuon``), and the rule that splits a model's parameters.

Sources: ``docs/references.md#muon-and-per-head-muon`` (Muon, Per-Head Muon, the AdamW exclusions).

**Muon** (Keller Jordan's Muon; ``torch.optim.Muon``; Moonlight, arXiv 2502.16982) for one matrix
``W [A, B]`` with gradient ``g``, momentum buffer ``m`` (zero at start), momentum μ = 0.95::

    m ← m + (1 − μ)(g − m)                      # lerp form, as torch.optim.Muon / Keller Jordan
    u ← g + μ(m − g)     (Nesterov)   |   u ← m  (nesterov=False)
    O ← NS₅(u)                                   # Newton–Schulz, below
    W ← W · (1 − lr·wd)                          # decoupled weight decay, *unadjusted* lr
    W ← W − lr·s(A, B) · O

with ``s = 0.2·√max(A, B)`` (``adjust_lr_fn="match_rms_adamw"``, Moonlight's RMS match, so Muon can reuse
AdamW's lr and wd; the default here) or ``s = √max(1, A/B)`` (``"original"`` or ``None``, Keller Jordan's
scale, torch's default). The lerp form is ``(1 − μ)×`` Moonlight's ``m ← μm + g; u ← g + μm``; NS₅
normalises its input, so the two forms give the same update up to the 1e-7 eps.

**Newton–Schulz** (quintic, 5 steps, (a, b, c) = (3.4445, −4.7750, 2.0315)): transpose when rows > cols
(a view), ``X ← X / (‖X‖_F + 1e-7)``, then 5× ``A = X Xᵀ; X ← aX + (bA + cA²) X``. Each singular value σ of
the input maps to ``p⁵(σ/‖G‖_F)`` with ``p(s) = as + bs³ + cs⁵`` (singular vectors unchanged), which lands
in roughly (0.5, 1.5) rather than exactly 1 (Keller Jordan's docstring). Computed in ``ns_dtype``: bf16 on
CUDA (as in every public Muon), fp32 elsewhere by default; the norm is accumulated and applied in fp32
(``torch.optim.Muon`` rounds it to bf16 first). bf16 NS leaves the update about 0.8% (Frobenius) from the
exact one, as ``torch.optim.Muon``'s does; fp32 NS about 1e-5.

**Per-Head Muon** (K3 report, section 2.5, quoted in torchtitan's ``kimi_k3/muon.py``): the momentum of a
Q/K/V
projection ``[H·d_h, d_in]`` is viewed as ``H`` blocks ``[d_h, d_in]`` and each block is orthogonalised on
its own (batched). Decision (unspecified by the sources): the lr scale uses
the **block** shape, ``s(d_h, d_in)``, i.e. each head is treated as the matrix Muon updates. The split
follows torchtitan's reading: KDA ``q_proj``/``k_proj``/``v_proj`` (blocks ``[K, D]``), MLA ``q_b_proj``
(``q_proj`` when ``q_lora_rank`` is None; blocks ``[qk_nope + qk_rope, in]``) and ``kv_b_proj`` (blocks
``[qk_nope + v, kv_lora_rank]``, k_nope and v of a head kept together). ``o_proj`` has its head axis on
the input side and gets plain Muon, as does every other hidden matrix.

**Stacked routed experts** ``experts.w1/w3 [E, F, L]``, ``w2 [E, L, F]``: Muon on each expert matrix
(batched NS over E, lr scale from the matrix shape), as if the E matrices were separate parameters.
(torchtitan's step sends non-2-D tensors to AdamW; here they are matrices and get Muon.)

**AdamW** (betas (0.9, 0.95), eps 1e-8, decoupled wd ``W ← W(1 − lr·wd)``; computed by
``torch.optim.AdamW``'s own functional form, fused kernel on CUDA) for what Muon should not see.

**One step, few launches, no host sync** (:meth:`KimiMuon.step`): momentum, Nesterov and weight decay
are ``torch._foreach_*`` ops per group; every Muon matrix of every group is stacked by its ``[M, N]``
shape (heads, experts, same-shape parameters; head blocks and experts are views) and orthogonalised by
one batched NS per shape: per shape one ``_foreach_copy_`` casts the fp32 updates into the stacked NS
input, then per NS step one ``bmm`` and two ``baddbmm`` (k3-1b: 13 shapes for 7,671 matrices, 195 matmuls
per optimizer step); the update is one ``_foreach_add_`` per (group, shape) of the NS output itself (bf16
into the fp32 parameters, summed in fp32; a tall shape's output is the transposed view of its iterate). Per element of an fp32 Muon parameter the step moves about 54
bytes outside the NS (momentum 12, Nesterov 12, cast 6, norm 2 + 4, decay 8, update 10). The NS of
k3-1b's 6,624 experts ``[384, 384]`` is bound by memory more than by FLOPs: each of its 15 batched GEMMs
reads and writes 2 GB of bf16 matrices for 0.75 TFLOP (≈ 100 FLOP/byte, under the H200's ≈ 200).

Partition (first matching rule wins; :func:`partition_parameters`):

=====================================================  =================  ============
parameter                                              kind               weight decay
=====================================================  =================  ============
``requires_grad=False``                                (left out)         —
``*embed_tokens*``, ``*lm_head*``, ``*pos_emb*``       ``adamw``          yes
``*_res_proj.weight`` (AttnRes pseudo-queries [1, D])  ``adamw``          yes
``*conv1d*`` (short convolutions [P, 1, K])            ``adamw``          yes
any 0-/1-D: norms, ``A_log``, ``dt_bias``, biases      ``adamw``          no
KDA q/k/v_proj, MLA q_proj/q_b_proj/kv_b_proj          ``muon_per_head``  yes
router ``block_sparse_moe.gate.weight`` [E, D]         ``muon``           yes
any other 2-D or 3-D (stacked experts)                 ``muon``           yes
any ≥ 4-D (e.g. a vision patch-embedding conv)         ``adamw``          yes
=====================================================  =================  ============

The wd pattern is torchtitan's (``_MUON_EXCLUDE_1D_PATTERNS`` wd 0, embed/lm_head/res_proj/conv1d wd 0.1).
Router decision: torchtitan's catch-all group and Moonlight's "every ≥ 2-D parameter but embedding and
head" both put the router weight into Muon; ``router_muon=False`` moves it to AdamW (with wd). The router
bias ``e_score_correction_bias`` is a buffer (Quantile Balancing overwrites it), so no optimizer sees it.

Legend: ``A, B`` matrix rows/cols, ``H`` heads, ``E`` experts, ``M, N`` rows/cols of one NS matrix,
``…`` batch dims (heads or experts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import Optimizer

from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import MultiheadLatentAttention
from openk3.model.router import MoEGate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Quintic Newton–Schulz coefficients (a, b, c) (Keller Jordan; torch.optim.Muon)."""
NS_STEPS = 5
NS_EPS = 1e-7
"""Added to the Frobenius norm before the first NS step."""
MUON_MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
KINDS = ("muon", "muon_per_head", "adamw")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

_DECAYED_ADAMW = re.compile(r"(^|\.)(embed_tokens|lm_head|pos_emb)(\.|$)|_res_proj\.weight$|_conv1d(\.|$)")
_PER_HEAD_KDA = ("q_proj", "k_proj", "v_proj")
_PER_HEAD_MLA = ("q_proj", "q_b_proj", "kv_b_proj")


# --------------------------------------------------------------------------------------------- math


def newton_schulz(
    G_MN: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate orthogonalisation ``≈ U S' Vᵀ`` (``S'`` ≈ 0.5–1.5) of each matrix in ``G_MN [..., M, N]``.

    Every leading dim is a batch of independent matrices (heads, experts); each is normalised by its own
    Frobenius norm. Computed in ``dtype`` (bf16 or fp32) and returned in ``dtype``, shape ``[..., M, N]``;
    ``G_MN`` is not modified. Raises ``ValueError`` for fewer than 2 dims or a negative ``ns_steps``.
    """
    if G_MN.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of them), got shape {tuple(G_MN.shape)}")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    X = G_MN.to(dtype, memory_format=torch.contiguous_format, copy=True)
    return _newton_schulz_(X, ns_coefficients, ns_steps, eps)


def _newton_schulz_(
    X_MN: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """:func:`newton_schulz` of a contiguous ``X_MN [..., M, N]`` in its own dtype, normalising ``X_MN`` in place.

    The Frobenius norm is accumulated in fp32 and ``X ← X / (‖X‖ + eps)`` computed in fp32 (one rounding to
    the NS dtype). A tall matrix (``M > N``) is iterated as its transpose, a view: the batched products take
    transposed operands as they are, and the result is returned as the transposed view of the iterate (no
    copy). Per step: one ``bmm`` and two ``baddbmm`` for the whole batch (``addmm`` for a single matrix).
    """
    a, b, c = ns_coefficients
    shape = X_MN.shape
    M, N = shape[-2:]
    norm = torch.linalg.vector_norm(X_MN, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    X_MN.div_(norm.add_(eps))
    X = X_MN.reshape(-1, M, N) if X_MN.ndim > 2 else X_MN
    addmm = torch.baddbmm if X.ndim > 2 else torch.addmm
    if M > N:
        X = X.mT
    for _ in range(ns_steps):
        A = X @ X.mT
        B = addmm(A, A, A, beta=b, alpha=c)  # bA + cA²
        X = addmm(X, B, X, beta=a)  # aX + BX
    if M > N:
        X = X.mT
    return X.reshape(shape)


def muon_lr_scale(rows: int, cols: int, adjust_lr_fn: str | None = "match_rms_adamw") -> float:
    """Factor ``s`` in ``W ← W − lr·s·NS(u)`` for one ``[rows, cols]`` matrix (a head block for per-head).

    ``"match_rms_adamw"``: ``0.2·√max(rows, cols)`` (Moonlight); ``"original"``/``None``:
    ``√max(1, rows/cols)`` (Keller Jordan). Raises ``ValueError`` for another name.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}; use one of {ADJUST_LR_FNS}")


def use_fused_adamw(params: list[torch.Tensor]) -> bool:
    """Whether AdamW takes torch's fused kernel (all ``params`` on one CUDA device) or its foreach path."""
    return params[0].device.type == "cuda" and all(p.device == params[0].device for p in params)


# ---------------------------------------------------------------------------------------- partition


@dataclass(frozen=True)
class ParamRole:
    """Where one parameter goes.

    Attributes:
        name: ``named_parameters`` name (official checkpoint names, e.g. ``language_model.model.…``).
        shape: parameter shape.
        kind: ``"muon"``, ``"muon_per_head"`` or ``"adamw"``.
        heads: head blocks for ``muon_per_head`` (1 otherwise).
        matrix: shape of the matrix NS sees and the lr scale uses (``[d_h, d_in]`` per head,
            ``[F, L]`` per expert, the weight itself for plain Muon); ``None`` for AdamW.
        decay: whether weight decay applies.
        rule: which partition rule matched (for the table).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    heads: int
    matrix: tuple[int, int] | None
    decay: bool
    rule: str


def _per_head_weights(model: nn.Module) -> dict[str, int]:
    """``{parameter name: heads}`` for the Q/K/V projections of every KDA and MLA module."""
    heads_of: dict[str, int] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, KimiDeltaAttention):
            names = _PER_HEAD_KDA
        elif isinstance(module, MultiheadLatentAttention):
            names = _PER_HEAD_MLA
        else:
            continue
        for proj in names:
            if isinstance(getattr(module, proj, None), nn.Linear):
                heads_of[f"{mod_name}.{proj}.weight" if mod_name else f"{proj}.weight"] = module.num_heads
    return heads_of


def _router_weights(model: nn.Module) -> set[str]:
    return {f"{n}.weight" if n else "weight" for n, m in model.named_modules() if isinstance(m, MoEGate)}


def partition_parameters(
    model: nn.Module, per_head: bool = True, router_muon: bool = True
) -> list[ParamRole]:
    """Assign every trainable parameter of ``model`` to a kind (rules in the module docstring).

    ``per_head=False`` turns the Q/K/V projections into plain Muon (ablation); ``router_muon=False``
    sends the router weight to AdamW. Order follows ``model.named_parameters()`` (shared tensors once).
    Raises ``ValueError`` when a per-head projection's rows are not a multiple of its head count.
    """
    heads_of = _per_head_weights(model) if per_head else {}
    routers = _router_weights(model)
    roles = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(p.shape)
        if _DECAYED_ADAMW.search(name):
            role = ("adamw", 1, None, True, "embedding / head / AttnRes query / conv")
        elif p.ndim < 2:
            role = ("adamw", 1, None, False, "0-/1-D (norm, A_log, dt_bias, bias)")
        elif name in heads_of:
            H = heads_of[name]
            if p.ndim != 2 or shape[0] % H:
                raise ValueError(f"{name}: shape {shape} does not split into {H} head blocks along dim 0")
            role = ("muon_per_head", H, (shape[0] // H, shape[1]), True, "Q/K/V projection, per head")
        elif name in routers and not router_muon:
            role = ("adamw", 1, None, True, "router (router_muon=False)")
        elif p.ndim in (2, 3):
            rule = "router" if name in routers else ("stacked experts" if p.ndim == 3 else "hidden matrix")
            role = ("muon", 1, shape[-2:], True, rule)
        else:
            role = ("adamw", 1, None, True, ">= 4-D tensor")
        kind, heads, matrix, decay, rule = role
        roles.append(ParamRole(name, shape, kind, heads, matrix, decay, rule))
    return roles


def partition_table(
    model: nn.Module, per_head: bool = True, router_muon: bool = True, collapse_layers: bool = True
) -> str:
    """A Markdown table of :func:`partition_parameters` (for logs and docs).

    With ``collapse_layers`` the layer index in ``layers.{i}.`` becomes ``*`` and rows that then coincide
    are merged, with the layer indices listed.
    """
    rows: dict[tuple, list[str]] = {}
    for r in partition_parameters(model, per_head, router_muon):
        name, layer = r.name, ""
        if collapse_layers:
            m = re.search(r"\.layers\.(\d+)\.", name)
            if m:
                layer = m.group(1)
                name = name[: m.start()] + ".layers.*." + name[m.end() :]
        matrix = "×".join(map(str, r.matrix)) if r.matrix else "—"
        blocks = f"{r.heads} × {matrix}" if r.kind == "muon_per_head" else matrix
        key = (name, "×".join(map(str, r.shape)), r.kind, blocks, "yes" if r.decay else "no", r.rule)
        rows.setdefault(key, []).append(layer)
    lines = [
        "| parameter | layers | shape | kind | NS matrix | wd | rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, shape, kind, blocks, wd, rule), layers in rows.items():
        where = ",".join(layers) if layers[0] else "—"
        lines.append(f"| {name} | {where} | {shape} | {kind} | {blocks} | {wd} | {rule} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- optimizer


class KimiMuon(Optimizer):
    """Muon, Per-Head Muon and AdamW behind one ``torch.optim.Optimizer`` (one state dict, one scheduler).

    Every param group carries ``kind`` (``"muon"`` default, ``"muon_per_head"``, ``"adamw"``) and
    ``heads`` (per-head block count; 1 otherwise). Group keys and defaults:

    * all: ``lr`` (1e-3), ``weight_decay`` (0.1; decoupled, ``W ← W(1 − lr·wd)``).
    * Muon kinds: ``momentum`` (0.95), ``nesterov`` (True), ``ns_coefficients`` (3.4445, −4.7750, 2.0315),
      ``ns_steps`` (5), ``ns_eps`` (1e-7), ``ns_dtype`` (None = bf16 on CUDA, fp32 elsewhere),
      ``adjust_lr_fn`` (``"match_rms_adamw"``; or ``"original"``/None).
    * AdamW: ``betas`` (0.9, 0.95), ``eps`` (1e-8).

    State per parameter: Muon ``momentum_buffer`` (grad's dtype and shape); AdamW ``step`` (fp32 0-d
    tensor: on the parameter's CUDA device for the fused kernel, else on the CPU), ``exp_avg``,
    ``exp_avg_sq``. With ``kind="muon"``, ``heads=1`` and ``ns_dtype=torch.bfloat16``
    a 2-D parameter follows ``torch.optim.Muon`` (same momentum form, NS, lr scale and decay).

    Raises ``ValueError`` for an unknown ``kind`` or ``adjust_lr_fn``, a Muon parameter that is not 2-D/3-D,
    or a per-head parameter that is not 2-D with rows divisible by ``heads``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = MUON_MOMENTUM,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
        ns_eps: float = NS_EPS,
        ns_dtype: torch.dtype | None = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        betas: tuple[float, float] = ADAMW_BETAS,
        eps: float = ADAMW_EPS,
    ) -> None:
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError(
                f"lr, weight_decay and momentum must be >= 0, got {lr}, {weight_decay}, {momentum}"
            )
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            kind="muon",
            heads=1,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            ns_eps=ns_eps,
            ns_dtype=ns_dtype,
            adjust_lr_fn=adjust_lr_fn,
            betas=tuple(betas),
            eps=eps,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        kind, H = group["kind"], group["heads"]
        if kind not in KINDS:
            raise ValueError(f"param group kind={kind!r}; use one of {KINDS}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={group['adjust_lr_fn']!r}; use one of {ADJUST_LR_FNS}")
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"], strict=True):
            label = name or f"a parameter of shape {tuple(p.shape)}"
            if kind == "muon" and p.ndim not in (2, 3):
                raise ValueError(f"{label}: Muon takes 2-D matrices or 3-D stacks of them, got {p.ndim}-D")
            if kind == "muon_per_head" and (p.ndim != 2 or p.shape[0] % H):
                raise ValueError(
                    f"{label}: per-head Muon needs a 2-D weight with rows divisible by heads={H}"
                )

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given.

        No host-device sync: Muon runs one batched Newton–Schulz per matrix shape (all Muon groups
        together) and ``torch._foreach_*`` updates; AdamW is torch's fused kernel on CUDA and its
        multi-tensor (foreach) path elsewhere.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([g for g in self.param_groups if g["kind"] != "adamw"])
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        """Momentum and weight decay per group with ``torch._foreach_*``; then one Newton–Schulz per bucket of
        same-shape matrices across all Muon groups (heads, experts and parameters stacked), and one
        ``_foreach_add_`` per (group, shape). A model's hundreds of matrices cost a few dozen launches."""
        items = []
        for group in groups:
            params, updates = self._momentum(group)
            items += [(group, p, self._whole(u)) for p, u in zip(params, updates, strict=True)]
        outs = self._orthogonalise(items)
        self._apply(
            [
                (group, *self._update_target(p, o_bMN, u), *o_bMN.shape[-2:])
                for (group, p, u), o_bMN in zip(items, outs, strict=True)
            ]
        )

    def _momentum(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(params, updates)`` of the group's parameters that have a gradient: momentum (lerp), Nesterov
        and the decoupled weight decay (applied to the parameters here)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return [], []
        grads = [p.grad for p in params]
        bufs = []
        for p, g in zip(params, grads, strict=True):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        if group["lr"] * group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        return params, updates

    @staticmethod
    def _ns_matrices(group: dict, u: torch.Tensor) -> torch.Tensor:
        """The whole update ``u`` as the ``[b, M, N]`` matrices Newton–Schulz sees (head blocks, experts)."""
        if group["kind"] == "muon_per_head":
            u = u.reshape(group["heads"], -1, u.shape[-1])  # [H, d_h, d_in]
        return u.reshape(-1, *u.shape[-2:])

    def _orthogonalise(self, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """``NS(u)`` as ``[b, M, N]`` in the NS dtype for each ``(group, p, whole update u)``, in order: one
        batched Newton–Schulz per bucket of same-shape matrices (and NS settings, device). The bucket's
        input is written by one ``_foreach_copy_`` (casting to the NS dtype) into views of one
        ``[Σb, M, N]`` tensor, and each output is a view of the bucket's result: no ``cat``, no fp32 copy of
        the bucket, no cast back (:meth:`_apply` adds the NS-dtype output to the parameter)."""
        buckets: dict[tuple, list[int]] = {}
        mats = []
        for i, (group, p, u) in enumerate(items):
            u_bMN = self._ns_matrices(group, u)
            mats.append(u_bMN)
            ns_key = (group["ns_coefficients"], group["ns_steps"], group["ns_eps"], group["ns_dtype"])
            buckets.setdefault((*u_bMN.shape[-2:], p.device, ns_key), []).append(i)
        outs: list[torch.Tensor | None] = [None] * len(items)
        for (M, N, device, (coefficients, steps, eps, ns_dtype)), members in buckets.items():
            ns_dtype = ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            sizes = [mats[i].shape[0] for i in members]
            X_bMN = torch.empty((sum(sizes), M, N), dtype=ns_dtype, device=device)
            torch._foreach_copy_(list(X_bMN.split(sizes)), [mats[i] for i in members])
            O_bMN = _newton_schulz_(X_bMN, coefficients, steps, eps)
            for i, o_bMN in zip(members, O_bMN.split(sizes), strict=True):
                outs[i] = o_bMN
        return outs

    def _apply(self, entries: list[tuple[dict, torch.Tensor, torch.Tensor, int, int]]) -> None:
        """``target ← target − lr·s(M, N)·out`` for each ``(group, target, out, M, N)``: one
        ``_foreach_add_`` per (group, NS matrix shape). ``out`` may be in the NS dtype (bf16 under an fp32
        parameter): the sum is then taken in fp32 per tensor (torch's foreach falls back to one ``add_`` per
        tensor for mixed dtypes), reading the bf16 output once instead of casting it to fp32 first."""
        per_key: dict[tuple, tuple[dict, list[torch.Tensor], list[torch.Tensor]]] = {}
        for group, target, out, M, N in entries:
            _, targets, outs = per_key.setdefault((id(group), M, N), (group, [], []))
            targets.append(target)
            outs.append(out)
        for (_, M, N), (group, targets, outs) in per_key.items():
            scale = muon_lr_scale(M, N, group["adjust_lr_fn"])
            torch._foreach_add_(targets, outs, alpha=-group["lr"] * scale)

    def _whole(self, u: torch.Tensor) -> torch.Tensor:
        """The whole update matrix Newton–Schulz must see (a sharded optimizer gathers it here)."""
        return u

    def _update_target(self, p: torch.Tensor, o_bMN: torch.Tensor, u: torch.Tensor):
        """``(tensor to update, its update)`` for parameter ``p`` and its orthogonalised ``o_bMN``."""
        if p.is_contiguous():  # update through a [b, M, N] view: same shapes for the foreach op
            return p.view(o_bMN.shape), o_bMN
        return p, o_bMN.reshape(p.shape)

    def _adamw_step(self, group: dict) -> None:
        """``torch.optim.AdamW``'s arithmetic through its functional form: the fused kernel on CUDA (step
        counts on the device), the multi-tensor path elsewhere (step counts on the CPU, read without a
        device sync). Step tensors on the other device (a checkpoint from another machine) are moved."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        fused = use_fused_adamw(params)
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            step_device = p.device if fused else torch.device("cpu")
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != step_device:
                state["step"] = state["step"].to(step_device)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw_functional(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not fused,
            fused=fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def build_optimizer(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    muon_lr: float | None = None,
    adamw_lr: float | None = None,
    *,
    momentum: float = MUON_MOMENTUM,
    nesterov: bool = True,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype | None = None,
    adjust_lr_fn: str | None = "match_rms_adamw",
    per_head: bool = True,
    router_muon: bool = True,
) -> KimiMuon:
    """One :class:`KimiMuon` over the trainable parameters of ``model`` split by :func:`partition_parameters`.

    ``muon_lr``/``adamw_lr`` default to ``lr`` (with ``"match_rms_adamw"`` both kinds share one lr, as in
    Moonlight). ``weight_decay`` applies to Muon groups and the decayed AdamW group; 0-/1-D parameters get 0.
    Groups are one per (kind, heads, decay), each with ``param_names``; a ``LambdaLR`` scales all of them.
    """
    muon_lr = lr if muon_lr is None else muon_lr
    adamw_lr = lr if adamw_lr is None else adamw_lr
    params = dict(model.named_parameters())
    groups: dict[tuple[str, int, bool], dict] = {}
    for r in partition_parameters(model, per_head, router_muon):
        key = (r.kind, r.heads, r.decay)
        if key not in groups:
            groups[key] = dict(
                params=[],
                kind=r.kind,
                heads=r.heads,
                lr=adamw_lr if r.kind == "adamw" else muon_lr,
                weight_decay=weight_decay if r.decay else 0.0,
            )
        groups[key]["params"].append((r.name, params[r.name]))
    return KimiMuon(
        list(groups.values()),
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        adjust_lr_fn=adjust_lr_fn,
        betas=betas,
        eps=eps,
    )
