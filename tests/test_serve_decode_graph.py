"""The static decode step (``serve/decode_graph.py``): its eager twin on the CPU against the model's own
greedy generation and the engine's paged path (decodes, a prefix hit's suffix of several tokens), padding
that leaves null block 0 untouched, no host reads inside the step; on a GPU, the
CUDA-graph replay against the eager twin and the reference, and a load test that ends with an empty pool."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.generate import greedy, sample_next
from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig
from openk3.serve.decode_graph import DecodeGraphs, StaticDecode, bucket_of, compile_settings
from openk3.serve.model_runner import sample_tokens

VOCAB = 512
pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def build(device="cpu", dtype=torch.float32):
    return openk3.build_model(
        openk3.presets.k3_shaped(4, vocab_size=VOCAB), device=device, dtype=dtype, seed=0
    ).eval()


def engine(
    model, static, num_blocks=400, max_num_seqs=16, caching=True, block_size=8, chunk=32, queue_timeout_s=60.0
) -> LLMEngine:
    return LLMEngine(
        model,
        EngineConfig(
            CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                checkpoint_interval=2,
                enable_prefix_caching=caching,
            ),
            SchedulerConfig(
                max_num_batched_tokens=3 * chunk,
                max_num_seqs=max_num_seqs,
                long_prefill_token_threshold=chunk,
                queue_timeout_s=queue_timeout_s,
            ),
            static_decode=static,
        ),
    )


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(eng, ps, n, tag="r"):
    reqs = [Request(f"{tag}{i}", p, SamplingParams(max_tokens=n)) for i, p in enumerate(ps)]
    out = eng.generate(reqs)
    return [out[r.request_id] for r in reqs], reqs


def reference(model, prompt, n):
    device = next(model.parameters()).device
    return greedy(model, torch.tensor([prompt], device=device), n)[0].tolist()


def test_bucket_of():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 63, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 128]


def test_static_decode_equals_reference_and_leaves_null_block_zero():
    """Three streams (bucket 4: one padding row) whose cached lengths cross block boundaries (N = 1 … 4)."""
    model = build()
    eng = engine(model, static=True)
    assert isinstance(eng.runner.decode_graphs, DecodeGraphs) and not eng.runner.decode_graphs.capture
    calls = []
    real_run = eng.runner.decode_graphs.run
    eng.runner.decode_graphs.run = lambda chunks: calls.append(len(chunks)) or real_run(chunks)
    ps = prompts([3, 9, 17])
    outs, _ = run(eng, ps, 20)
    assert 3 in calls  # the three streams decoded as one padded batch
    keys = eng.runner.decode_graphs.steps
    assert 4 in {b for b, _, _ in keys} and len({n for *_, n in keys}) >= 2  # padding rows, growing tables
    for p, out in zip(ps, outs):
        assert out == reference(model, p, 20)
    assert torch.count_nonzero(eng.storage.pages[0]) == 0  # padding rows wrote nothing to the null block
    eng.pool.check_invariants()
    assert eng.pool.usage == 0.0


def test_static_decode_prefix_hit_equals_cold():
    model = build()
    shared = prompts([48], seed=1)[0]
    a, b = shared + prompts([5], seed=2)[0], shared + prompts([7], seed=3)[0]
    eng = engine(model, static=True)
    run(eng, [a], 6, "a")
    (hot,), (req,) = run(eng, [b], 6, "b")
    assert req.num_cached_tokens == 48
    assert (1, 7, 8) in eng.runner.decode_graphs.steps  # the 7-token suffix after 48 cached, one static step
    (cold,), _ = run(engine(model, static=False, caching=False), [b], 6, "c")
    assert hot == cold == reference(model, b, 6)


class _Replay:
    """A captured step on the CPU: each replay calls the compiled step on the states it was captured with (a
    CUDA graph replays the kernels the compiled step launched on them)."""

    def __init__(self, run, states) -> None:
        self.run, self.states, self.replays = run, states, 0

    def replay(self) -> None:
        self.replays += 1
        self.run(self.states)


def _capture_compiled(self, states) -> None:
    """:meth:`StaticDecode.capture` without CUDA: the same padding-only warm-up runs of the compiled step."""
    self.inputs.zero_()
    run = self.compiled()
    assert run is not self.forward
    with compile_settings():
        run(states)
        run(states)
    self.graph = _Replay(run, states)
    self.state_ptr = states.recurrent.data_ptr() if states is not None else 0


@pytest.mark.slow
def test_compiled_step_gives_greedy_tokens(monkeypatch):
    """The captured path with the compiled step (traced by dynamo as one graph through AOT autograd, run as
    its FX graph: ``aot_eager``; Inductor's kernels are the test below and the GPU tests): three streams (one
    padding row), block tables that grow (N = 1, 2, 4), then a prefix hit's 7-token suffix; every request's
    tokens are the model's own greedy ones, null block 0 stays zero, and each ``(B, T)`` compiles once: its
    steps of every ``N`` share the graph, and nothing recompiles between replays' calls."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(StaticDecode, "capture", _capture_compiled)
    torch._dynamo.reset()
    counters.clear()
    model = build()
    eng = engine(model, static=True)
    eng.runner.decode_graphs.capture = True  # the graphed path's logic, with the CPU stand-in capture
    shared = prompts([48], seed=1)[0]
    ps, hit = prompts([3, 9, 17]), shared + prompts([7], seed=3)[0]
    outs, _ = run(eng, ps, 14)
    run(eng, [shared + prompts([5], seed=2)[0]], 1, "a")  # caches the shared 48 tokens
    (hot,), (req,) = run(eng, [hit], 4, "b")
    steps = eng.runner.decode_graphs.steps
    assert req.num_cached_tokens == 48 and (1, 7, 8) in steps
    assert {4} <= {b for b, _, _ in steps} and len({n for *_, n in steps}) >= 2
    assert all(s.graph.replays > 0 for s in steps.values())
    shapes = {(b, t) for b, t, _ in steps}
    assert len(steps) >= 6 and len(shapes) < len(steps)
    assert counters["stats"]["unique_graphs"] == len(shapes)
    for p, out in zip(ps, outs):
        assert out == reference(model, p, 14)
    assert hot == reference(model, hit, 4)
    assert torch.count_nonzero(eng.storage.pages[0]) == 0
    eng.pool.check_invariants()


def _three_stream_step():
    """An engine after three streams decoded three tokens (fp32), its last eager ``(B, T) = (4, 1)`` step (one
    padding row) and the KDA states that step ran on, its inputs still in the buffers."""
    eng = engine(build(), static=True)
    steps = []
    real_forward = StaticDecode.forward

    def keep(self, states):
        steps.append((self, states))
        real_forward(self, states)

    StaticDecode.forward = keep
    try:
        run(eng, prompts([9, 17, 4]), 3)
    finally:
        StaticDecode.forward = real_forward
    step, states = [(s, st) for s, st in steps if (s.B, s.T) == (4, 1)][-1]
    return eng, step, states


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_equals_eager_step(monkeypatch, backend):
    """One step compiled as captured on CUDA against the eager step from the same inputs, states and pool
    (fp32, three streams and one padding row), at its own ``N`` and at ``2N`` (the same rows, their tables
    padded with null block 0), which run the one graph compiled for the first (``N`` symbolic):
    ``aot_eager`` (dynamo's graph through AOT autograd, run as aten ops) and ``inductor`` (its C++ kernels
    here, about a minute of compilation on a 2-core CPU) give the same tokens, and the KDA states and conv windows,
    the written latents and the rest of the pool within fp32 rounding, not bitwise: traced fp32 experts take
    the gathered ``bmm`` instead of CPU ``grouped_mm`` (whose fake implementation takes bf16 only), and
    Inductor fuses the norms' and softmaxes' reductions and sums them in another order; after four layers
    that moves values by a few ulp, far inside ``rtol = 1e-5``. (With every size symbolic, ``dynamic=True``,
    Inductor's code gave other tokens here: ``docs/LOG.md``.)"""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend, **kw))
    eng, step, states = _three_stream_step()
    B, T, N = step.B, step.T, step.N
    wide = eng.runner.decode_graphs.step_for(B, T, 2 * N)
    inputs, table_BN = step.inputs.clone(), step.table_BN.clone()
    before = (eng.storage.pages.clone(), states.recurrent.clone(), states.conv.clone())

    def run_with(s, fn):
        s.inputs.copy_(inputs)
        s.table_BN.copy_(torch.cat([table_BN, torch.zeros_like(table_BN)], 1)[:, : s.N])
        for t, b in zip((eng.storage.pages, states.recurrent, states.conv), before):
            t.copy_(b)
        fn(states)
        return [s.next_B.clone(), eng.storage.pages.clone(), states.recurrent.clone(), states.conv.clone()]

    torch._dynamo.reset()
    counters.clear()
    want = run_with(step, step.forward)
    assert not torch.equal(want[2], before[1])  # the step did update the states
    with compile_settings():
        for s in (step, wide):
            got = run_with(s, s.compiled())
            assert torch.equal(got[0], want[0]), s.N
            for a, b in zip(got[1:], want[1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_steps_of_one_batch_shape_share_one_compiled_graph(monkeypatch):
    """Dynamo's graphs counted (a counting backend, no compilation): the steps of one ``(B, T)`` share one
    graph for every ``N`` (the block table's width is symbolic; the packed inputs of ``(B, T)`` have one size,
    tables last, so no offset or buffer size depends on ``N``), also across the step objects; each other
    ``B`` or ``T`` traces a graph of its own (``B`` and ``T`` stay static: automatic dynamic is off, so a
    second batch size does not turn ``B`` symbolic)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    eng = engine(build(), static=True)
    graphs = eng.runner.decode_graphs
    torch._dynamo.reset()
    counts = {}
    for B, T, N in [(4, 1, 2), (4, 1, 4), (4, 1, 8), (2, 1, 4), (2, 1, 8), (8, 1, 4), (4, 2, 4), (4, 1, 16)]:
        step = graphs.step_for(B, T, N)
        step.inputs.zero_()  # all rows padding
        states = eng.storage.gather_states([graphs.scratch_slot] * B)
        with compile_settings():
            step.compiled()(states)
        counts[(B, T, N)] = counter.frame_count
    assert list(counts.values()) == [1, 1, 1, 2, 2, 3, 4, 4], counts


def compiled_input_mutations(fn, *args) -> list[torch.Tensor]:
    """Compile ``fn`` as a step is compiled (one graph, static shapes) through AOT autograd with the input
    mutations kept in the graph, call it on ``args`` and return the inputs its graph writes: the targets of
    the ``copy_`` epilogue into mutated inputs, what Inductor receives (a write through a view of an input
    shows as a ``copy_`` into the whole input)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    mutated: list[torch.Tensor] = []

    def backend(gm, example_inputs):
        lifted = [*gm.parameters(), *gm.buffers(), *example_inputs]  # the AOT graph's inputs, in order

        def epilogue(aot_gm, aot_inputs):
            placeholders = [n for n in aot_gm.graph.nodes if n.op == "placeholder"]
            assert len(placeholders) == len(lifted)
            for n in aot_gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
                if n.args[0].op == "placeholder":
                    mutated.append(lifted[placeholders.index(n.args[0])])
            return aot_gm

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=epilogue, keep_inference_input_mutations=True
        )

    torch._dynamo.reset()
    with compile_settings():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return mutated


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's address and shape (a view of a buffer differs from the buffer)."""
    return t.data_ptr(), tuple(t.shape)


def test_compiled_step_only_reads_the_pool():
    """What Inductor receives for the compiled :meth:`StaticDecode.sample`: dynamo's graph through AOT autograd
    with the input mutations kept in the graph (the ``copy_`` epilogue into each mutated input). The mutated
    inputs are exactly the KDA recurrent states, the conv windows and the token buffer :attr:`next_B`; the
    block pool is only read, so no torch version's functionalisation can copy it (a write through a view of
    the pool inside the graph becomes an ``index_put`` on a copy of the whole pool and a ``copy_`` back,
    unless Inductor's reinplacing removes them). The eager :meth:`StaticDecode.store_latents` writes it."""
    eng, step, states = _three_stream_step()
    mutated = compiled_input_mutations(step.sample, states)
    want = [states.recurrent, states.conv, step.next_B]
    assert sorted(map(tensor_key, mutated)) == sorted(map(tensor_key, want))
    assert tensor_key(eng.storage.pages) not in map(tensor_key, mutated)


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (a device sync on a GPU, fatal in a capture)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_static_step_reads_nothing_on_the_host(monkeypatch):
    """What a CUDA graph captures must not read device values on the host; the eager twin is the same code.
    (The model's own prefill forward reads some on the CPU, which shows the check sees them.)"""
    model = build()
    with HostReads() as reads, torch.no_grad():
        model(torch.tensor([prompts([5])[0]]))
    assert reads.ops  # input checks and the CPU chunk path read values
    seen: list[list[str]] = []
    real_forward = StaticDecode.forward

    def watched(self, states):
        with HostReads() as reads:
            real_forward(self, states)
        seen.append(reads.ops)

    monkeypatch.setattr(StaticDecode, "forward", watched)
    run(engine(model, static=True), prompts([4, 11]), 6)
    assert len(seen) >= 5 and all(ops == [] for ops in seen)


class HostWaits(TorchFunctionMode):
    """Counts the calls that bring a tensor's values to the host (on a GPU each one waits for the device):
    ``tolist``, ``item``, ``numpy``, ``cpu`` and Python's conversions; not while :attr:`paused`."""

    READS = (
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
    )

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and any(func is r for r in self.READS):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def watch_host_reads_outside(monkeypatch, cls) -> HostWaits:
    """A :class:`HostWaits` whose count leaves out ``cls.forward`` (the static step's own forward: a CUDA graph
    on a GPU, which cannot read the device on the host)."""
    waits = HostWaits()
    real_forward = cls.forward

    def unwatched(self, states):
        waits.paused = True
        try:
            real_forward(self, states)
        finally:
            waits.paused = False

    monkeypatch.setattr(cls, "forward", unwatched)
    return waits


@pytest.mark.parametrize("streams", [1, 5])
def test_steady_decode_step_waits_on_the_device_once(monkeypatch, streams):
    """A steady decode step (schedule, the static step, update) reads device values on the host exactly once:
    the sampled tokens. The step's own forward is left out (a CUDA graph on a GPU, which cannot read any:
    ``test_static_step_reads_nothing_on_the_host``)."""
    waits = watch_host_reads_outside(monkeypatch, StaticDecode)
    eng = engine(build(), static=True)
    reqs = [Request(f"w{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts([5] * streams))]
    for r in reqs:
        eng.add_request(r)
    while min(len(r.output_token_ids) for r in reqs) < 2:
        eng.step()
    per_step = []
    for _ in range(6):
        waits.reads.clear()
        with waits:
            outs = eng.step()
        assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)  # a decode step
        per_step.append(list(waits.reads))
    assert per_step == [["tolist"]] * 6


def test_sampling_a_batch_reads_once_and_draws_as_row_by_row():
    """Greedy and seeded temperature rows in one batch: one host read, and each row's token is what
    ``sample_next`` gives for that row alone (the same generator state, the same order)."""
    logits_BV = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=0.7, top_p=0.8, seed=6),
        SamplingParams(),
    ]
    reqs = [Request(f"x{i}", [1], sp) for i, sp in enumerate(params)]
    expected = [
        int(
            sample_next(logits_BV[i : i + 1], sp.temperature, sp.top_p, Request("y", [1], sp).generator)[0, 0]
        )
        for i, sp in enumerate(params)
    ]
    assert expected[0] == int(logits_BV[0].argmax()) and expected[3] == int(logits_BV[3].argmax())
    with HostWaits() as waits:
        tokens = sample_tokens(reqs, logits_BV)
    assert waits.reads == ["tolist"]
    assert tokens == expected


def test_sampling_and_logprobs_take_the_paged_path():
    model = build()
    eng = engine(model, static=True)
    graphs = eng.runner.decode_graphs
    seeded = Request("s", prompts([5])[0], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    logp = Request("l", prompts([6])[0], SamplingParams(max_tokens=4, logprobs=2))
    eng.generate([seeded, logp])
    assert graphs.steps == {}  # no static step was built
    assert len(seeded.output_token_ids) == 4
    assert logp.output_token_ids == reference(model, logp.prompt_token_ids, 4)


@cuda
@pytest.mark.gpu
def test_graphs_equal_eager_twin_and_reference_on_gpu(monkeypatch):
    """fp32 on the GPU (TF32 off): graph replay == the eager twin == the model's own greedy generation."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = build("cuda")
    ps = prompts([3, 9, 17, 30, 1, 12])
    graphed = engine(model, static=None)
    assert graphed.runner.decode_graphs.capture
    outs, _ = run(graphed, ps, 20)
    twin = engine(model, static=True)
    twin.runner.decode_graphs.capture = False
    eager, _ = run(twin, ps, 20)
    assert outs == eager
    for p, out in zip(ps, outs):
        assert out == reference(model, p, 20)
    assert any(s.graph is not None for s in graphed.runner.decode_graphs.steps.values())
    assert torch.count_nonzero(graphed.storage.pages[0]) == 0


@cuda
@pytest.mark.gpu
def test_graph_engine_load_on_gpu():
    """240 requests of random lengths, at most 32 running at once, bf16 with graphs: every request ends with
    its max_tokens, and the pool ends empty. Blocks of 64 tokens and whole prompts in one chunk keep the
    compiled step shapes few (``N = 2``, decodes of ``T = 1`` and equal-length short prompts): each new
    ``(B, T)`` is one more compilation, 15–20 s on an H200, during which the queue waits: the queue's
    timeout is set past the test's length, since a request shed by it (``finish_reason`` ``"rejected"``, an
    HTTP 429 in the server) would end with no tokens."""
    model = build("cuda", torch.bfloat16)
    eng = engine(
        model, static=None, num_blocks=400, max_num_seqs=32, block_size=64, chunk=64, queue_timeout_s=3600.0
    )
    rng = random.Random(0)
    reqs = [
        Request(
            f"q{i}", prompts([rng.randint(1, 60)], seed=i)[0], SamplingParams(max_tokens=rng.randint(1, 24))
        )
        for i in range(240)
    ]
    pending = list(reqs)
    while pending or eng.has_unfinished_requests():
        while pending and len(eng.scheduler.running) + len(eng.scheduler.waiting) < 32:
            eng.add_request(pending.pop())
        for out in eng.step():
            assert out.error is None and out.finish_reason != "rejected", out
    for r in reqs:
        assert len(r.output_token_ids) == r.sampling_params.max_tokens
    eng.pool.check_invariants()
    assert eng.pool.usage == 0.0


GPU_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profiled_step(eng):
    """One ``eng.step()`` under ``torch.profiler``: (its outputs, the host waits inside it — ``cuda*Synchronize``
    or a blocking ``cudaMemcpy``; an ``.item()`` shows as one of these too —, the names of the device→host
    copies, whether a CUDA graph was launched)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("engine_step"):
            outs = eng.step()
    events = list(prof.events())
    step = next(e for e in events if e.name == "engine_step" and e.device_type == DeviceType.CPU)
    inside = [
        e.name
        for e in events
        if e.device_type == DeviceType.CPU
        and step.time_range.start <= e.time_range.start
        and e.time_range.end <= step.time_range.end
    ]
    d2h = [e.name for e in events if e.device_type == DeviceType.CUDA and "DtoH" in e.name]
    return outs, [n for n in inside if n in GPU_WAITS], d2h, "cudaGraphLaunch" in inside


@cuda
@pytest.mark.gpu
def test_graph_decode_step_waits_once_on_gpu():
    """A steady decode step with CUDA graphs: one host wait and one device→host copy (the tokens)."""
    eng = engine(build("cuda", torch.bfloat16), static=None)
    # the measured step computes positions 6, 11 and 4: no block boundary (no checkpoint copy), and the
    # (B, T, N) = (4, 1, 2) graph the step before captured
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts([4, 9, 2]))]
    for r in reqs:
        eng.add_request(r)
    while min(len(r.output_token_ids) for r in reqs) < 3:  # prefilled, graphs captured
        eng.step()
    outs, waits, d2h, graphed = profiled_step(eng)
    assert len(outs) == 3 and graphed
    assert len(waits) == 1, waits
    assert len(d2h) == 1, d2h


@cuda
@pytest.mark.gpu
def test_prefill_steps_do_not_wait_on_gpu():
    """A prompt prefilled in chunks (a first chunk, chunks continuing the cached prefix, KDA checkpoints
    copied at block boundaries): steps that sample nothing never wait on the device; the one that samples
    waits once, for the token. The same shapes ran once before (kernel compilation, autotuning)."""
    eng = engine(build("cuda", torch.bfloat16), static=None)
    eng.generate([Request("warm", prompts([100], seed=5)[0], SamplingParams(max_tokens=1))])
    request = Request("p", prompts([100], seed=6)[0], SamplingParams(max_tokens=1))
    eng.add_request(request)
    per_step = []
    while eng.has_unfinished_requests():
        _, waits, d2h, _ = profiled_step(eng)
        per_step.append((len(waits), len(d2h)))
    assert eng.kv.num_checkpoints_stored > 0 and len(per_step) >= 3
    assert per_step[:-1] == [(0, 0)] * (len(per_step) - 1), per_step
    assert per_step[-1] == (1, 1), per_step


@cuda
@pytest.mark.gpu
def test_seeded_sampling_on_gpu():
    """A seeded request draws on the GPU with a generator of its own there: the same seed gives the same
    tokens, another seed (almost surely, 16 draws at temperature 2) others; greedy neighbours in the batch
    still equal the reference."""
    model = build("cuda")
    eng = engine(model, static=None)
    p = prompts([6])[0]
    reqs = [
        Request("a", p, SamplingParams(max_tokens=16, temperature=2.0, seed=11)),
        Request("b", p, SamplingParams(max_tokens=16, temperature=2.0, seed=11)),
        Request("c", p, SamplingParams(max_tokens=16, temperature=2.0, seed=12)),
        Request("d", p, SamplingParams(max_tokens=16)),
    ]
    out = eng.generate(reqs)
    assert out["a"] == out["b"] != out["c"]
    assert reqs[0].generator.device.type == "cuda"
    assert out["d"] == reference(model, p, 16)
