"""KDA ops against the float64 recurrent reference, gradient by gradient.

The oracle is :func:`naive_recurrent_kda` on float64 inputs (the exact recurrence of kda_kernels reference
§1.2). :func:`chunk_kda` (fp64 and fp32) and :func:`fused_recurrent_kda` must match it for ``o``, the final
state and every gradient: dq, dk, dv, dg, dβ, dh0, and dA_log, ddt_bias when the gate is applied in the op.

Legend: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` sequences.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import openk3.ops.kda.chunk_intra as chunk_intra
from kda_compare import assert_close, rel_rmse  # noqa: F401
from openk3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, l2norm, naive_recurrent_kda

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-12, F32: 5e-5}
"""Relative RMSE allowed against the fp64 reference, for o, the state and every gradient."""
H, K, V = 2, 32, 24


# ----------------------------------------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(B: int, T: int, *, N: int | None = None, gate: str = "logsigmoid", seed: int = 0) -> dict:
    """fp64 leaves: q, k, v ~ N(0, 1) (l2-normalised in the op), β = σ(N(0, 1)), h0 ~ N(0, 0.5²).

    ``gate``: ``logsigmoid`` log-decay in (−∞, 0), ``zero``, ``lb`` (−5 everywhere), ``hard`` (−50
    everywhere), ``mixed`` (logsigmoid with 10 % of the entries −50), or ``raw`` (a pre-activation for the
    in-op gates).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * std

    g = randn(B, T, H, K)
    gates = {
        "logsigmoid": lambda: F.logsigmoid(g),
        "zero": lambda: torch.zeros_like(g),
        "lb": lambda: torch.full_like(g, -5.0),
        "hard": lambda: torch.full_like(g, -50.0),
        "mixed": lambda: torch.where(torch.rand(g.shape, generator=gen) < 0.1, -50.0, F.logsigmoid(g)),
        "raw": lambda: 2.0 * g,
    }
    return dict(
        q=randn(B, T, H, K),
        k=randn(B, T, H, K),
        v=randn(B, T, H, V),
        g=gates[gate](),
        beta=torch.sigmoid(randn(B, T, H)),
        initial_state=randn(B if N is None else N, H, K, V, std=0.5),
    )


def gate_params(lower_bound: float | None, seed: int = 1) -> dict:
    """``A_log`` padded past H (the op uses the first H), ``dt_bias`` ``[H*K]``, as in the checkpoints."""
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.empty(H + 3, dtype=F64).uniform_(1, 16, generator=gen))
    dt_bias = torch.empty(H * K, dtype=F64).uniform_(-6.9, -2.25, generator=gen)
    return dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)


def run(op, inputs: dict, dtype: torch.dtype, seed: int = 7, **kwargs) -> dict:
    """Run ``op`` on copies of ``inputs`` cast to ``dtype`` (the state to fp32/fp64), backward a fixed
    random projection of ``(o, final_state)``, and return the outputs and the gradients of every input."""
    leaves = {
        name: t.to(dtype).detach().requires_grad_(t.is_floating_point())
        for name, t in inputs.items()
        if isinstance(t, torch.Tensor) and name != "cu_seqlens"
    }
    extra = {name: v for name, v in inputs.items() if name not in leaves}
    o, ht = op(**leaves, **extra, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    do, dht = cotangents(o, ht, seed)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return {"o": o, "ht": ht} | {f"d{name}": t.grad for name, t in leaves.items()}


def cotangents(o: torch.Tensor, ht: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed random projections of ``(o, final_state)`` that the backward runs, drawn as bf16 values so
    that every dtype's run, the fp64 reference's included, back-propagates exactly the same cotangent (a
    bf16 run's rounding of it would otherwise count as the op's error)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64).to(torch.bfloat16).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=F64).to(torch.bfloat16).to(ht.dtype)
    return do, dht


def assert_all_close(ref: dict, out: dict, tol: float) -> None:
    assert ref.keys() == out.keys()
    for name in ref:
        assert_close(name, ref[name], out[name], tol)


def per_document_reference(inputs: dict, cu_seqlens: list[int]) -> dict:
    """Naive fp64 run of each document separately (its own row, its own initial state); one backward."""
    leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
    o_list, ht_list = [], []
    for n, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        h0 = leaves["initial_state"][n : n + 1]
        if a == b:  # an empty document: no tokens, its state passes through
            ht_list.append(h0)
            continue
        doc = {name: leaves[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        o, ht = naive_recurrent_kda(
            **doc, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        o_list.append(o)
        ht_list.append(ht)
    o, ht = torch.cat(o_list, dim=1), torch.cat(ht_list)
    do, dht = cotangents(o, ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return {"o": o, "ht": ht} | {f"d{name}": t.grad for name, t in leaves.items()}


@functools.cache
def reference(B: int, T: int, gate: str, lower_bound: float | None = None, in_op_gate: bool = False) -> dict:
    """Cached fp64 naive outputs and gradients for one case (shared by the fp64 and fp32 tests)."""
    inputs = make_inputs(B, T, gate=gate)
    if in_op_gate:
        inputs |= gate_params(lower_bound)
    return run(naive_recurrent_kda, inputs, F64)


def case_inputs(B, T, gate, lower_bound=None, in_op_gate=False) -> dict:
    inputs = make_inputs(B, T, gate=gate)
    return inputs | gate_params(lower_bound) if in_op_gate else inputs


# ----------------------------------------------------------------------------- chunk vs the fp64 oracle


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 65, 1000])
def test_chunk_matches_naive(T, dtype):
    B = 1 if T == 1000 else 2
    out = run(chunk_kda, case_inputs(B, T, "logsigmoid"), dtype)
    assert_all_close(reference(B, T, "logsigmoid"), out, TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "k3"])
def test_chunk_with_gate_in_op(lower_bound, dtype):
    """g is the raw pre-activation; dA_log and ddt_bias are compared too."""
    args = (2, 100, "raw", lower_bound, True)
    out = run(chunk_kda, case_inputs(*args), dtype)
    assert {"dA_log", "ddt_bias"} <= out.keys()
    assert_all_close(reference(*args), out, TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("gate", ["zero", "lb", "hard", "mixed"])
def test_chunk_extreme_gates(gate, dtype):
    """No decay; −5 everywhere (the K3 bound); −50 everywhere; 10 % hard resets: exact, finite gradients."""
    out = run(chunk_kda, case_inputs(1, 150, gate), dtype)
    assert_all_close(reference(1, 150, gate), out, TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_chunk_k3_gate_saturated(dtype):
    """K3 gate with huge raw inputs: every log-decay sits at (or next to) the bounds −5 and 0."""
    inputs = make_inputs(1, 130, gate="raw") | gate_params(-5.0)
    inputs["g"] = inputs["g"] * 1e3
    ref = run(naive_recurrent_kda, inputs, F64)
    assert_all_close(ref, run(chunk_kda, inputs, dtype), TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_chunk_very_negative_softplus_gate(dtype):
    """Kimi-Linear's unbounded gate at g_raw = +60: log-decays around −60·e^{A_log}, down to about −960."""
    inputs = make_inputs(1, 80, gate="raw") | gate_params(None)
    inputs["g"] = torch.full_like(inputs["g"], 60.0)
    ref = run(naive_recurrent_kda, inputs, F64)
    out = run(chunk_kda, inputs, dtype)
    for name in ("o", "ht", "dq", "dk", "dv", "dbeta"):
        assert_close(name, ref[name], out[name], TOL[dtype])
    for name in ("dg", "dA_log", "ddt_bias", "dinitial_state"):  # true values ~e^{-60}, below fp32's reach
        if dtype == F64:
            assert_close(name, ref[name], out[name], TOL[dtype])
        else:
            assert torch.isfinite(out[name]).all(), name
            assert (out[name].double() - ref[name]).abs().max() <= 1e-6, name


CAUSAL_GATES = {
    "logsigmoid": dict(gate="logsigmoid"),
    "mixed_hard": dict(gate="mixed"),
    "k3_in_op": dict(gate="raw", lower_bound=-5.0),
    "softplus_in_op": dict(gate="raw", lower_bound=None),
}
"""Gate cases of the causality test: log-decays given (with and without −50 hard resets, which make wide
diagonal-block columns), and the raw gate through the K3 / Kimi-Linear gates in the op."""


def causal_run(inputs: dict, dtype: torch.dtype, t: int, lower_bound) -> dict:
    """chunk_kda on leaf copies of ``inputs`` (cast to ``dtype``), backward of ``Σ_{i<t} o_i·do_i`` only (no
    cotangent on later outputs or the final state); outputs and gradients before ``t``, and the gate
    parameters' gradients (sums over every token, of which those at or after ``t`` are 0)."""
    leaves = {n: x.to(dtype).detach().requires_grad_() for n, x in inputs.items()}
    kw = {} if "A_log" not in inputs else dict(lower_bound=lower_bound)
    o, _ = chunk_kda(**leaves, use_qk_l2norm_in_kernel=True, **kw)
    do, _ = cotangents(o, o[:, :1, :, :1])
    (o[:, :t] * do[:, :t]).sum().backward()
    out = {"o": o[:, :t], "o_after": o[:, t:]}
    for name, x in leaves.items():
        past = x.grad if name in ("initial_state", "A_log", "dt_bias") else x.grad[:, :t]
        out[f"d{name}"] = past
    return out


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CAUSAL_GATES))
@pytest.mark.parametrize("t", [1, 7, 16, 40, 64, 100])
def test_chunk_causal_bitwise(t, case, dtype):
    """Changing every input at or after position t (q, k, v, the gate, β) changes no output before t and
    no gradient of an earlier input, bit for bit: forward, and backward of a loss on the outputs before t
    (including ``dA_log``/``ddt_bias`` with the gate in the op, and ``dh0``). Positions inside a 16-token
    sub-chunk and a 64-token chunk (1, 7, 40, 100) and at their starts (16, 64)."""
    spec = CAUSAL_GATES[case]
    inputs = make_inputs(2, 130, gate=spec["gate"], seed=21)
    other = make_inputs(2, 130, gate=spec["gate"], seed=22)
    if "lower_bound" in spec:
        inputs |= {n: x for n, x in gate_params(spec["lower_bound"]).items() if n != "lower_bound"}
    changed = dict(inputs)
    for name in ("q", "k", "v", "g", "beta"):
        changed[name] = torch.cat([inputs[name][:, :t], other[name][:, t:]], dim=1)
    a = causal_run(inputs, dtype, t, spec.get("lower_bound"))
    b = causal_run(changed, dtype, t, spec.get("lower_bound"))
    assert not torch.equal(a.pop("o_after"), b.pop("o_after"))  # the change reaches the later outputs
    for name in a:
        assert torch.equal(a[name], b[name]), (
            f"{name} before t={t} moved: max {(a[name] - b[name]).abs().max()}"
        )


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("op", [chunk_kda, naive_recurrent_kda], ids=["chunk", "naive"])
def test_k3_gate_rate_overflow_gives_fp64_limits(op, dtype):
    """K3 gate with ``A_log = 100`` (``e^{A_log}`` overflows fp32): every log-decay is at −5 or 0 and the gate's
    gradients are 0, as in fp64 (where they are exactly 0), not NaN; the rest matches fp64."""
    inputs = make_inputs(1, 90, gate="raw", seed=5) | gate_params(-5.0)
    inputs["A_log"] = torch.full_like(inputs["A_log"], 100.0)
    ref = run(naive_recurrent_kda, inputs, F64)
    out = run(op, inputs, dtype)
    for name in ("dg", "dA_log", "ddt_bias"):
        assert torch.equal(ref[name], torch.zeros_like(ref[name])), name  # the fp64 limit
    assert_all_close(ref, out, TOL[dtype])


def very_negative_gates(kind: str) -> tuple[dict, dict]:
    """Inputs whose log-decays reach −1e38 or below in fp32, and their gate keywords: ``direct`` (the
    log-decay given: logsigmoid with a fifth of the entries −1e38, whose 64-token sums overflow fp32 to −inf),
    ``softplus`` (Kimi-Linear gate, ``A_log`` 87 and 88: rates 6e37 and 1.7e38 times softplus of a raw
    gate ~ 2·N(0, 1))."""
    inputs = make_inputs(1, 150, gate="raw", seed=6)
    if kind == "direct":
        gen = torch.Generator().manual_seed(8)
        hard = torch.rand(inputs["g"].shape, generator=gen, dtype=F64) < 0.2
        inputs["g"] = torch.where(hard, -1e38, F.logsigmoid(inputs["g"]))
        return inputs, {}
    params = gate_params(None)
    params["A_log"][:H] = torch.tensor([87.0, 88.0], dtype=F64)
    return inputs | params, {}


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["direct", "softplus"])
def test_chunk_log_decay_below_minus_1e38(kind, dtype):
    """Log-decays ≤ −1e38 (given, or from the Kimi-Linear gate at ``A_log`` ≥ 87): the chunk form's outputs
    and every gradient are finite, as the recurrent ops', and match the fp64 recurrence."""
    inputs, kw = very_negative_gates(kind)
    ref = run(naive_recurrent_kda, inputs, F64, **kw)
    for op in (naive_recurrent_kda, chunk_kda):
        out = run(op, inputs, dtype, **kw)
        for name, value in out.items():
            assert torch.isfinite(value).all(), f"{op.__name__}: {name} not finite"
    assert_all_close(ref, out, TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_chunk_beta_one_identical_keys(dtype):
    """β = 1 with the same key at every position: each token fully overwrites the previous value."""
    inputs = make_inputs(1, 100, gate="logsigmoid")
    inputs["k"] = inputs["k"][:, :1].expand_as(inputs["k"]).clone()
    inputs["beta"] = torch.ones_like(inputs["beta"])
    ref = run(naive_recurrent_kda, inputs, F64)
    assert_all_close(ref, run(chunk_kda, inputs, dtype), TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_diagonal_block_paths_agree(dtype, monkeypatch):
    """The factorised diagonal blocks equal the pairwise ones (forced for every block), gradients included."""
    inputs = case_inputs(2, 100, "logsigmoid")
    factorised = run(chunk_kda, inputs, dtype)
    monkeypatch.setitem(chunk_intra.FACTORISED_SPAN_LIMIT, dtype, -1.0)
    assert_all_close(run(chunk_kda, inputs, dtype), factorised, TOL[dtype] / 10)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes(chunk_size):
    out = run(chunk_kda, case_inputs(2, 65, "logsigmoid"), F64, chunk_size=chunk_size)
    assert_all_close(reference(2, 65, "logsigmoid"), out, TOL[F64])


# ---------------------------------------------------------------------------------------------- varlen

CU_SEQLENS = [0, 15, 100, 163, 300]


@functools.cache
def varlen_reference() -> dict:
    return per_document_reference(make_inputs(1, 300, N=4, seed=3), CU_SEQLENS)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_chunk_varlen_matches_per_document_naive(dtype):
    inputs = make_inputs(1, 300, N=4, seed=3) | {"cu_seqlens": torch.tensor(CU_SEQLENS)}
    assert_all_close(varlen_reference(), run(chunk_kda, inputs, dtype), TOL[dtype])


@pytest.mark.parametrize("op", [naive_recurrent_kda, fused_recurrent_kda], ids=["naive", "fused_recurrent"])
def test_recurrent_varlen_matches_per_document_naive(op):
    inputs = make_inputs(1, 300, N=4, seed=3) | {"cu_seqlens": torch.tensor(CU_SEQLENS)}
    assert_all_close(varlen_reference(), run(op, inputs, F64), TOL[F64])


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "fused_recurrent"])
def test_varlen_empty_document_keeps_its_state(op):
    cu_seqlens = [0, 20, 20, 90]
    inputs = make_inputs(1, 90, N=3, seed=4)
    ref = per_document_reference(inputs, cu_seqlens)
    out = run(op, inputs | {"cu_seqlens": torch.tensor(cu_seqlens)}, F64)
    assert_all_close(ref, out, TOL[F64])
    assert torch.equal(out["ht"][1], inputs["initial_state"][1])


# ---------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "k3"])
def test_fused_recurrent_matches_naive(lower_bound):
    inputs = case_inputs(2, 40, "raw", lower_bound, in_op_gate=True)
    ref = run(naive_recurrent_kda, inputs, F64)
    assert_all_close(ref, run(fused_recurrent_kda, inputs, F64), 1e-13)


@pytest.mark.parametrize(
    "op", [chunk_kda, fused_recurrent_kda, naive_recurrent_kda], ids=["chunk", "fused_recurrent", "naive"]
)
def test_beta_sigmoid_in_op_matches_sigmoid_outside(op):
    """``use_beta_sigmoid_in_kernel``: β given as logits gives the naive fp64 result on ``σ(logits)``, the
    gradient taken w.r.t. the logits (through ``torch.sigmoid`` outside the reference)."""
    inputs = case_inputs(2, 40, "raw", -5.0, in_op_gate=True)
    inputs["beta"] = 3.0 * torch.logit(inputs["beta"])  # logits spanning σ ≈ 0.0003 .. 0.9997

    def naive_on_logits(beta, **kw):
        return naive_recurrent_kda(beta=torch.sigmoid(beta), **kw)

    ref = run(naive_on_logits, inputs, F64)
    out = run(op, inputs, F64, use_beta_sigmoid_in_kernel=True)
    assert_all_close(ref, out, 1e-10)
    assert ref["dbeta"].abs().max() > 1e-3  # the logits' gradient is not trivially 0


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
def test_prefill_then_decode_equals_one_pass(dtype):
    """chunk_kda over the first T0 tokens, then fused_recurrent_kda token by token from its state."""
    T, T0 = 90, 70
    inputs = make_inputs(2, T, gate="raw")
    tokens = {name: inputs[name].to(dtype) for name in ("q", "k", "v", "g", "beta")}
    params = gate_params(-5.0)
    common = dict(
        use_qk_l2norm_in_kernel=True, output_final_state=True, A_log=params["A_log"].to(dtype),
        dt_bias=params["dt_bias"].to(dtype), lower_bound=-5.0,
    )  # fmt: skip
    h0 = inputs["initial_state"].to(dtype)
    with torch.no_grad():
        o_full, ht_full = chunk_kda(**tokens, initial_state=h0, **common)
        o_prefill, state = chunk_kda(**{n: x[:, :T0] for n, x in tokens.items()}, initial_state=h0, **common)
        o_steps = [o_prefill]
        for t in range(T0, T):
            step = {n: x[:, t : t + 1] for n, x in tokens.items()}
            o_t, state = fused_recurrent_kda(**step, initial_state=state, **common)
            o_steps.append(o_t)
    assert_close("o", o_full, torch.cat(o_steps, dim=1), TOL[dtype])
    assert_close("ht", ht_full, state, TOL[dtype])


# ------------------------------------------------------------------------------------ gates and l2norm


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_softplus_gate_closed_form(with_bias):
    params = gate_params(None)
    x = torch.randn(3, 5, H, K, dtype=F64, generator=torch.Generator().manual_seed(0)) * 4
    dt_bias = params["dt_bias"] if with_bias else None
    z = x + (params["dt_bias"].view(H, K) if with_bias else 0.0)
    expected = -params["A_log"][:H].exp().view(H, 1) * torch.log1p(torch.exp(z))
    assert_close("softplus", expected, kda_gate(x, params["A_log"], dt_bias), 1e-14)


def test_k3_gate_closed_form_and_range():
    params = gate_params(-5.0)
    x = torch.randn(3, 5, H, K, dtype=F64, generator=torch.Generator().manual_seed(0)) * 4
    z = params["A_log"][:H].exp().view(H, 1) * (x + params["dt_bias"].view(H, K))
    g = kda_gate(x, params["A_log"], params["dt_bias"], lower_bound=-5.0)
    assert_close("k3 gate", -5.0 / (1 + torch.exp(-z)), g, 1e-14)
    assert ((g >= -5.0) & (g <= 0.0)).all()


def test_gate_dtypes():
    params = gate_params(None)
    A_log32, bias32 = params["A_log"].float(), params["dt_bias"].float()
    assert kda_gate(torch.zeros(2, H, K, dtype=torch.bfloat16), A_log32, bias32).dtype == F32
    assert kda_gate(torch.zeros(2, H, K, dtype=F64), A_log32, bias32).dtype == F64


@pytest.mark.parametrize("lower_bound", [0.0, 1.0, float("-inf"), float("nan")])
def test_gate_rejects_bad_lower_bound(lower_bound):
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.zeros(2, H, K), torch.zeros(H), lower_bound=lower_bound)


def test_l2norm_closed_form():
    x = torch.randn(4, 7, K, dtype=F64)
    assert_close("l2norm", x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), l2norm(x), 1e-15)


# ------------------------------------------------------------------------------------ dtypes and errors


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda, naive_recurrent_kda])
def test_half_inputs_compute_in_fp32(op):
    inputs = {n: t.to(torch.bfloat16) for n, t in make_inputs(1, 20).items() if n != "initial_state"}
    o, ht = op(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == F32


def _good_args() -> dict:
    inputs = make_inputs(2, 20)
    return {n: t.float() for n, t in inputs.items()}


BAD_ARGS = {
    "q rank": (lambda a: a.update(q=a["q"][0]), "q must be"),
    "k shape": (lambda a: a.update(k=a["k"][:, :-1]), "k must have shape"),
    "g shape": (lambda a: a.update(g=a["g"][..., :-1]), "g must have shape"),
    "beta shape": (lambda a: a.update(beta=a["beta"][..., None]), "beta must have shape"),
    "v heads": (lambda a: a.update(v=a["v"][:, :, :1]), "v must be"),
    "int q": (lambda a: a.update(q=a["q"].long()), "floating"),
    "state shape": (lambda a: a.update(initial_state=a["initial_state"][:1]), "initial_state must be"),
    "state dtype": (lambda a: a.update(initial_state=a["initial_state"].double()), "initial_state must be"),
    "cu_seqlens with B>1": (lambda a: a.update(cu_seqlens=torch.tensor([0, 20])), "B == 1"),
    "dt_bias without A_log": (lambda a: a.update(dt_bias=torch.zeros(H * K)), "A_log"),
    "A_log too short": (lambda a: a.update(A_log=torch.zeros(H - 1)), "A_log"),
    "dt_bias shape": (lambda a: a.update(A_log=torch.zeros(H), dt_bias=torch.zeros(H)), "dt_bias"),
}


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda, naive_recurrent_kda])
@pytest.mark.parametrize("case", BAD_ARGS, ids=list(BAD_ARGS))
def test_bad_arguments_raise(op, case):
    args = _good_args()
    mutate, match = BAD_ARGS[case]
    mutate(args)
    with pytest.raises(ValueError, match=match):
        op(**args)


@pytest.mark.parametrize(
    "cu_seqlens, match",
    [
        (torch.tensor([0, 5, 19]), "end at T"),
        (torch.tensor([1, 20]), "start at 0"),
        (torch.tensor([0, 12, 8, 20]), "non-decreasing"),
        (torch.tensor([0.0, 20.0]), "int64"),
        (torch.tensor([[0, 20]]), "int64"),
    ],
)
def test_bad_cu_seqlens_raise(cu_seqlens, match):
    args = {n: t[:1] for n, t in _good_args().items()}
    args["initial_state"] = None
    with pytest.raises(ValueError, match=match):
        chunk_kda(**args, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("chunk_size", [0, 8, 24, 64.0])
def test_bad_chunk_size_raises(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(**_good_args(), chunk_size=chunk_size)


def test_triton_chunk_dispatch_rule(monkeypatch):
    """Which calls the Triton chunk path takes, given CUDA (faked here): the K3 gate with a bound in [−5, 0),
    chunk size 64, and K ≥ 32 when a gradient is needed (K = 16 under autograd was over the bf16 tolerance in
    the interpreter: ``dispatch.CHUNK_GRAD_MIN_KEY_DIM``); without a gradient every supported K."""
    from openk3.ops.kda.triton import dispatch

    monkeypatch.setattr(dispatch, "_on_gpu", lambda *tensors: True)

    def takes_triton(K, grad, lower_bound=-5.0, chunk_size=64, A_log=True):
        q, k, g = (torch.randn(1, 8, 2, K, requires_grad=grad) for _ in range(3))
        v, beta = torch.randn(1, 8, 2, 32), torch.rand(1, 8, 2)
        return dispatch.use_triton_chunk(
            q, k, v, g, beta, A_log=torch.zeros(2) if A_log else None, lower_bound=lower_bound,
            chunk_size=chunk_size,
        )  # fmt: skip

    assert takes_triton(16, grad=False) and not takes_triton(16, grad=True)
    assert takes_triton(32, grad=True) and takes_triton(128, grad=True)
    with torch.no_grad():
        assert takes_triton(16, grad=True)
    assert not takes_triton(64, grad=False, lower_bound=-6.0)
    assert not takes_triton(64, grad=False, chunk_size=32)
    assert not takes_triton(64, grad=False, A_log=False)
    assert not takes_triton(48, grad=False)
