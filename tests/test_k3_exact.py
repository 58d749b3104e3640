"""K3 exactness: openk3's K3-family model in float64 equals an independent float64 reference.

transformers has no K3 features (lower-bounded KDA gate, full-rank KDA output gate, gated q-LoRA MLA,
Block AttnRes, Stable LatentMoE with ``routed_expert_norm``, SiTU-GLU), so the oracle is
``tests/k3_reference.py``: a loop-based forward written from the model sections of ``docs/references.md``
alone, reading the model's tensors by their official names (``openk3.checkpoint.io.official_state``).

Every weight is randomised at roughly unit activation scale (linear std ``gain/√fan_in``, AttnRes
pseudo-queries std 0.5 so no mix is uniform, router bias with a spread that changes the selection,
norm gains 1 ± 0.1, the unused tail of ``A_log`` non-zero), so a wrong formula shows as a large error;
the tolerance is ``max |Δlogit| ≤ 1e-9``. Three models: ``k3_shaped(4)`` (k = 1, AttnRes block 1),
``k3_shaped(8)`` (k = 2, block 2) and a hand-made 9-layer variant with a double global tail
(``full_attn_layers`` [4, 8, 9]), expert width ≠ latent width, k = 3, ``routed_scaling_factor`` 2.5,
and AttnRes blocks of 3 (three full blocks) or 4 (the last block holds one layer).

Legend: ``B`` batch, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import openk3  # noqa: E402
from k3_reference import reference_logits  # noqa: E402
from openk3.checkpoint.io import official_state  # noqa: E402
from openk3.config import KimiK3Config  # noqa: E402
from openk3.model.moe import SparseMoeBlock  # noqa: E402
from openk3.presets import k3_shaped  # noqa: E402

ATOL = 1e-9
GATE_GAIN = 2.0
"""Gain on GLU gate projections so the SiTU soft-cap β₁ = 4 is reached by some units."""


def variant_config(block_size: int) -> KimiK3Config:
    """9 layers, MLA at 1-based 4, 8, 9 (a double global tail), AttnRes blocks of ``block_size`` layers."""
    data = k3_shaped(8).to_dict()
    text = data["text_config"]
    full = [4, 8, 9]
    text.update(
        num_hidden_layers=9,
        vocab_size=512,
        attn_res_block_size=block_size,
        moe_intermediate_size=96,  # expert width F ≠ latent width L = 128: catches a transposed expert
        num_experts_per_token=3,
        routed_scaling_factor=2.5,
    )
    text["linear_attn_config"].update(
        full_attn_layers=full, kda_layers=[i for i in range(1, 10) if i not in full]
    )
    return KimiK3Config.from_dict(data)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Overwrite every tensor of ``model`` in place (through its official-name views); return that dict."""
    gen = torch.Generator().manual_seed(seed)
    tensors = official_state(model)

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    for name, t in tensors.items():
        if name.endswith("embed_tokens.weight"):
            value = randn(t.shape)
        elif name.endswith("_res_proj.weight"):
            value = 0.5 * randn(t.shape)
        elif name.endswith("norm.weight"):  # every RMSNorm gain (incl. *_layernorm, o_norm, *_res_norm)
            value = 1 + 0.1 * (2 * torch.rand(t.shape, generator=gen, dtype=torch.float64) - 1)
        elif name.endswith("e_score_correction_bias"):
            value = 0.15 * randn(t.shape)
        elif name.endswith("A_log"):  # the tail past H is unused and non-zero on purpose
            value = 2 * torch.rand(t.shape, generator=gen, dtype=torch.float64) - 1
        elif name.endswith("dt_bias"):
            value = 0.5 * randn(t.shape)
        elif name.endswith("conv1d.weight"):
            value = 0.5 * randn(t.shape)
        else:
            assert t.dim() == 2, f"unexpected tensor {name} {tuple(t.shape)}"
            gain = GATE_GAIN if name.endswith(("w1.weight", "gate_proj.weight")) else 1.0
            value = gain * randn(t.shape) / t.shape[1] ** 0.5
        t.copy_(value.to(t.dtype))
    return tensors


def build(config, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = openk3.build_model(config, dtype=torch.float64, seed=seed).eval()
    return model, randomise(model, seed + 100)


def ids_for(config, B: int, T: int, seed: int) -> torch.Tensor:
    V = config.text_config.vocab_size
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


CASES = {
    "k3_shaped4_T70": (lambda: k3_shaped(4, vocab_size=1024), 1, 70),  # T > 64: two KDA chunks, one partial
    "k3_shaped8_B2": (lambda: k3_shaped(8, vocab_size=1024), 2, 13),
    "variant9_block3": (lambda: variant_config(3), 2, 11),
    "variant9_block4": (lambda: variant_config(4), 1, 17),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, B, T = CASES[request.param]
    config = make()
    model, tensors = build(config)
    ids = ids_for(config, B, T, seed=1)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routing = [None] * len(blocks)
    hooks = [
        m.gate.register_forward_hook(lambda _mod, _args, out, i=i: routing.__setitem__(i, out))
        for i, m in enumerate(blocks)
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    ref = reference_logits(tensors, config.to_dict(), ids)
    return config, routing, logits, ref


def test_logits_equal_reference(case):
    config, routing, logits, ref = case
    assert logits.dtype == torch.float64 and logits.shape == ref.shape
    err = max_diff(logits, ref)
    assert err <= ATOL, f"max |openk3 - reference| = {err:.3e} > {ATOL:.0e}"


def test_logits_not_degenerate(case):
    *_, ref = case
    assert ref.std().item() > 0.1
    assert ref.argmax(-1).unique().numel() > 1, "every position predicts the same token"
    assert torch.isfinite(ref).all()


def test_bias_changes_routing(case):
    """The randomised router bias must change the top-k choice for some token (else the test is blind)."""
    config, routing, *_ = case
    k = config.text_config.num_experts_per_token
    changed = 0
    for r in routing:
        unbiased_top = torch.topk(r.scores_NE, k, dim=-1).indices.sort(-1).values
        changed += int((unbiased_top != r.indices_Nk.sort(-1).values).any(-1).sum())
    assert changed > 0


def test_cached_decode_equals_reference():
    """Prefill 6 tokens into a cache, then decode one token at a time: every logit equals the reference."""
    config = variant_config(3)
    model, tensors = build(config, seed=3)
    ids = ids_for(config, 2, 10, seed=4)
    ref = reference_logits(tensors, config.to_dict(), ids)
    cache = model.new_cache()
    with torch.no_grad():
        parts = [model(ids[:, :6], cache).logits]
        parts += [model(ids[:, t : t + 1], cache).logits for t in range(6, 10)]
    err = max_diff(torch.cat(parts, dim=1), ref)
    assert err <= ATOL, f"cached decode vs reference: {err:.3e}"


def test_mutations_that_must_matter_and_must_not():
    """Zeroing the output AttnRes query changes the logits (model and reference agree on the new value);
    the unused ``A_log`` tail and layer 0's attention-side AttnRes tensors change nothing
    (``docs/references.md#checkpoint-names``, ``#block-attention-residuals``)."""
    config = k3_shaped(4)
    model, tensors = build(config, seed=5)
    ids = ids_for(config, 1, 9, seed=6)
    cfg = config.to_dict()
    with torch.no_grad():
        before = model(ids).logits
        H = config.text_config.linear_attn_config.num_heads
        saved = {}
        for name, t in tensors.items():
            if name.endswith("layers.0.self_attention_res_proj.weight") or (
                name.endswith("layers.0.self_attention_res_norm.weight")
            ):
                saved[name] = t.clone()
                t.mul_(-3.0)
            elif name.endswith("A_log"):
                saved[name] = t.clone()
                t[H:] = 7.0
        unchanged = model(ids).logits
        assert max_diff(unchanged, before) == 0.0
        for name, value in saved.items():
            tensors[name].copy_(value)

        tensors["language_model.model.output_attn_res_proj.weight"].zero_()
        after = model(ids).logits
    assert max_diff(after, before) > 1e-3, "the output AttnRes query has no effect"
    assert max_diff(after, reference_logits(tensors, cfg, ids)) <= ATOL
