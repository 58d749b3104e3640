"""A whole ``k3-tiny`` (KDA and MLA layers, Block AttnRes, LatentMoE) under context parallelism at world 2
(4: ``slow``), gloo, against the unsharded model on the same packed row.

Oracle: the single-device model (same seed) on the whole row with the global ``cu_seqlens``. Each rank runs
its tokens (:func:`~openk3.dist.context_parallel.apply_context_parallel`); its logits must be the oracle's rows
at its global positions (max relative difference ≤ 1e-5 in fp32), the summed loss the oracle's, and every
the gradients summed over the ranks the oracle's: in fp32 all parameters' gradients together within 1e-5
(relative norm; a single parameter's, such as ``A_log``'s, is one fp32 sum over every token whose order the
split changes: measured up to 1.3e-5 alone), in fp64 every parameter's within 1e-12. The MLA layers' path is
checked alone too: a K3-shaped MLA layer's output and gradients (fp32 and fp64).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_utils import layer_under_cp_error, rel_max, rel_norm
from dist_utils import run_world
from openk3.dist.context_parallel import apply_context_parallel
from openk3.model.modeling import build_model
from openk3.presets import get_preset, k3_shaped

TOL, FP64_TOL = 1e-5, 1e-12


def _model_world(rank: int, world: int, layout: str) -> dict:
    """k3-tiny in fp32 and fp64 on one packed row, unsharded and under CP; the differences per dtype."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model = build_model(get_preset("k3-tiny"), device="cpu", dtype=dtype, seed=0)
        vocab = model.language_model.model.config.vocab_size
        T = 32 * world
        cu = [0, 7, T // world, T // 2 + 5, T]
        ids = torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(1))
        x, y = ids[:, :-1], ids[:, 1:]
        cp_model = copy.deepcopy(model)
        logits = model(x, cu_seqlens=torch.tensor(cu)).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
        plan = apply_context_parallel(cp_model, layout=layout).begin(cu)
        logits_l = cp_model(plan.shard(x)).logits
        loss_l = F.cross_entropy(logits_l.flatten(0, 1), plan.shard(y).flatten(), reduction="sum")
        loss_l.backward()
        total = loss_l.detach().clone()
        dist.all_reduce(total)
        grads, ref_grads, per_param = [], [], {}
        for (name, p), p_ref in zip(cp_model.named_parameters(), model.parameters(), strict=True):
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(grad)
            ref = torch.zeros_like(p) if p_ref.grad is None else p_ref.grad
            grads.append(grad.flatten())
            ref_grads.append(ref.flatten())
            if ref.norm() > 0:
                per_param[name] = rel_norm(grad, ref)
        worst = max(per_param, key=per_param.get)
        out[str(dtype)[6:]] = {
            "logits": rel_max(logits_l.detach(), plan.shard(logits.detach())),
            "loss": abs(float(total) - float(loss.detach())) / abs(float(loss.detach())),
            "all_grads": rel_norm(torch.cat(grads), torch.cat(ref_grads)),
            "worst_param": (worst, per_param[worst]),
        }
    return out


def _mla_world(rank: int, world: int) -> dict:
    """A K3-shaped MLA layer under CP (:func:`cp_utils.layer_under_cp_error`)."""
    model = build_model(k3_shaped(4, vocab_size=256), device="cpu", seed=0)
    base = next(m for m in model.modules() if type(m).__name__ == "MultiheadLatentAttention")
    T, D = 16 * world, model.language_model.model.config.hidden_size
    cases = (("zigzag", [0, 3, T // 2 + 1, T], torch.float32), ("contiguous", [0, T], torch.float64))
    return {
        layout: (layer_under_cp_error(base, layout, cu, dtype, D, seed=2), dtype)
        for layout, cu, dtype in cases
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mla_layer_under_cp_equals_unsharded(world):
    for rank_errors in run_world(_mla_world, world, timeout=300):
        for layout, (err, dtype) in rank_errors.items():
            assert err <= (FP64_TOL if dtype == torch.float64 else TOL), (world, layout, err)


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, "zigzag"),
        pytest.param(2, "contiguous", marks=pytest.mark.slow),
        pytest.param(4, "zigzag", marks=pytest.mark.slow),
    ],
)
def test_k3_tiny_under_cp_equals_unsharded(world, layout):
    for result in run_world(_model_world, world, layout, timeout=600):
        fp32, fp64 = result["float32"], result["float64"]
        assert max(fp32["logits"], fp32["loss"], fp32["all_grads"]) <= TOL, result
        assert max(fp64["logits"], fp64["loss"], fp64["worst_param"][1]) <= FP64_TOL, result


def _train_world(rank: int, world: int, corpus: str, out: str, cp: int) -> list[float]:
    import json
    from pathlib import Path

    from openk3.dist.train import train_distributed
    from openk3.train.trainer import TrainConfig

    config = TrainConfig(
        preset="k3-tiny", data=corpus, out=out, steps=3, batch_size=1, context_schedule=[(0, 32), (2, 64)],
        warmup_steps=1, save_every=100, sample_prompt=None,
    )  # fmt: skip
    train_distributed(config, dp_shard=world // cp, cp=cp, cp_layout="zigzag")
    if rank:
        return []
    return [json.loads(line)["loss"] for line in Path(out, "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_with_cp_follows_the_single_process_losses(tmp_path):
    """``train_distributed`` with ``cp = 2`` (zig-zag; the schedule grows to 64 tokens, 32 a rank) against the
    world-1 run of the same config: step 1's loss within 1e-6, the next two within 1e-4 (fp32 rounding carried
    by the optimizer)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"work{i}.txt").write_text(
            f"ROMEO {i}. But soft, what light through yonder window breaks?\n" * 60
        )
    one = run_world(_train_world, 1, str(corpus), str(tmp_path / "one"), 1, timeout=600)[0]
    split = run_world(_train_world, 2, str(corpus), str(tmp_path / "cp2"), 2, timeout=600)[0]
    assert len(one) == len(split) == 3
    assert abs(split[0] - one[0]) <= 1e-6 * one[0], (one, split)
    assert max(abs(a - b) / a for a, b in zip(one, split, strict=True)) <= 1e-4, (one, split)
