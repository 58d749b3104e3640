"""The serving engine against the model itself: prefix-cache hit == cold run, batched == single request,
the paged batched forward (absorbed/naive MLA, two-phase AttnRes, in-place KDA decode) == the model's
forward, chunked prefill, admission, abort. References are :func:`openk3.generate.greedy` and the model
forward with its own cache."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.generate import greedy
from openk3.model.attn_res import MixSite, TwoPhaseAttnRes, attn_res_mix
from openk3.model.cache import KDACache, KDAStateSlots
from openk3.model.norm import RMSNorm
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.serve.metrics import ServerMetrics
from openk3.serve.scheduler import QueueFullError

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=0).eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def engine(
    model, block_size=8, num_blocks=2000, interval=2, caching=True, host_pool_mib=0.0, **sched
) -> LLMEngine:
    sched = {"max_num_batched_tokens": 96, "max_num_seqs": 16, "long_prefill_token_threshold": 32, **sched}
    return LLMEngine(
        model,
        EngineConfig(
            CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                checkpoint_interval=interval,
                enable_prefix_caching=caching,
                host_pool_mib=host_pool_mib,
            ),
            SchedulerConfig(**sched),
        ),
    )


def reference(model, prompt, n):
    return greedy(model, torch.tensor([prompt]), n)[0].tolist()


def run(eng, ps, n, tag="r"):
    reqs = [Request(f"{tag}{i}", p, SamplingParams(max_tokens=n)) for i, p in enumerate(ps)]
    out = eng.generate(reqs)
    return [out[r.request_id] for r in reqs], reqs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
def test_two_phase_attn_res_equals_one_phase(compiled):
    """Eager (phase 1 as einsums) and traced by ``torch.compile`` (products and sums; aot_eager) alike."""
    torch.manual_seed(0)
    D = 16
    sites = []
    for n in (1, 1, 2, 3, 3):
        norm, proj = RMSNorm(D), torch.nn.Linear(D, 1, bias=False)
        norm.weight.data.uniform_(0.5, 1.5)
        proj.weight.data.normal_()
        sites.append(MixSite(norm, proj, n))
    for i, s in enumerate(sites):
        s.index = sum(1 for t in sites[:i] if t.num_blocks == s.num_blocks)
    blocks = [torch.randn(3, 1, D, dtype=torch.float64) for _ in range(3)]
    res = TwoPhaseAttnRes(sites)
    mix = torch.compile(res, backend="aot_eager", fullgraph=True) if compiled else res
    for s in sites:
        partial = torch.randn(3, 1, D, dtype=torch.float64)
        torch.testing.assert_close(
            mix(blocks[: s.num_blocks], partial, s.norm, s.proj),
            attn_res_mix(blocks[: s.num_blocks], partial, s.norm, s.proj),
            rtol=1e-12,
            atol=1e-12,
        )
    with pytest.raises(ValueError, match="no AttnRes site reads 2 blocks"):
        res(blocks[:2], partial, sites[0].norm, sites[0].proj)


def test_two_phase_model_forward_equals_one_phase():
    """The model's forward with two-phase AttnRes == one mix at a time (float64, pseudo-queries not zero)."""
    cfg = openk3.presets.k3_shaped(4, vocab_size=VOCAB)
    backbone = openk3.build_model(cfg, dtype=torch.float64, seed=2).language_model.model
    torch.manual_seed(0)
    for site in backbone.attn_res_sites:
        site.proj.weight.data.normal_()
    ids = torch.tensor(prompts([9, 9]))
    with torch.no_grad():
        want = backbone(ids)
        got = backbone(ids, two_phase_attn_res=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lengths", [[3, 17, 40], [40]])
@pytest.mark.parametrize("T", [1, 3, 20])
def test_paged_forward_equals_model_forward(model, T, lengths):
    """B requests with different cached lengths bring T tokens each: a decode (T = 1), a short continuing
    chunk (absorbed MLA, recurrent KDA on the layer forward) and a long one (naive MLA, chunked KDA); one
    request alone has no padding (naive MLA through SDPA's lower-right causal bias)."""
    eng = engine(model)
    ps = prompts(lengths)
    reqs = [Request(f"d{i}", p, SamplingParams(max_tokens=T + 3)) for i, p in enumerate(ps)]
    for r in reqs:
        eng.add_request(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        eng.step()  # prefill (each request's first token is sampled from the prefill logits)
    new = [[r.output_token_ids[-1]] + prompts([T - 1], seed=i + 20)[0] for i, r in enumerate(reqs)]
    kv = eng.kv
    for r in reqs:
        kv.allocate_slots(r, T)
    logits, features = eng.runner.paged_forward(
        new,
        [r.num_computed_tokens for r in reqs],
        [kv.block_tables[r.request_id] for r in reqs],
        [kv.state_slots[r.request_id] for r in reqs],
    )
    assert features is None  # no feature layers asked for
    assert len(ps) == 1 or len(reqs[0].output_token_ids) > 1  # the short prompt was already decoding
    for r, ids, row in zip(reqs, new, logits):
        want = model(torch.tensor([r.all_token_ids[:-1] + ids])).logits[0, -1]
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 3])
def test_kda_state_slots_in_place_equal_the_layer(T):
    """The KDA layer on a server's state views (in place) == the layer with its own cache (float64)."""
    torch.manual_seed(0)
    lm = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), dtype=torch.float64, seed=1)
    attn = lm.language_model.model.layers[1].self_attn
    B, H, K, D, W = 5, attn.num_heads, attn.head_dim, attn.q_proj.in_features, attn.q_conv1d.kernel_size
    x = torch.randn(B, T, D, dtype=torch.float64)
    S = torch.randn(B, H, K, K, dtype=torch.float64) * 0.1
    conv = torch.randn(B, 3, H * K, W - 1, dtype=torch.float64)
    cache = KDACache((conv[:, 0].clone(), conv[:, 1].clone(), conv[:, 2].clone()), S.clone())
    with torch.no_grad():
        want = attn(x, cache)
        got = attn(x, KDAStateSlots(S, conv))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, cache.recurrent_state, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv, torch.stack(cache.conv_states, 1), rtol=0, atol=0)


def test_batched_equals_single_and_reference(model):
    ps = prompts([1, 5, 9, 23, 40, 64])
    batched, _ = run(engine(model), ps, 10)
    for p, out in zip(ps, batched):
        single, _ = run(engine(model), [p], 10)
        assert out == single[0] == reference(model, p, 10)


def test_prefix_hit_equals_cold(model):
    shared = prompts([48], seed=1)[0]
    a, b = shared + prompts([5], seed=2)[0], shared + prompts([7], seed=3)[0]
    eng = engine(model, interval=2)  # checkpoints every 16 tokens and at the last boundary
    run(eng, [a], 8, "a")
    (hot,), (req,) = run(eng, [b], 8, "b")
    assert req.num_cached_tokens == 48  # 6 blocks of 8: MLA blocks and the KDA state after token 48
    (cold,), (creq,) = run(engine(model, caching=False), [b], 8, "c")
    assert creq.num_cached_tokens == 0
    assert hot == cold == reference(model, b, 8)
    (again,), (req2,) = run(eng, [b], 8, "b2")  # the whole prompt but its last block boundary is cached now
    assert req2.num_cached_tokens == 48 and again == cold
    eng.pool.check_invariants()
    assert eng.pool.usage == 0.0


def test_branch_point_checkpoint(model):
    shared = prompts([20], seed=4)[0]  # not on a checkpoint grid of 16: 2 blocks of 8 + 4 tokens
    a, b = shared + prompts([12], seed=5)[0], shared + prompts([12], seed=6)[0]
    eng = engine(model, interval=0)  # only the last boundary before the prompt's end
    run(eng, [a], 2, "a")
    _, (rb,) = run(eng, [b], 2, "b")
    assert rb.num_cached_tokens == 0 and 16 in rb.checkpoint_positions  # MLA matched 16 tokens, no state
    c = shared + prompts([9], seed=7)[0]
    (out,), (rc,) = run(eng, [c], 6, "c")
    assert rc.num_cached_tokens == 16 and out == reference(model, c, 6)


def test_prompt_ending_on_a_block_boundary_is_reused_whole(model):
    """A 32-token prompt with 16-token blocks, then the same prompt + 1 token: both full blocks are reused
    (the KDA state after token 32 is kept), and an exact repeat still reuses the first block."""
    first = prompts([32], seed=8)[0]
    eng = engine(model, block_size=16, interval=0)
    _, (r1,) = run(eng, [first], 4, "a")
    assert r1.checkpoint_positions == {16, 32}
    ext = first + prompts([1], seed=9)[0]
    (out,), (r2,) = run(eng, [ext], 6, "b")
    assert r2.num_cached_tokens == 32 and out == reference(model, ext, 6)
    (again,), (r3,) = run(eng, [first], 4, "c")
    assert r3.num_cached_tokens == 16 and again == reference(model, first, 4)
    eng.pool.check_invariants()


def test_next_turn_reuses_the_generated_text(model):
    """Turn 2 = turn 1's prompt + its 10 generated tokens + 5 new ones: the state at the last block boundary
    inside the generated text (token 24 of 29 computed, 8-token blocks) is reused, not only the prompt's."""
    first = prompts([20], seed=14)[0]
    eng = engine(model, interval=0)
    (out1,), _ = run(eng, [first], 10, "t1")
    second = first + out1 + prompts([5], seed=15)[0]
    (out2,), (r2,) = run(eng, [second], 6, "t2")
    assert r2.num_cached_tokens == 24 and out2 == reference(model, second, 6)
    eng.pool.check_invariants()


def test_host_tier_hit_equals_cold(model):
    """A prefix evicted from a small device pool comes back from the host tier: the same hit as if it had
    stayed, and the same tokens as a cold run and the reference."""
    shared = prompts([48], seed=10)[0]
    a, b = shared + prompts([5], seed=11)[0], shared + prompts([7], seed=12)[0]
    fillers = prompts([60, 61, 62], seed=13)  # each needs a state slot and a checkpoint of 55 pages

    def sequence(host_pool_mib):
        eng = engine(model, num_blocks=140, interval=0, host_pool_mib=host_pool_mib)
        run(eng, [a], 4, "a")
        for i, f in enumerate(fillers):
            run(eng, [f], 2, f"f{i}")
        (out,), (req,) = run(eng, [b], 8, "b")
        return eng, out, req

    eng, hot, req = sequence(host_pool_mib=2.0)
    assert req.num_cached_tokens == 48 and eng.kv.host_hit_tokens == 48 and eng.kv.host.num_loaded == 7
    (cold,), _ = run(engine(model, caching=False), [b], 8, "c")
    assert hot == cold == reference(model, b, 8)
    eng.pool.check_invariants()
    eng.kv.host.check_invariants()
    stats = eng.stats()
    assert stats.host_hit_tokens == 48 and 0 < stats.host_tier_usage < 1
    text = ServerMetrics().render(stats).decode()
    assert (
        "openk3:host_tier_hits_total 48.0" in text
        and f"openk3:host_tier_usage_perc {stats.host_tier_usage}" in text
    )
    _, out, req = sequence(host_pool_mib=0.0)
    assert req.num_cached_tokens == 0 and out == cold  # without the tier the prefix was evicted for good


def test_chunked_prefill_interleaves(model):
    ps = prompts([100, 6])
    eng = engine(model, max_num_batched_tokens=40, long_prefill_token_threshold=16, max_num_seqs=4)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=5)) for i, p in enumerate(ps)]
    for r in reqs:
        eng.add_request(r)
    first = eng.scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in first.chunks] == [
        ("r0", 0, 16),
        ("r1", 0, 6),
    ]
    eng.scheduler.update(first, eng.runner.execute(first))
    out = eng.generate([])
    assert [r.output_token_ids for r in reqs] == [reference(model, p, 5) for p in ps]
    assert out == {}


def test_admission_waits_for_blocks_queue_bound_and_abort(model):
    # state pages of this model with 8-token blocks: 55; a 30-token request with 10 new tokens needs 5 blocks
    eng = engine(model, num_blocks=1 + 55 + 5 + 20, max_waiting=1, caching=False)
    assert eng.storage.layout.state_pages == 55
    ps = prompts([30, 30, 30], seed=8)
    r0, r1, r2 = (Request(f"q{i}", p, SamplingParams(max_tokens=10)) for i, p in enumerate(ps))
    eng.add_request(r0)
    eng.step()
    eng.add_request(r1)  # waits: only one request's state slot fits
    with pytest.raises(QueueFullError):
        eng.add_request(r2)
    with pytest.raises(ValueError, match="cache blocks"):
        eng.add_request(Request("huge", ps[0], SamplingParams(max_tokens=400)))
    eng.step()
    assert [r.status.value for r in (r0, r1)] == ["running", "waiting"] and len(r0.output_token_ids) == 2
    eng.abort_request("q0")
    outputs = eng.step()
    assert any(o.request_id == "q0" and o.finish_reason == "abort" for o in outputs)
    assert r1.status.value == "running"
    eng.generate([])
    assert r1.output_token_ids == reference(model, ps[1], 10)
    assert eng.pool.usage == 0.0 and not eng.kv.block_tables


def test_queue_timeout_rejects(model):
    eng = engine(model, num_blocks=1 + 55 + 5, queue_timeout_s=0.01, caching=False)
    ps = prompts([30, 30], seed=9)
    r0, r1 = (Request(f"t{i}", p, SamplingParams(max_tokens=10)) for i, p in enumerate(ps))
    eng.add_request(r0)
    eng.add_request(r1)
    r1.arrival_time -= 1.0  # it has waited a second already
    outputs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("t1", "rejected")]


def test_sampling_seed_is_reproducible(model):
    p = prompts([12], seed=10)[0]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=123)
    a = engine(model).generate([Request("x", p, params)])["x"]
    b = engine(model).generate([Request("x", p, params), Request("y", prompts([7])[0], params)])["x"]
    assert a == b and len(a) == 8


def test_async_engine_shutdown_aborts_requests_and_refuses_new_ones(model):
    """Server exit: every in-flight request ends at the next step with ``"abort"``, long before its
    ``max_tokens``; a submit afterwards raises ``EngineClosedError``."""
    import threading

    from openk3.serve.async_engine import AsyncEngine, EngineClosedError

    eng = AsyncEngine(engine(model))
    outputs, first, done = [], threading.Event(), threading.Event()

    def callback(out):
        outputs.append(out)
        first.set()
        if out.finished:
            done.set()

    eng.start()
    try:
        eng.submit(Request("long", prompts([9])[0], SamplingParams(max_tokens=2000)), callback)
        assert first.wait(20)
        eng.shutdown()
        assert done.wait(5)
        assert outputs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outputs) < 2000
        with pytest.raises(EngineClosedError):
            eng.submit(Request("late", prompts([5])[0], SamplingParams(max_tokens=2)), callback)
        assert eng.num_tracked_requests() == 0 and not eng.engine.kv.block_tables
    finally:
        eng.stop()


def test_pool_larger_than_free_memory_is_refused(model, monkeypatch):
    """A pool that does not fit the device's free memory is refused before it is allocated, naming the flags;
    the free memory read on this machine is positive and the default pool fits it."""
    from openk3.serve import engine as engine_module

    free = engine_module.free_memory_bytes(torch.device("cpu"))
    assert free is None or free > 0
    LLMEngine(model, EngineConfig())  # the default 256 MiB pool
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: 2**20)
    with pytest.raises(
        ValueError,
        match=r"the cache pool needs .* GiB .* but only 0\.00 GiB is free on cpu: lower "
        r"--pool-mib or --num-blocks",
    ):
        LLMEngine(model, EngineConfig())


def test_engine_samples_only_ids_of_the_tokenizer(model):
    """``sample_vocab_size`` (the server passes its tokenizer's size) keeps every sampled id below it."""
    eng = LLMEngine(model, EngineConfig(), sample_vocab_size=20)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=5)
    out = eng.generate([Request("a", prompts([9])[0], params), Request("b", prompts([5], seed=1)[0], params)])
    assert all(0 <= t < 20 for toks in out.values() for t in toks)
    unrestricted = engine(model).generate([Request("a", prompts([9])[0], params)])["a"]
    assert max(unrestricted) >= 20
