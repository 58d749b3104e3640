"""Argument checks and preparation shared by the three KDA ops (naive, chunk, fused_recurrent) and the pool
decode (``check_step_states``, which its torch and Triton paths share).

Every op takes the same tensors (fla ``chunk_kda`` naming, ``docs/references.md#kda-op-arguments``) and first
turns them
into :class:`KDAInputs`: cast to the compute dtype, q/k optionally L2-normalised, q multiplied by ``scale``,
the gate optionally applied, the sequences described by their lengths.

Legend: ``B`` batch, ``T`` tokens per row, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` sequences
(``B`` rows, or the ``len(cu_seqlens) − 1`` documents of a packed row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openk3.ops.kda.gate import _check_gate_args, kda_gate
from openk3.ops.kda.l2norm import l2norm


@dataclass(frozen=True)
class KDAInputs:
    """Prepared inputs, all in the compute dtype (float32, or float64 for float64 inputs)."""

    q: torch.Tensor
    """``[B, T, H, K]`` queries, L2-normalised if asked, times ``scale``."""
    k: torch.Tensor
    """``[B, T, H, K]`` keys, L2-normalised if asked."""
    v: torch.Tensor
    """``[B, T, H, V]`` values."""
    g: torch.Tensor
    """``[B, T, H, K]`` log-decay (natural log, ≤ 0), after the in-op gate if any."""
    beta: torch.Tensor
    """``[B, T, H]`` delta-rule strengths."""
    h0: torch.Tensor | None
    """``[N, H, K, V]`` initial states, or None for zeros."""
    seq_lens: tuple[int, ...] | None
    """Document lengths of the packed row (``cu_seqlens`` given), or None: ``B`` rows of ``T`` tokens."""
    out_dtype: torch.dtype
    """dtype of the returned ``o`` (``v.dtype``)."""

    @property
    def num_seqs(self) -> int:
        return self.q.shape[0] if self.seq_lens is None else len(self.seq_lens)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.q.dtype

    def zero_state(self) -> torch.Tensor:
        """``[N, H, K, V]`` zeros in the compute dtype."""
        _, _, H, K = self.q.shape
        V = self.v.shape[-1]
        return self.q.new_zeros(self.num_seqs, H, K, V)


def compute_dtype_of(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (fp16/bf16/fp32 all compute in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def prepare_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> KDAInputs:
    """Check the arguments of a KDA op and prepare them (see the op docstrings for their meaning; with
    ``use_beta_sigmoid_in_kernel`` ``beta`` holds logits and becomes ``σ(beta)`` in the compute dtype).

    Raises:
        ValueError: on any shape, dtype or ``cu_seqlens`` problem; the message names the argument.
    """
    seq_lens = check_kda_args(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound,
    )  # fmt: skip
    K = q.shape[-1]
    dtype = compute_dtype_of(q, k, v, g, beta)
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = g.to(dtype) if A_log is None else kda_gate(g.to(dtype), A_log, dt_bias, lower_bound)
    return KDAInputs(
        q=q * (K**-0.5 if scale is None else scale),
        k=k,
        v=v.to(dtype),
        g=g,
        beta=torch.sigmoid(beta.to(dtype)) if use_beta_sigmoid_in_kernel else beta.to(dtype),
        h0=initial_state,
        seq_lens=seq_lens,
        out_dtype=v.dtype,
    )


def check_kda_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> tuple[int, ...] | None:
    """Every check of :func:`prepare_kda_inputs` (the gate's too), without preparing anything.

    Returns:
        The document lengths of a packed row (``cu_seqlens`` given), or None.

    Raises:
        ValueError: as :func:`prepare_kda_inputs`.
    """
    _check_shapes(q, k, v, g, beta)
    B, T, H, K = q.shape
    seq_lens = _seq_lens_of(cu_seqlens, B, T)
    num_seqs = B if seq_lens is None else len(seq_lens)
    _check_state(initial_state, (num_seqs, H, K, v.shape[-1]), compute_dtype_of(q, k, v, g, beta))
    _check_gate_params(A_log, dt_bias, lower_bound)
    if A_log is not None:
        _check_gate_args(g, A_log, dt_bias, lower_bound)
    return seq_lens


def _check_shapes(q, k, v, g, beta) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor; got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T == 0 or K == 0:
        raise ValueError(f"q must have T >= 1 and K >= 1; got shape {tuple(q.shape)}")
    expected = {"k": (k, (B, T, H, K)), "g": (g, (B, T, H, K)), "beta": (beta, (B, T, H))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (from q); got {list(t.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H) or v.shape[-1] == 0:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V >= 1]; got {list(v.shape)}")


def _seq_lens_of(cu_seqlens: torch.Tensor | None, B: int, T: int) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"cu_seqlens needs the documents packed in one row (B == 1); got B = {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int64 tensor [N+1] with N >= 1; got {cu_seqlens.dtype} "
            f"of shape {list(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}; got {offsets[0]} … {offsets[-1]}")
    lens = tuple(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True))
    if min(lens) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing; got {offsets}")
    return lens


def _check_state(h0: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if h0 is None:
        return
    if tuple(h0.shape) != shape:
        raise ValueError(f"initial_state must be [N, H, K, V] = {list(shape)}; got {list(h0.shape)}")
    if h0.dtype != dtype:
        raise ValueError(
            f"initial_state must be {dtype} (the compute dtype: float64 for float64 inputs, else float32); "
            f"got {h0.dtype}"
        )


def _check_gate_params(A_log, dt_bias, lower_bound) -> None:
    if A_log is None and (dt_bias is not None or lower_bound is not None):
        raise ValueError(
            "dt_bias / lower_bound apply only with the in-op gate: pass A_log (zeros give exp(A_log) = 1), "
            "or pass g already as the log-decay"
        )


def check_step_states(step_states: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``step_states`` is ``None`` or a contiguous ``dtype`` tensor of ``shape``
    (``[N, T, H, K, V]``: the state after each of the ``T`` tokens)."""
    if step_states is not None and (
        tuple(step_states.shape) != tuple(shape)
        or step_states.dtype != dtype
        or not step_states.is_contiguous()
    ):
        raise ValueError(
            f"step_states must be contiguous {dtype} {list(shape)}; got {step_states.dtype} {list(step_states.shape)}"
        )
