"""Lossless speculative decoding: the acceptance rule, greedy identity, the output distribution at
temperature 1, and the rollback of KDA states, conv caches and MLA latents."""

from __future__ import annotations

import copy

import pytest
import torch

import openk3
from openk3.config import KimiLinearConfig, LinearAttnConfig
from openk3.generate import generate
from openk3.model.cache import KDACache, KDAStateSlots
from openk3.model.draft import DraftConfig, build_draft, feature_layers
from openk3.presets import k3_shaped
from openk3.speculative import (
    SpeculativeStats,
    accept_drafts,
    speculative_generate,
    speculative_stream,
)
from openk3.train.draft_trainer import train_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(vocab: int, depth: int = 4, seed: int = 0):
    model = openk3.build_model(k3_shaped(depth, vocab_size=vocab), seed=seed).eval()
    cfg = model.language_model.config
    dc = DraftConfig(feature_layers(depth), vocab, cfg.hidden_size, depth, ttt_steps=2)
    return model, build_draft(cfg, dc, seed=seed + 1).eval()


@pytest.fixture(scope="module")
def trained_pair():
    """A 16-token target and a draft fitted in 20 steps to its greedy continuations of four prompts (so
    chains are often kept whole and sometimes cut), both then in fp64."""
    model, draft = _pair(16)
    prompts = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        data = torch.cat([prompts, generate(model, prompts, 24)], 1)
    train_draft(draft, model.language_model, iter([data] * 20), 20, lr=3e-3)
    return model.double(), draft.double().eval(), prompts


def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution: the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# ---- the acceptance rule ------------------------------------------------------------------------------
def test_accept_rule_first_token_follows_target():
    """10⁴ draws of the rule with a poor draft: the first emitted token is distributed as p₀."""
    g = torch.Generator().manual_seed(0)
    V, k, N = 5, 2, 10_000
    p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(k, V, generator=g, dtype=torch.float64), -1)
    counts = torch.zeros(V)
    kept = torch.zeros(k + 1)
    for _ in range(N):
        d1 = int(torch.multinomial(q[0], 1, generator=g))
        d2 = int(torch.multinomial(q[1], 1, generator=g))
        n, nxt = accept_drafts(p, q, [d1, d2], g)
        counts[d1 if n >= 1 else nxt] += 1
        kept[n] += 1
    expected = N * p[0]
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_pvalue(stat, V - 1) > 1e-3, (counts, expected)
    alpha = float(torch.minimum(p[0], q[0]).sum())  # P(first draft kept) = Σ min(p, q)
    assert abs(float(kept[1:].sum()) / N - alpha) < 4 * (alpha * (1 - alpha) / N) ** 0.5


def test_accept_rule_keeps_all_when_draft_equals_target():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 7, generator=g, dtype=torch.float64), -1)
    for _ in range(50):
        drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        assert accept_drafts(p, p[:3], drafts, g)[0] == 3


# ---- greedy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_is_identical_to_plain_decoding(trained_pair, k):
    model, draft, prompts = trained_pair
    kept = []
    for ids in (prompts[:1], prompts[2:3], torch.tensor([[1, 2, 3, 4, 5]])):
        stats = SpeculativeStats()
        out = speculative_generate(model, draft, ids, 24, num_speculative_tokens=k, stats=stats)
        assert torch.equal(out, generate(model, ids, 24)), k
        kept += stats.accepted_per_step
    assert 0 in kept and max(kept) == min(k, 3)  # rejections happened, and whole chains were kept


def test_stop_ids_and_max_new_tokens(trained_pair):
    model, draft, prompts = trained_pair
    ref = generate(model, prompts[:1], 20)[0].tolist()
    stop = ref[6]
    out = speculative_generate(model, draft, prompts[:1], 20, num_speculative_tokens=4, stop_ids={stop})[
        0
    ].tolist()
    assert out == ref[: ref.index(stop) + 1]
    for n in (1, 2, 7):
        assert speculative_generate(model, draft, prompts[:1], n, num_speculative_tokens=5).shape == (1, n)


def test_bad_arguments_are_refused(trained_pair):
    model, draft, prompts = trained_pair
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        next(speculative_stream(model, draft, prompts[:1], 4, num_speculative_tokens=0))
    with pytest.raises(ValueError, match="one sequence"):
        next(speculative_stream(model, draft, prompts[:2], 4))


# ---- temperature 1: the target's distribution -----------------------------------------------------------
def test_sampled_output_has_the_target_distribution():
    """Two tokens sampled with speculation follow the target's exact joint distribution (chi-square over the
    9 pairs of a 3-token vocabulary, 400 seeds). The draft is deliberately poor (its head sharpened), so
    both the kept and the resampled branch of the rule run; a small hybrid target (KDA, KDA, MLA) keeps
    the test fast."""
    V, N = 3, 400
    cfg = KimiLinearConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config=LinearAttnConfig(
            num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 2], full_attn_layers=[3]
        ),
    )  # fmt: skip
    model = openk3.build_model(cfg, seed=0).eval()
    model.lm_head.weight.data *= 20.0  # a target far from uniform
    draft = build_draft(cfg, DraftConfig(feature_layers(3), V, 32, 3), seed=1).eval()
    draft.layer.shared_head.norm.weight.data *= 30.0
    prompt = torch.tensor([[1, 2, 0, 2]])
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        both = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = torch.softmax(model(both).logits[:, -1].double(), -1)
    expected = (p1[:, None] * p2).flatten() * N  # exact P(x1, x2), by enumeration
    counts = torch.zeros(V * V, dtype=torch.float64)
    stats = SpeculativeStats()
    for seed in range(N):
        # 3 tokens: the second comes out of the rule (a draft kept, or the residual), the third is its bonus
        out = speculative_generate(model, draft, prompt, 3, num_speculative_tokens=1, temperature=1.0, seed=seed, stats=stats)  # fmt: skip
        a, b = out[0, :2].tolist()
        counts[a * V + b] += 1
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate  # both branches of the rule ran
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_pvalue(stat, V * V - 1) > 1e-3, (stat, counts.tolist(), expected.tolist())


def test_seeded_sampling_is_reproducible(trained_pair):
    model, draft, prompts = trained_pair
    run = [
        speculative_generate(
            model, draft, prompts[:1], 16, num_speculative_tokens=3, temperature=0.9, top_p=0.9, seed=7
        )
        for _ in range(2)
    ]
    assert torch.equal(run[0], run[1])


# ---- rollback ----------------------------------------------------------------------------------------
def _states(cache):
    out = []
    for c in cache.layers:
        if isinstance(c, KDACache):
            out += [c.recurrent_state, *c.conv_states]
        else:
            out += [c.latent, c.k_pe]
    return out


@pytest.mark.parametrize("kept", [0, 1, 2, 3, 4, 5])
def test_rollback_equals_plain_decoding_of_the_kept_tokens(kept):
    """fp64, CPU: after verifying 5 tokens and keeping ``kept`` of them, every KDA state, conv cache and MLA
    latent equals plain one-token decoding of those tokens. Not bitwise: a matmul over 5 rows rounds
    differently from one over 1 row (measured ~4e-15), so the bound is 1e-12, far below what one leaked
    token changes (checked)."""
    model = openk3.build_model(k3_shaped(8, vocab_size=64), dtype=torch.float64, seed=0).eval()
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        spec = model.new_cache()
        model(ids[:, :9], spec)
        spec.begin_verify()
        model(ids[:, 9:], spec)
        leaked = [t.clone() for t in _states(spec)]
        spec.rollback(kept)
        plain = model.new_cache()
        model(ids[:, :9], plain)
        for t in range(9, 9 + kept):
            model(ids[:, t : t + 1], plain)
    assert spec.seq_len == plain.seq_len == 9 + kept
    for a, b in zip(_states(spec), _states(plain)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if kept < 5:
        assert max(float((a - b).abs().max()) for a, b in zip(leaked[:1], _states(plain)[:1])) > 1e-6


def test_verification_computes_what_the_plain_forward_computes():
    """The verification forward gives the plain cached forward's logits, and keeping every verified token
    leaves its caches (fp64; to 1e-13: per-token KDA steps round like one-token decoding, not like the
    multi-token call, in the last bit)."""
    model = openk3.build_model(k3_shaped(8, vocab_size=64), dtype=torch.float64, seed=0).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        spec, plain = model.new_cache(), model.new_cache()
        model(ids[:, :8], spec)
        model(ids[:, :8], plain)
        spec.begin_verify()
        a = model(ids[:, 8:], spec).logits
        b = model(ids[:, 8:], plain).logits
        spec.rollback(4)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    for x, y in zip(_states(spec), _states(plain)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-13)


@pytest.mark.parametrize("B", [3, 4])
@pytest.mark.parametrize("kept", [[0, 2, 5, 4], [5, 1, 3, 0]])
def test_server_slots_roll_back_each_row_to_its_own_kept_tokens(kept, B):
    """A KDA layer on a server's :class:`KDAStateSlots` (fp64): a verification of 5 tokens then
    ``rollback(kept)`` leaves row ``b`` with the recurrent state and conv window of the model's plain cached
    forward (the chunked op over a :class:`KDACache`, an independent path) over its first ``kept[b]``
    tokens; the outputs of the kept tokens match too."""
    model = openk3.build_model(k3_shaped(4, vocab_size=16), dtype=torch.float64, seed=0).eval()
    layer = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    kept = kept[:B]
    T, D, P, W1 = 5, layer.q_proj.in_features, layer.q_proj.out_features, layer.q_conv1d.kernel_size - 1
    g = torch.Generator().manual_seed(7)
    x_BTD = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    rec0 = torch.randn(B, layer.num_heads, layer.head_dim, layer.head_dim, generator=g, dtype=torch.float64)
    conv0 = torch.randn(B, 3, P, W1, generator=g, dtype=torch.float64)
    slots = KDAStateSlots(rec0.clone(), conv0.clone(), verify=True)
    with torch.no_grad():
        y_BTD = layer(x_BTD, slots)
        assert slots.steps[1].shape[1] == T and slots.steps[2].shape[1] == T + 1
        slots.rollback(kept if B % 2 else torch.tensor(kept))  # host ints or a device tensor
        assert slots.steps is None and not slots.verify
        for b, n in enumerate(kept):
            cache = KDACache(tuple(conv0[b : b + 1, i] for i in range(3)), rec0[b : b + 1].clone())
            if n:
                y_1ND = layer(x_BTD[b : b + 1, :n], cache)
                torch.testing.assert_close(y_BTD[b, :n], y_1ND[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(slots.recurrent[b], cache.recurrent_state[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(
                slots.conv[b], torch.stack(cache.conv_states, 1)[0], rtol=0, atol=1e-12
            )


def test_rollback_errors():
    model = openk3.build_model(k3_shaped(4, vocab_size=16), seed=0).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="begin_verify"):
        cache.rollback(1)
    cache.begin_verify()
    with torch.no_grad():
        model(torch.tensor([[4, 5]]), cache)
    with pytest.raises(ValueError, match=r"num_kept must be an int in \[0, 2\]"):
        cache.rollback(3)


# ---- CUDA (the Triton decode kernel inside the verification) -----------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton KDA decode kernel path)")
def test_gpu_greedy_and_rollback_on_cuda(trained_pair):
    model64, draft64, prompts = trained_pair
    model, draft = copy.deepcopy(model64).float().cuda(), copy.deepcopy(draft64).float().cuda()
    for k in (1, 3, 5):
        for p in prompts[:2]:
            ids = p[None].cuda()  # [1, 4]
            out = speculative_generate(model, draft, ids, 24, num_speculative_tokens=k)
            assert torch.equal(out, generate(model, ids, 24)), k
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        spec, plain = model.new_cache(), model.new_cache()
        model(ids[:, :7], spec)
        model(ids[:, :7], plain)
        spec.begin_verify()
        model(ids[:, 7:], spec)
        spec.rollback(3)
        for t in range(7, 10):
            model(ids[:, t : t + 1], plain)
    for a, b in zip(_states(spec), _states(plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
