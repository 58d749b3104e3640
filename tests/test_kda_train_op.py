"""The Triton KDA training op as torch custom ops (``openk3.ops.kda.triton.train_op``) against the
autograd Function it wraps: on the GPU, or in Triton's CPU interpreter on a machine without one.

The custom ops must give the very bits of :func:`chunk_kda_triton` (the same kernels), trace under
``torch.compile(fullgraph=True)`` without a graph break, and their fake implementations must give the real
outputs' shapes and dtypes (``torch.library.opcheck``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = (
    HAS_TRITON
    and not torch.cuda.is_available()
    and tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2]) >= (3, 9)
)
if INTERPRET and "openk3.ops.kda.triton.chunk_prepare" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. imported below

if INTERPRET:
    import test_kda_triton  # noqa: F401  (patches the interpreter's dots and casts to behave as on the GPU)
from openk3.ops.kda.triton.train_op import chunk_kda_train  # noqa: E402

GPU = torch.cuda.is_available() and HAS_TRITON
DEVICE = "cuda" if GPU else "cpu"
pytestmark = pytest.mark.skipif(
    not (GPU or (INTERPRET and os.environ.get("TRITON_INTERPRET") == "1")),
    reason="needs a CUDA GPU with triton, or triton >= 3.9 in interpreter mode on a CPU-only machine",
)


def _inputs(dtype=torch.float32, B=1, T=40, H=2, K=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, gate = (torch.randn(B, T, H, K, generator=g).to(dtype) for _ in range(4))
    beta = torch.randn(B, T, H, generator=g)
    A_log = 0.3 * torch.randn(H, generator=g)
    dt_bias = 0.5 * torch.randn(H * K, generator=g)
    return [t.to(DEVICE).requires_grad_() for t in (q, k, v, gate, beta, A_log, dt_bias)]


def _reference(q, k, v, gate, beta, A_log, dt_bias):
    from openk3.ops.kda.triton.chunk_function import chunk_kda_triton

    o, _ = chunk_kda_triton(
        q, k, v, gate, beta, scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=False,
        seq_lens=None, cu_seqlens=None, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    return o


def _op(q, k, v, gate, beta, A_log, dt_bias):
    return chunk_kda_train(q, k, v, gate, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)


def _run(fn, inputs, do):
    o = fn(*inputs)
    grads = torch.autograd.grad(o, inputs, do)
    return [o.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_op_equals_the_autograd_function(dtype):
    inputs = _inputs(dtype)
    do = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want = _run(_reference, inputs, do)
    got = _run(_op, inputs, do)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3g}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_custom_op_compiles_without_graph_break(backend):
    if backend == "inductor" and not GPU:
        pytest.skip("inductor on the interpreter's CPU tensors compiles C++ for minutes; run on the GPU")
    inputs = _inputs(B=2, T=24)
    do = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    compiled = torch.compile(_op, backend=backend, fullgraph=True)
    want = _run(_reference, inputs, do)
    got = _run(compiled, inputs, do)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_fake_implementations_match_the_kernels():
    inputs = _inputs(torch.bfloat16, T=20)
    q, k, v, gate, beta, A_log, dt_bias = inputs
    args = (q, k, v, gate, beta, A_log, dt_bias, q.shape[-1] ** -0.5, -5.0)
    torch.library.opcheck(
        torch.ops.openk3.kda_chunk_fwd.default, args, test_utils=("test_schema", "test_faketensor")
    )
