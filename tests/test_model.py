"""Whole-model equivalences and bad input: cached decoding == full forward, packed == per-document."""

from __future__ import annotations

import math

import pytest
import torch

import openk3
from openk3.config import KimiLinearConfig
from openk3.presets import get_preset, k3_shaped


def kimi_linear_tiny() -> KimiLinearConfig:
    """A Kimi-Linear-shaped tiny config: softplus gate, low-rank output gate, plain residuals, SwiGLU."""
    data = get_preset("kimi-linear-48b").to_dict()
    data.update(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=96,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        bos_token_id=None,
        eos_token_id=None,
    )
    data["linear_attn_config"] = {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    }
    return KimiLinearConfig.from_dict(data)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Unit-scale random weights (std 1/√fan_in), non-zero AttnRes queries and a routing-changing bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.endswith("e_score_correction_bias"):
            p.copy_(0.3 * r)
        elif name.endswith("_res_proj.weight"):
            p.copy_(0.5 * r)
        elif p.dim() == 1 or name.endswith("A_log"):
            p.copy_(1 + 0.1 * r if "norm" in name else 0.5 * r)
        else:
            p.copy_(r / math.sqrt(p.shape[-1]))
    return model


MODELS = {
    "k3-depth4": lambda: k3_shaped(4, vocab_size=512),  # AttnRes block = 1 layer: a block per layer
    "kimi-linear-tiny": kimi_linear_tiny,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    m = openk3.build_model(MODELS[request.param](), dtype=torch.float64, seed=0)
    return randomize_(m).eval()


def _ids(B, T, seed=0, vocab=512):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_incremental_decoding_equals_full_forward(model):
    ids = _ids(2, 90)
    full = model(ids).logits
    assert full.std() > 0.1
    cache = model.new_cache()
    parts = [model(ids[:, :70], cache).logits]  # prefill (chunked KDA: 64 + 6)
    parts.append(model(ids[:, 70:73], cache).logits)  # a short multi-token step
    for t in range(73, 90):
        parts.append(model(ids[:, t : t + 1], cache).logits)  # single-token decode
    assert cache.seq_len == 90
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-9)


@torch.no_grad()
def test_greedy_tokens_equal_uncached_argmax(model):
    ids = _ids(2, 11, seed=1)
    new = openk3.generate.greedy(model, ids, 12)
    seq = ids
    for _ in range(12):  # no cache: rerun the whole sequence each step
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(new, seq[:, 11:])
    assert len(set(new.flatten().tolist())) > 3


@torch.no_grad()
def test_chunked_prefill_samples_as_one_pass(model):
    """A 30-token prompt prefilled 4 tokens at a time gives the same sampled tokens (seeded, temperature 1)
    as one prefill pass; bad prompts and chunk sizes are refused with the problem named."""
    ids = _ids(2, 30, seed=3)
    kw = dict(temperature=1.0, seed=5)
    chunked = openk3.generate.generate(model, ids, 8, prefill_chunk=4, **kw)
    assert torch.equal(chunked, openk3.generate.generate(model, ids, 8, prefill_chunk=10**6, **kw))
    with pytest.raises(ValueError, match="input_ids is empty"):
        openk3.generate.generate(model, ids[:, :0], 2)
    with pytest.raises(ValueError, match="prefill_chunk"):
        openk3.generate.generate(model, ids, 2, prefill_chunk=0)


@torch.no_grad()
def test_packed_sequences_equal_separate_runs(model):
    lengths = [17, 1, 64, 40]
    docs = [_ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = model(torch.cat(docs, 1), cu_seqlens=cu).logits
    alone = torch.cat([model(d).logits for d in docs], 1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-9)


@torch.no_grad()
def test_packed_cache_holds_one_state_per_document(model):
    lengths = [5, 9]
    docs = [_ids(1, n, seed=20 + i) for i, n in enumerate(lengths)]
    cache = model.new_cache()
    model(torch.cat(docs, 1), cache, cu_seqlens=torch.tensor([0, 5, 14]))
    kda = [c for c in cache.layers if hasattr(c, "recurrent_state")]
    assert kda and all(c.recurrent_state.shape[0] == 2 for c in kda)


def test_training_forward_backward_finite():
    m = openk3.build_model(k3_shaped(4, vocab_size=256), seed=0)
    ids = _ids(2, 33, vocab=256)
    loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    assert math.isclose(loss.item(), math.log(256), rel_tol=0.05)  # near-uniform at init
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    # layer 0's attention-side AttnRes parameters are never used (no completed block yet)
    lm = m.language_model.model
    assert grads["language_model.model.layers.0.self_attention_res_proj.weight"] is None
    assert lm.layers[1].self_attn.A_log.grad is not None


def test_bad_input_errors():
    m = openk3.build_model(k3_shaped(4, vocab_size=256), seed=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="integer"):
        m(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        m(torch.tensor([1, 2]))
    m.config.text_config.max_position_embeddings = 8
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.zeros(1, 9, dtype=torch.long))
    cache = m.new_cache()
    m(torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.zeros(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="batch size 1"):
        m(torch.zeros(2, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 6]))
