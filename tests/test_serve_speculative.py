"""Speculative decoding in the serving engine: greedy outputs identical to plain decoding under continuous
batching, prefix caching, stop tokens and per-request k; seeded sampling reproducible; bad k refused."""

from __future__ import annotations

import copy

import pytest
import torch

import openk3
from openk3.generate import generate, greedy
from openk3.model.draft import DraftConfig, build_draft, feature_layers
from openk3.presets import k3_shaped
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.train.draft_trainer import train_draft

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 16


@pytest.fixture(scope="module")
def pair():
    """fp64 target (so greedy ties cannot flip between batch shapes) and a draft fitted in 20 steps to the
    target's greedy continuations of four prompts (chains often kept whole, sometimes cut)."""
    model = openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0).eval()
    cfg = model.language_model.config
    draft = build_draft(cfg, DraftConfig(feature_layers(4), VOCAB, cfg.hidden_size, 4, ttt_steps=2), seed=1)
    prompts = torch.randint(0, VOCAB, (4, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        data = torch.cat([prompts, generate(model, prompts, 24)], 1)
    train_draft(draft, model.language_model, iter([data] * 20), 20, lr=3e-3)
    return model.double(), draft.double().eval(), prompts.tolist()


def engine(model, draft, k=3, caching=True) -> LLMEngine:
    cache = CacheConfig(block_size=4, num_blocks=600, checkpoint_interval=1, enable_prefix_caching=caching)
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=16)
    return LLMEngine(model, EngineConfig(cache, sched), draft=draft, num_speculative_tokens=k)


def reference(model, prompt, n):
    return greedy(model, torch.tensor([prompt]), n)[0].tolist()


def test_greedy_batch_equals_plain_decoding(pair):
    model, draft, prompts = pair
    extra = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1)).tolist()
    ps = prompts + extra + [prompts[0] * 5]
    eng = engine(model, draft)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=18 + i)) for i, p in enumerate(ps)]
    out = eng.generate(reqs)
    for r, p in zip(reqs, ps):
        assert out[r.request_id] == reference(model, p, r.sampling_params.max_tokens), r.request_id
    spec = eng.runner.speculative
    assert spec.num_accepted > 0 and spec.num_accepted < spec.num_drafted  # kept and rejected drafts
    assert not spec.states  # every finished request released its draft state
    assert eng.pool.num_free_blocks == eng.pool.num_blocks - 1  # nothing leaked


@pytest.mark.parametrize("k", [1, 5])
def test_each_k_and_per_request_override(pair, k):
    model, draft, prompts = pair
    eng = engine(model, draft, k=k)
    reqs = [
        Request("a", prompts[0], SamplingParams(max_tokens=20)),
        Request("b", prompts[1], SamplingParams(max_tokens=20, num_speculative_tokens=0)),
        Request("c", prompts[2], SamplingParams(max_tokens=20, num_speculative_tokens=4)),
    ]
    out = eng.generate(reqs)
    for r in reqs:
        assert out[r.request_id] == reference(model, r.prompt_token_ids, 20), (k, r.request_id)


def test_prefix_cache_hit_and_stop_token(pair):
    model, draft, prompts = pair
    eng = engine(model, draft)
    prefix = prompts[0] * 4  # 16 tokens: 4 full blocks
    first = eng.generate([Request("x", prefix + [3], SamplingParams(max_tokens=12))])["x"]
    assert first == reference(model, prefix + [3], 12)
    second = Request("y", prefix + [5], SamplingParams(max_tokens=12))
    assert eng.generate([second])["y"] == reference(model, prefix + [5], 12)
    assert second.num_cached_tokens > 0
    ref = reference(model, prompts[3], 16)
    stop = ref[7]
    got = eng.generate(
        [Request("s", prompts[3], SamplingParams(max_tokens=16, stop_token_ids=frozenset({stop})))]
    )
    assert got["s"] == ref[: ref.index(stop) + 1]


def test_seeded_sampling_is_reproducible_and_n_choices_differ(pair):
    model, draft, prompts = pair
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (11, 11, 12)]
    eng = engine(model, draft)
    reqs = [Request(f"n{i}", prompts[1], p) for i, p in enumerate(params)]
    out = eng.generate(reqs)
    assert out["n0"] == out["n1"]
    assert len(out["n2"]) == 16 and all(0 <= t < VOCAB for t in out["n2"])
    again = engine(model, draft).generate([Request("m", prompts[1], params[0])])["m"]
    assert again == out["n0"]


def test_bad_k_is_refused(pair):
    model, draft, prompts = pair
    with pytest.raises(ValueError, match="num_speculative_tokens must be None or an int in"):
        SamplingParams(num_speculative_tokens=17)
    plain = LLMEngine(model, EngineConfig(CacheConfig(block_size=4, num_blocks=200), SchedulerConfig()))
    with pytest.raises(ValueError, match="needs a server started with a draft"):
        plain.add_request(Request("z", prompts[0], SamplingParams(num_speculative_tokens=2)))
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        engine(model, draft, k=0)
    with pytest.raises(ValueError, match="static_decode=True cannot run with a draft"):
        LLMEngine(model, EngineConfig(static_decode=True), draft=draft)
    assert engine(model, draft).runner.decode_graphs is None  # the draft needs every forward's features


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton KDA decode kernel path)")
def test_gpu_engine_greedy_on_cuda(pair):
    model64, draft64, prompts = pair
    model, draft = copy.deepcopy(model64).float().cuda(), copy.deepcopy(draft64).float().cuda()
    eng = engine(model, draft)
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    out = eng.generate(reqs)
    for r in reqs:
        want = greedy(model, torch.tensor([r.prompt_token_ids], device="cuda"), 20)[0].tolist()
        assert out[r.request_id] == want, r.request_id
    assert eng.runner.speculative.num_accepted > 0
