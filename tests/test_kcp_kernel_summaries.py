"""Segment summaries from the Triton chunked op (augmented value ``[0 | v]`` from ``[I | 0]``).

Three checks of :func:`~openk3.ops.kda.summary.kernel_summaries`:

* **the identity, fp64, CPU**: the final state of the token-by-token recurrence
  (:func:`naive_recurrent_kda`, the independent oracle) run on the augmented value from ``[I | 0]`` equals the
  torch summaries, per document of a packed row (an empty one included), with the K3 gate, β logits and the
  L2 norm in the op: the augmentation is exact in openk3's convention (``S_t = A_t S_{t−1} + β_t k_t v_tᵀ``);
* **the kernels in Triton's CPU interpreter** (``TRITON_INTERPRET=1``, set by ``conftest.py``), fp32 inputs,
  against the torch summaries in fp32: the summaries and the gradients of every input (the kernels' own
  backward), once with ``K + V`` a kernel width (one call) and once not (two calls);
* **on a GPU**, bf16 inputs at K = V = 128 (K3's heads, two calls) and K = V = 64 (one call), 8K tokens over
  uneven documents: the dispatch of :func:`segment_summaries` to the kernels, against the torch summaries of
  the same (bf16-rounded) inputs in fp64.

Legend: ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` segments, ``X = K + V``.
"""

from __future__ import annotations

import pytest
import torch

from kda_compare import rel_rmse
from openk3.ops.kda import naive_recurrent_kda
from openk3.ops.kda.summary import kernel_summaries, segment_summaries

# the kernel tests' markers; importing that module also patches the interpreter's bf16/tf32 dots and its
# fp32→bf16 cast to behave as on the GPU (unpatched, its bf16 dot multiplies raw bit patterns)
from test_kda_triton import TOL_BF16, assert_grads_close, gpu, interpreter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
GATE = dict(lower_bound=-1.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _inputs(T: int, H: int, K: int, V: int, dtype=F64, seed: int = 0, device="cpu") -> dict:
    """q, k, v, raw gate, β logits ``[1, T, …]`` in ``dtype``; per-head ``A_log`` that differ, ``dt_bias``
    (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H))
    x = {n: t.to(device, dtype) for n, t in x.items()}
    gate = dict(A_log=torch.linspace(-1.0, 0.7, H), dt_bias=r(H * K).float() * 0.3)
    return x | {n: t.to(device) for n, t in gate.items()}


def test_summary_is_the_final_state_of_the_augmented_value():
    H, K, V = 3, 16, 8
    x = _inputs(53, H, K, V)
    cu = torch.tensor([0, 20, 20, 53])  # an empty segment: [I | 0]
    want_NHKX = segment_summaries(**x, cu_seqlens=cu, chunk_size=16, **GATE)
    v_aug = torch.cat([x["v"].new_zeros(1, 53, H, K), x["v"]], dim=-1)
    entry_NHKX = torch.cat([torch.eye(K, dtype=F64), torch.zeros(K, V, dtype=F64)], dim=-1).expand(
        3, H, K, K + V
    )
    _, got_NHKX = naive_recurrent_kda(
        **(x | {"v": v_aug}),
        initial_state=entry_NHKX.contiguous(),
        output_final_state=True,
        cu_seqlens=cu,
        **GATE,
    )
    torch.testing.assert_close(got_NHKX, want_NHKX, rtol=0, atol=1e-12)
    assert (want_NHKX[0, ..., :K] - torch.eye(K, dtype=F64)).abs().max() > 0.1  # M is no identity


def _kernel_against_torch(K: int, V: int, cu: list[int]) -> dict:
    """Relative RMSE of the kernels' summaries and of every input gradient (a fixed random cotangent of the
    summaries) against the torch path, fp32 inputs."""
    T, H = cu[-1], 2
    x = _inputs(T, H, K, V, dtype=torch.float32, seed=K + V)
    cu_t = torch.tensor(cu)
    dX = torch.randn(len(cu) - 1, H, K, K + V, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, fn in (("torch", segment_summaries), ("kernel", kernel_summaries)):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        summ = fn(**leaves, cu_seqlens=cu_t, **GATE)
        (summ * dX).sum().backward()
        out[name] = {"summary": summ.detach()} | {f"d{n}": leaves[n].grad for n in x if n != "q"}
        assert leaves["q"].grad is None or leaves["q"].grad.abs().max() == 0  # q does not enter the map
    assert out["kernel"]["summary"].dtype == torch.float32
    return {n: rel_rmse(out["torch"][n], out["kernel"][n]) for n in out["torch"]}


@interpreter
@pytest.mark.parametrize(("K", "V", "cu"), [(32, 32, [0, 70, 70, 100]), (32, 128, [0, 37, 90])])
def test_interpreter_kernel_summaries_equal_torch(K, V, cu):
    """One call (K + V = 64) and two (K + V = 160, no kernel width); 70 tokens cross a 64-token chunk."""
    errors = _kernel_against_torch(K, V, cu)
    print(errors)
    assert max(errors.values()) <= 2e-5, errors


def _bf16_against_fp64(D: int, device: str) -> None:
    """``segment_summaries`` of bf16 inputs on ``device`` against the torch summaries of the same rounded
    inputs in fp64: ``M`` and ``E`` apart and every input gradient (a random cotangent), at the kernels' bf16
    tolerances (:data:`test_kda_triton.TOL_BF16`: a final state's 0.005 for ``M`` and ``E``; the gate
    parameters' errors against the size of the terms they sum). Slow gates (``dt_bias = −8``: from no decay
    to fast) and segments from 1 to 5,191 tokens, so that ``M`` is far from zero."""
    cu = [0, 40, 777, 3000, 3001, 8192]
    H = 4
    x = _inputs(cu[-1], H, D, D, dtype=torch.bfloat16, device=device, seed=D)
    x["dt_bias"] = torch.full_like(x["dt_bias"], -8.0)
    kw = dict(cu_seqlens=torch.tensor(cu, device=device), **GATE | {"lower_bound": -5.0})
    dX = torch.randn(len(cu) - 1, H, D, 2 * D, generator=torch.Generator().manual_seed(2), dtype=F64)
    runs = {}
    for name, cast in (("kernel", None), ("torch", F64)):
        leaves = {
            n: (t if cast is None else t.to(cast)).detach().clone().requires_grad_() for n, t in x.items()
        }
        summ = segment_summaries(**leaves, **kw)
        (summ.double() * dX.to(device)).sum().backward()
        runs[name] = {"M": summ[..., :D].detach(), "E": summ[..., D:].detach()}
        runs[name] |= {f"d{n}": leaves[n].grad for n in x if n != "q"}
    assert runs["kernel"]["M"].dtype == torch.float32
    assert runs["torch"]["M"].abs().max() > 0.5  # M carries the entry state
    tol = dict(M=TOL_BF16["ht"], E=TOL_BF16["ht"]) | {
        n: TOL_BF16[n] for n in runs["torch"] if n.startswith("d")
    }
    assert_grads_close(runs["torch"], runs["kernel"], tol, x)


@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_kernel_summaries_bf16(D):
    """:func:`_bf16_against_fp64` on CUDA (the Triton kernels), 8K tokens: D = 64 takes one call
    (K + V = 128), D = 128 two."""
    _bf16_against_fp64(D, "cuda")
