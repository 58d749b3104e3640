"""``openk3 plan``'s activation rows: against what autograd keeps, and the official model's floor.

The plan reuses the single-device per-layer estimate (:func:`openk3.train.memory.estimate_memory`, bf16
autocast) for the tokens one GPU holds. Independent checks: the bytes autograd saves in a k3-tiny forward
and loss under CPU bf16 autocast (unique storages, parameters left out), with and without full per-layer
checkpointing; and for ``kimi-k3`` a floor from the published shape alone (full checkpointing keeps at
least every layer's fp32 input: ``4·7168·93`` bytes per token).
"""

from __future__ import annotations

import torch

import openk3
from openk3.dist.mesh import ParallelDims
from openk3.dist.plan import plan
from openk3.train.checkpointing import wrap_decoder_layers
from openk3.train.loss import lm_head_loss

TOKENS = 512


def _saved_bytes(checkpointing: str) -> int:
    config = openk3.get_preset("k3-tiny")
    ids = torch.randint(
        0, config.text_config.vocab_size, (1, TOKENS + 1), generator=torch.Generator().manual_seed(0)
    )
    model = openk3.build_model(config, seed=0)
    wrap_decoder_layers(model, checkpointing)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        lm = model.language_model
        lm_head_loss(lm.model(ids[:, :-1]), lm.lm_head.weight, ids[:, 1:])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_plan_activations_against_what_autograd_keeps():
    b = plan(openk3.get_preset("k3-tiny"), ParallelDims(world_size=1), TOKENS)
    none, full = _saved_bytes("none"), _saved_bytes("full")
    # the CPU's torch KDA ops keep more than the GPU's Triton op: within a factor 2 of the measurement
    assert 0.5 * none < b.activations_bytes < 2 * none, (b.activations_bytes, none)
    # full checkpointing: the forward keeps the layer inputs; the plan adds one layer recomputed in the backward
    assert full < b.activations_checkpointed_bytes < b.activations_bytes, (
        b.activations_checkpointed_bytes,
        full,
    )


def test_plan_activations_of_the_official_model():
    b = plan(openk3.get_preset("kimi-k3"), ParallelDims(world_size=512, dp_shard=512, ep=64), 4096)
    floor = 4 * 7168 * 93 * 4096  # every layer's fp32 input, 93 layers of width 7168
    assert floor < b.activations_checkpointed_bytes < b.activations_bytes
    # without checkpointing every layer keeps its projections, expert rows and AttnRes sources: > 20× the inputs
    assert b.activations_bytes > 20 * floor
