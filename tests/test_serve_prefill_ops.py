"""The eager prefill step's host cost, counted in ATen operators (``benchmarks/prefill_ops.py`` breaks it down).

A prefill step on a GPU is host-bound: each ATen call costs host time whatever the chunk length, so the
number of calls per step is what to keep down. The test profiles one engine step of each prefill kind on
k3-tiny (fp32, CPU): a first chunk (the packed forward) and a chunk continuing it (the paged forward, more
than 16 tokens), and bounds the ATen calls in each (every ``aten::`` event inside the step, nested ones
included, as ``benchmarks/serve_profile.py`` counts them). The CPU counts hold the CPU forms of the chunked
KDA op (a torch loop over chunks) and of ``grouped_mm`` (a loop over experts), fixed for these shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import openk3
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

CHUNK = 64
"""Prompt tokens per prefill chunk (the block size too: a chunk ends on a block boundary)."""
MAX_OPS = {"first": 16232, "continuing": 18910}
"""ATen calls of each step on k3-tiny, 64-token chunks (torch 2.13, CPU): 17,008 / 19,820 before session
52's cuts (one short convolution for q, k and v, the KDA layer's packed input projections, RMSNorm without
no-op casts, the two-phase AttnRes rows unbound once, the KDA states written per layer in two copies),
16,232 / 18,910 after them."""


def step_ops(engine: LLMEngine) -> int:
    """ATen calls inside one ``engine.step()``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            engine.step()
    events = list(prof.events())
    step = next(e for e in events if e.name == "step")
    lo, hi = step.time_range.start, step.time_range.end
    return sum(
        e.name.startswith("aten::") and lo <= e.time_range.start and e.time_range.end <= hi for e in events
    )


@pytest.mark.slow  # ~45 s on a 2-core CPU (the profiler records ~35,000 events)
def test_a_prefill_step_runs_at_most_the_measured_number_of_aten_ops():
    config = openk3.get_preset("k3-tiny")
    model = openk3.build_model(config, seed=0)
    vocab = openk3.config.text_config_of(config).vocab_size
    prompt = torch.randint(0, vocab, (2 * CHUNK,), generator=torch.Generator().manual_seed(0)).tolist()
    sched = SchedulerConfig(
        max_num_batched_tokens=CHUNK + 1,
        max_num_seqs=1,
        long_prefill_token_threshold=CHUNK,
        max_model_len=2 * CHUNK + 1,
        max_waiting=1,
    )
    engine = LLMEngine(model, EngineConfig(CacheConfig(block_size=CHUNK), sched, static_decode=False))
    request = Request("r", prompt, SamplingParams(max_tokens=1))
    engine.add_request(request)
    counts = {"first": step_ops(engine), "continuing": step_ops(engine)}
    assert request.output_token_ids  # the second step finished the prompt
    assert counts == {k: min(n, MAX_OPS[k]) for k, n in counts.items()}, (counts, MAX_OPS)
