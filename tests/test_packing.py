"""Packed input projections (``openk3.model.packing``): one GEMM per layer input in forwards without gradient,
the same numbers as the separate linears, the parameters still the checkpoint's, and a broken tie never read."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.generate import greedy
from openk3.model.packing import pack_for_inference, pack_linears
from openk3.presets import k3_shaped
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 32


class CountMatmuls(TorchDispatchMode):
    """Counts the GEMMs (``mm``/``addmm``/``bmm``) dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def model64():
    return openk3.build_model(k3_shaped(4, vocab_size=VOCAB), dtype=torch.float64, seed=0).eval()


def packs(model):
    return [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]


def test_pack_linears_keeps_outputs_names_and_memory():
    lins = [torch.nn.Linear(8, n, bias=False).double() for n in (3, 5, 2)]
    x = torch.randn(4, 8, dtype=torch.float64)
    want = [lin(x) for lin in lins]
    before = [lin.weight.detach().clone() for lin in lins]
    params = [lin.weight for lin in lins]
    packed = pack_linears(lins)
    assert all(lin.weight is p for lin, p in zip(lins, params))  # an optimizer's references stay the model's
    assert packed.weight.shape == (10, 8) and packed.sizes == (3, 5, 2)
    for lin, w in zip(lins, before):
        assert isinstance(lin.weight, torch.nn.Parameter) and torch.equal(lin.weight, w)
        assert lin.weight.untyped_storage().data_ptr() == packed.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        got = packed(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)
    with torch.no_grad():  # an in-place load (a weight sync) reaches the pack
        lins[1].weight.copy_(torch.ones(5, 8, dtype=torch.float64))
        assert packed.tied()
        torch.testing.assert_close(packed(x)[1], x.sum(-1, keepdim=True).expand(4, 5), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "bad",
    [
        [torch.nn.Linear(8, 3, bias=True), torch.nn.Linear(8, 2, bias=False)],
        [torch.nn.Linear(8, 3, bias=False), torch.nn.Linear(6, 2, bias=False)],
        [torch.nn.Linear(8, 3, bias=False), torch.nn.Linear(8, 2, bias=False).double()],
    ],
    ids=["bias", "widths", "dtypes"],
)
def test_pack_linears_refuses_what_cannot_share_one_matrix(bad):
    with pytest.raises(ValueError, match="pack_linears"):
        pack_linears(bad)


def test_packed_model_forward_equals_the_separate_linears_and_runs_fewer_gemms():
    ref = model64()
    packed = pack_for_inference(copy.deepcopy(ref))
    kinds = {type(p.linears[0].weight) for p in packs(packed)}
    assert packs(packed) and kinds == {torch.nn.Parameter}
    assert packed.state_dict().keys() == ref.state_dict().keys()
    for (name, a), b in zip(ref.state_dict().items(), packed.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), CountMatmuls() as n_ref:
        want = ref(ids).logits
    with torch.no_grad(), CountMatmuls() as n_packed:
        got = packed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the plain forward packs KDA's six input projections, MLA's (q_a, kv_a, g), the MoE blocks' (latent down,
    # shared gate, up) and the dense MLP's (gate, up)
    lm = packed.language_model.model
    saved = sum(
        len(layer_pack.linears) - 1
        for layer in lm.layers
        for layer_pack in (
            layer.self_attn.packed,
            getattr(layer, "block_sparse_moe", layer).packed if hasattr(layer, "block_sparse_moe") else None,
            layer.mlp.packed if hasattr(layer, "mlp") else None,
        )
        if layer_pack is not None
    )
    assert saved > 0 and n_packed.count == n_ref.count - saved


def test_training_reads_the_parameters_not_the_pack():
    ref, packed = model64().train(), pack_for_inference(model64()).train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    ref(ids).logits.square().mean().backward()
    packed(ids).logits.square().mean().backward()
    for (name, a), b in zip(ref.named_parameters(), packed.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_broken_tie_is_never_read_and_packing_again_restores_it():
    model = pack_for_inference(model64())
    moved = copy.deepcopy(model).float()  # deep copy and cast: new memory for every weight, stale packs
    assert packs(moved) and not any(p.tied() for p in packs(moved))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        got = moved(ids).logits  # the stale fp64 packs would fail on fp32 inputs, or read old weights
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    pack_for_inference(moved)
    assert all(p.tied() and p.weight.dtype == torch.float32 for p in packs(moved))


def test_the_engine_packs_and_its_decode_step_runs_one_gemm_per_layer_input():
    """A decode step of the engine's paged path: KDA's six input projections, MLA's three and each MoE block's
    three run as one GEMM each; the greedy tokens are the unpacked model's."""
    model = model64()
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = EngineConfig(CacheConfig(block_size=4, num_blocks=400), SchedulerConfig(), static_decode=False)
    with torch.no_grad():
        want = greedy(copy.deepcopy(model), torch.tensor([prompt]), 6)[0].tolist()

    def run(engine, unpack: bool) -> tuple[list[int], int]:
        if unpack:
            for m in engine.model.modules():
                if hasattr(m, "packed"):
                    m.packed = None
        req = Request("r", prompt, SamplingParams(max_tokens=6))
        engine.add_request(req)
        engine.step()  # the prefill
        with CountMatmuls() as n:
            engine.step()  # one decode step
        while engine.has_unfinished_requests():
            engine.step()
        return req.output_token_ids, n.count

    tokens, n_packed = run(LLMEngine(model, cfg), unpack=False)
    assert packs(model) and all(p.tied() for p in packs(model))
    tokens_ref, n_ref = run(LLMEngine(copy.deepcopy(model), cfg), unpack=True)
    assert tokens == tokens_ref == want
    lm = model.language_model.model
    saved = sum(len(m.packed.linears) - 1 for layer in lm.layers for m in layer.modules()
                if getattr(m, "packed", None) is not None and not (hasattr(layer, "block_sparse_moe")
                and m is getattr(layer.block_sparse_moe, "shared_experts", None)))  # fmt: skip
    assert n_packed == n_ref - saved


@pytest.mark.parametrize("rows", [1, 2])
def test_project_runs_one_row_as_a_fused_reduction_and_agrees_with_the_gemm(rows):
    """Under ``torch.compile`` without gradient a one-row projection is a product-and-sum reduction (no
    library GEMM in the generated code) rounding once from fp32, so it lies within one bf16 rounding of the
    fp64 product, as ``F.linear`` does; two rows stay a GEMM."""
    from torch._inductor.utils import run_and_get_code

    from openk3.model.packing import few_rows, project

    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    assert not few_rows(x)  # eager: never
    with torch.no_grad():
        got, (code,) = run_and_get_code(torch.compile(project, fullgraph=True, dynamic=False), x, w)
    assert ("extern_kernels.mm" in code) == (rows > 1)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    ulp = exact.abs().clamp(min=1e-3) * 2.0**-7  # one bf16 rounding, relative
    assert ((got.double() - exact).abs() <= ulp).all()
    assert ((torch.nn.functional.linear(x, w).double() - exact).abs() <= ulp).all()
