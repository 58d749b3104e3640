"""Memory and speed pieces of training: the chunked LM-head loss against ``F.cross_entropy`` (fp64), per-layer
activation checkpointing against none (same loss and gradients, bit for bit on CPU), the memory planner's
choices and refusals, and accumulation (1 × 16 against 4 × 4 sequences give the same update)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import openk3
import test_train
from openk3.train.checkpointing import wrap_decoder_layers
from openk3.train.loss import lm_head_loss
from openk3.train.memory import GIB, MODES, estimate_memory, optimizer_params, plan_memory
from openk3.train.trainer import Trainer
from test_train import small

corpus = test_train.corpus  # the module fixture of test_train


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_equals_cross_entropy_fp64(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 21, 16, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (3, 21), generator=g)
    want = F.cross_entropy((h @ W.t()).flatten(0, 1), y.flatten())
    dh_want, dW_want = torch.autograd.grad(2.5 * want, (h, W))
    got = lm_head_loss(h, W, y, chunk_tokens=chunk)
    dh, dW = torch.autograd.grad(2.5 * got, (h, W))
    assert got.dtype == torch.float64  # fp32 at least, fp64 for fp64
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(dh, dh_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dW, dW_want, rtol=1e-12, atol=1e-12)


def test_chunked_loss_under_bf16_autocast_matches_the_plain_head():
    """Under bf16 autocast the logits are rounded to bf16 as ``lm_head(h).float()`` does: same loss to fp32
    summation order; gradients to bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 40, 32, generator=g, requires_grad=True)
    W = torch.randn(300, 32, generator=g, requires_grad=True)
    y = torch.randint(0, 300, (2, 40), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, W).float().flatten(0, 1), y.flatten())
        got = lm_head_loss(h, W, y, chunk_tokens=16)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    dh_want, dW_want = torch.autograd.grad(want, (h, W))
    dh, dW = torch.autograd.grad(got, (h, W))
    torch.testing.assert_close(dh, dh_want, rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(dW, dW_want, rtol=2e-2, atol=2e-4)


def test_chunked_loss_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"do not fit"):
        lm_head_loss(torch.zeros(2, 3, 4), torch.zeros(5, 8), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"chunk_tokens=0"):
        lm_head_loss(
            torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), chunk_tokens=0
        )


def _loss_and_grads(config, mode: str, x):
    model = openk3.build_model(config, seed=0)
    wrap_decoder_layers(model, mode)
    lm = model.language_model
    loss = lm_head_loss(lm.model(x[:, :-1]), lm.lm_head.weight, x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients(mode):
    config = openk3.get_preset("k3-tiny")
    x = torch.randint(0, config.text_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    loss0, grads0 = _loss_and_grads(config, "none", x)
    loss, grads = _loss_and_grads(config, mode, x)
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys() and len(grads) > 50
    for name in grads0:
        assert torch.equal(grads[name], grads0[name]), name


def test_checkpointing_refuses_an_unknown_mode():
    model = openk3.build_model(openk3.get_preset("k3-tiny"), device="meta")
    with pytest.raises(ValueError, match=r"activation_checkpointing='some'"):
        wrap_decoder_layers(model, "some")


def test_estimate_orders_the_modes_and_grows_with_the_batch():
    config = openk3.get_preset("k3-1b")
    est = {m: estimate_memory(config, 4, 2048, m, "cuda") for m in MODES}
    assert est["none"].activations > est["selective"].activations > est["full"].activations
    assert estimate_memory(config, 8, 2048, "none", "cuda").activations > est["none"].activations
    # fp32 weights + grads + bf16 casts (10 bytes per parameter, accounting's count) + the optimizer's state
    from openk3.accounting import accounting_report

    params = accounting_report(config)["total_params"]
    muon, adamw = optimizer_params(config)
    assert muon + adamw == pytest.approx(params, rel=1e-3) and muon > 10 * adamw
    assert est["none"].state == pytest.approx(10 * params + 4 * muon + 8 * adamw, rel=1e-3)


def test_optimizer_state_is_what_the_optimizer_keeps():
    """``4 · Muon + 8 · AdamW`` parameters against the bytes of the state tensors that ``build_optimizer``'s
    optimizer holds after one step (k3-tiny, fp32; scalar step counters left out)."""
    from openk3.train.optim import build_optimizer

    config = openk3.get_preset("k3-tiny")
    model = openk3.build_model(config, seed=0)
    optimizer = build_optimizer(model, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    kept = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    muon, adamw = optimizer_params(config)
    assert kept == 4 * muon + 8 * adamw


@pytest.mark.parametrize("result", ["train_throughput_h200.json"])
def test_compiled_estimate_is_just_above_the_measured_h200_peak(result):
    """The planner's estimate for compiled layers against ``torch.cuda.max_memory_allocated`` of the
    committed H200 run of ``k3-1b`` (micro-batches of 8 × 2048 tokens): at or above the measured peak,
    by at most 25%; the eager count (``compiled=False``) is far above it."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / result).read_text())
    row = data["rows"]["k3"]
    config = openk3.get_preset("k3-1b")
    mb, seq = row["micro_batch"], int(data["batch"].split(" x ")[1])
    estimate = estimate_memory(config, mb, seq, row["checkpointing"], "cuda", compiled=True).total
    assert row["peak_bytes"] <= estimate <= 1.25 * row["peak_bytes"], (estimate, row["peak_bytes"])
    assert estimate_memory(config, mb, seq, row["checkpointing"], "cuda").total > 1.5 * row["peak_bytes"]


def test_planner_picks_the_largest_micro_batch_that_fits():
    config = openk3.get_preset("k3-1b")
    plan = plan_memory(config, 16, 2048, 60 * 10**9, "cuda")
    assert plan.micro_batch * plan.grad_accum == 16
    assert plan.estimate.total <= 60 * 10**9
    bigger = 16 // (plan.grad_accum // 2) if plan.grad_accum > 1 else None
    if bigger is not None:  # the next divisor up does not fit in that mode
        assert estimate_memory(config, bigger, 2048, plan.checkpointing, "cuda").total > 60 * 10**9
    roomy = plan_memory(config, 16, 2048, 10**15, "cuda")
    assert (roomy.micro_batch, roomy.grad_accum, roomy.checkpointing) == (16, 1, "none")


def test_planner_refuses_a_micro_batch_that_cannot_fit_and_suggests_one():
    config = openk3.get_preset("k3-1b")
    budget = 40 * GIB
    with pytest.raises(ValueError) as err:
        plan_memory(config, 16, 2048, budget, "cuda", micro_batch=16, checkpointing="none", name="k3-1b")
    message = str(err.value)
    assert "training k3-1b with micro-batches of 16 × 2048 tokens" in message
    assert "40.0 GiB available on cuda" in message
    # the largest micro-batch that fits without checkpointing, and a larger one with checkpointing
    same = re.search(r"use --micro-batch-size (\d+) \((\w+) checkpointing", message)
    assert same.group(2) == "none"
    mb = int(same.group(1))
    assert estimate_memory(config, mb, 2048, "none", "cuda").total <= budget
    assert estimate_memory(config, 2 * mb, 2048, "none", "cuda").total > budget
    other = re.search(r"or --micro-batch-size (\d+) --activation-checkpointing (\w+)", message)
    assert int(other.group(1)) > mb
    assert estimate_memory(config, int(other.group(1)), 2048, other.group(2), "cuda").total <= budget
    with pytest.raises(ValueError, match=r"micro-batch 3 does not divide the batch of 16"):
        plan_memory(config, 16, 2048, budget, "cuda", micro_batch=3)
    with pytest.raises(ValueError, match=r"needs at least [\d,.]+ GiB .*more than the 1.0 GiB"):
        plan_memory(config, 16, 2048, GIB, "cuda", name="k3-1b")


def test_accumulation_gives_the_same_update(corpus, tmp_path):
    """One optimizer step on 16 sequences as 1 micro-batch of 16 and as 4 of 4: the same loss, the same
    accumulated gradients (fp32, to summation order) and the same update. Adam's first step is ``lr·g/(|g| +
    eps)``, which turns a rounding difference of a gradient near 0 into up to ``lr`` of update, so the updates
    are held to 1% of ``lr`` while the gradients are held to fp32 rounding."""
    runs = []
    for micro, name in ((16, "one"), (4, "four")):
        cfg = small(corpus, tmp_path / name, batch_size=16, micro_batch_size=micro, steps=1, warmup_steps=0)
        trainer = Trainer(cfg, progress=False)
        params = dict(trainer.model.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        grads = {}
        step = trainer.optimizer.step

        def record(*args, _step=step, _grads=grads, _params=params, **kwargs):
            _grads.update({n: p.grad.clone() for n, p in _params.items() if p.grad is not None})
            return _step(*args, **kwargs)

        trainer.optimizer.step = record
        row = trainer.train_step()
        runs.append((row["loss"], grads, {n: p.detach() - before[n] for n, p in params.items()}))
    (loss1, g1, u1), (loss4, g4, u4) = runs
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    assert g1.keys() == g4.keys() and len(g1) > 50
    for name, g in g1.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(g4[name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)
    lr = small(corpus, tmp_path / "x").lr
    for name, u in u1.items():
        torch.testing.assert_close(u4[name], u, rtol=0, atol=0.01 * lr, msg=name)
    assert sum(u.abs().max().item() > 0.5 * lr for u in u1.values()) > 50  # the step moved the weights


def test_train_config_refuses_bad_memory_settings():
    from openk3.train.trainer import TrainConfig

    with pytest.raises(ValueError, match=r"micro_batch_size=3 does not divide the batch of"):
        TrainConfig(batch_size=16, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"activation_checkpointing='half'"):
        TrainConfig(activation_checkpointing="half")
    with pytest.raises(ValueError, match=r"TrainConfig.compile='yes'"):
        TrainConfig(compile="yes")


def test_activation_estimate_is_within_a_factor_of_what_autograd_keeps():
    """The estimate against the bytes autograd saves (unique storages, parameters left out) for k3-tiny,
    2 × 256 tokens, fp32 on CPU (the torch KDA ops, which keep more than the GPU's Triton op): within 2×."""
    config = openk3.get_preset("k3-tiny")
    x = torch.randint(0, config.text_config.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0))
    model = openk3.build_model(config, seed=0)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm = model.language_model
        lm_head_loss(lm.model(x[:, :-1]), lm.lm_head.weight, x[:, 1:])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in storages.items() if ptr not in params)
    estimate = estimate_memory(config, 2, 256, "none", "cpu").activations
    assert 0.5 * measured < estimate < 2 * measured, (estimate, measured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: compiled layers with the Triton KDA op")
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_compiled_checkpointed_layers_match_eager_on_the_gpu(mode):
    """What ``openk3 train --device cuda`` runs (compiled layers, the KDA custom op, bf16 autocast, each
    checkpointing mode) against the eager layers without checkpointing: the same loss and gradients up to
    bf16 rounding (compiled kernels fuse differently)."""
    from openk3.presets import k3_shaped
    from openk3.train.step import micro_batch_loss

    config = k3_shaped(4)  # KDA (dense and MoE) and MLA layers, AttnRes; few graphs to compile
    x = torch.randint(0, config.text_config.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0))
    x = x.cuda()
    torch._dynamo.reset()
    results = []
    for wrap_mode, compile in (("none", False), (mode, True)):
        model = openk3.build_model(config, device="cuda", seed=0)
        wrap_decoder_layers(model, wrap_mode, compile)
        loss = micro_batch_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    (loss0, g0), (loss1, g1) = results
    assert loss1 == pytest.approx(loss0, rel=2e-3)
    assert g0.keys() == g1.keys()
    flat0 = torch.cat([g.flatten() for g in g0.values()])
    flat1 = torch.cat([g1[n].flatten() for n in g0])
    assert ((flat1 - flat0).norm() / flat0.norm()).item() < 0.03  # all gradients together
    for name, g in g0.items():  # each tensor, looser: bf16 rounding of small gradients
        err = ((g1[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert err < 0.15, f"{name}: relative error {err:.3g}"


def test_wrapped_layers_build_the_kda_indexes_before_their_region():
    """A wrapped layer's training call caches the KDA op's chunk and tile indexes of its rows outside the
    compiled region: built inside, under Inductor's CUDA graphs, they would live in the graphs' memory pool,
    untracked, and Inductor would refuse to record. (On the CPU no op builds them: only the wrapper does.)"""
    from openk3.ops.kda.triton.chunk_index import _cached_fixed_length_index, fixed_length_index

    config = openk3.get_preset("k3-tiny")
    model = openk3.build_model(config, seed=0)
    wrap_decoder_layers(model, "full")
    x = torch.randint(0, config.text_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    _cached_fixed_length_index.cache_clear()
    lm = model.language_model
    with torch.no_grad():  # evaluation takes the plain layers: nothing cached
        lm.model(x[:, :-1])
    assert _cached_fixed_length_index.cache_info().currsize == 0
    lm_head_loss(lm.model(x[:, :-1]), lm.lm_head.weight, x[:, 1:]).backward()
    info = _cached_fixed_length_index.cache_info()
    assert info.currsize == 2 and info.misses == 2, info  # one chunk and one tile index, then lookups
    assert fixed_length_index(2, 32, torch.device("cpu")).num_chunks == 2  # two rows of one chunk
    assert _cached_fixed_length_index.cache_info().hits == info.hits + 1
