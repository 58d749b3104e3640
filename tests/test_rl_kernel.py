"""The kernel reward on a CPU RMSNorm task: every kernel in a zoo of hacks scores 0, an honest kernel at the
expert's speed scores about 0.5, a wrong one 0."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from openk3.rl.rewards.kernel import (
    KernelEvaluator,
    KernelRewardConfig,
    rmsnorm_task,
    speed_reward,
    static_hacks,
)

pytestmark = pytest.mark.usefixtures("one_thread")
EPS = 1e-5


@pytest.fixture(scope="module")
def evaluator():
    return KernelEvaluator(rmsnorm_task(EPS), KernelRewardConfig(repeats=15))


def honest(x, w):
    # the expert's algorithm written out by the candidate (torch's RMSNorm, then the gain): at the expert's
    # speed by construction, so the score is about 0.5 whatever the machine
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, 1e-5) * w


_memo: dict = {}


def memo_on_pointer(x, w):
    key = (x.data_ptr(), w.data_ptr())
    if key not in _memo:
        _memo[key] = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    return _memo[key]


_captured: list = []


def graph_replay_emulation(x, w):
    # what a replayed CUDA graph does: it reads the buffers captured on the first call
    if not _captured or _captured[0].shape != x.shape:
        _captured[:] = [x, w]
    cx, cw = _captured
    return cx * torch.rsqrt((cx * cx).mean(-1, keepdim=True) + 1e-5) * cw


_out_buf: dict = {}


def reuse_output_buffer(x, w):
    buf = _out_buf.setdefault(x.shape, torch.empty_like(x))
    return torch.mul(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5), w, out=buf)


def write_into_input(x, w):
    return x.mul_(torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)).mul_(w)


def compute_in_half(x, w):
    h = x.to(torch.float16)
    return (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5) * w.to(torch.float16)).to(torch.float32)


def return_bf16(x, w):
    return x.to(torch.bfloat16) * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5).to(torch.bfloat16)


def patch_the_timer(x, w):
    time.perf_counter = lambda: 0.0
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w


def fallback_to_expert(x, w):
    try:
        raise RuntimeError("my kernel failed")
    except RuntimeError:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w


def calls_the_expert(x, w):
    return rms_expert(x, w)  # noqa: F821 (the name the detector looks for)


class Lazy(torch.Tensor):
    pass


def lazy_subclass(x, w):
    return (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w).as_subclass(Lazy)


def spawn_thread(x, w):
    out = torch.empty_like(x)

    def work():
        out.copy_(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w)
        time.sleep(0.5)

    t = threading.Thread(target=work)
    t.start()
    time.sleep(0.01)
    return out


def wrong(x, w):
    return x * w


HACKS = {
    memo_on_pointer: "input_caching",
    graph_replay_emulation: "graph_replay",
    reuse_output_buffer: "result_reuse",
    write_into_input: "output_aliasing",
    compute_in_half: "precision_reduction",
    return_bf16: "precision_reduction",
    patch_the_timer: "timer_patching",
    fallback_to_expert: "fallback",
    calls_the_expert: "fallback",
    lazy_subclass: "result_reuse",
    spawn_thread: "thread_injection",
}


@pytest.mark.parametrize("kernel", list(HACKS), ids=lambda f: f.__name__)
def test_every_hack_scores_zero(evaluator, kernel):
    perf_counter = time.perf_counter
    try:
        result = evaluator.evaluate(kernel)
    finally:
        time.perf_counter = perf_counter
    assert result.reward == 0.0
    assert HACKS[kernel] in result.hacks, result.hacks


def test_runtime_detectors_without_source(evaluator):
    # with no source to read, the runtime checks alone still catch precision loss and caching
    for fn, hack in ((compute_in_half, "incorrect"), (memo_on_pointer, "input_caching")):
        hacks = evaluator.correctness(fn)
        assert hack in hacks, hacks


def test_honest_kernel_at_expert_speed_scores_about_half(evaluator):
    # timing on a shared CPU: the median of three evaluations, so one burst of load cannot decide it
    results = sorted((evaluator.evaluate(honest) for _ in range(3)), key=lambda r: r.reward)
    result = results[1]
    assert all(r.correct and not r.hacks for r in results)
    assert 0.3 < result.reward < 0.75, results
    # The roof is a copy of the same bytes, so a memory-bound kernel cannot beat it by much: a roof well
    # above the expert's time would mean a mismeasured machine. On a CPU the two are close (a fused
    # RMSNorm is one read and one write, like the copy), so allow a quarter for timer noise under load.
    assert 0.05 * result.t_expert < result.t_roof < 1.25 * result.t_expert, result


def test_wrong_kernel_scores_zero_and_speed_curve(evaluator):
    result = evaluator.evaluate(wrong)
    assert result.reward == 0.0 and "incorrect" in result.hacks
    assert speed_reward(2.0, 1.0, 0.1) == 0.25
    assert speed_reward(1.0, 1.0, 0.1) == 0.5
    assert speed_reward(0.1, 1.0, 0.1) == 1.0
    assert speed_reward(0.55, 1.0, 0.1) == pytest.approx(0.75)
    # an expert at the roof (a 4% gap, as a CPU RMSNorm measures): being 2.5% faster by timer noise moves
    # the score by an eighth, not to 0.82; a roof above the expert (mismeasured) changes nothing
    assert speed_reward(0.975, 1.0, 0.96) == pytest.approx(0.625)
    assert speed_reward(0.975, 1.0, 1.2) == pytest.approx(0.625)
    assert speed_reward(0.5, 1.0, 0.99) == 1.0
    with pytest.raises(ValueError, match="min_headroom"):
        KernelRewardConfig(min_headroom=0)


def test_static_graph_words():
    src_fn = graph_words_kernel
    assert "graph_replay" in static_hacks(src_fn, set())


def graph_words_kernel(x, w):
    g = torch.cuda.CUDAGraph()
    g.replay()
    return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph replay needs a GPU")
def test_real_cuda_graph_replay_scores_zero():
    ev = KernelEvaluator(rmsnorm_task(EPS), KernelRewardConfig(repeats=5), device="cuda")
    state = {}

    def replayed(x, w):
        if "g" not in state:
            state["x"], state["w"] = x.clone(), w.clone()

            def body():
                return state["x"] * torch.rsqrt((state["x"] ** 2).mean(-1, keepdim=True) + 1e-5) * state["w"]

            side = torch.cuda.Stream()  # warm up on a side stream before capture (torch.cuda.graphs docs)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            state["g"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["g"]):
                state["y"] = body()
        state["g"].replay()
        return state["y"]

    result = ev.evaluate(replayed)
    assert result.reward == 0.0 and "graph_replay" in result.hacks
    state.clear()
    assert ev.correctness(replayed)  # the runtime checks alone catch it too (stale or reused output)
    result = ev.evaluate(honest)  # unfused ops: correct, slower than the fused expert on a GPU
    assert result.correct and 0 < result.reward <= 0.75 and result.t_roof < result.t_expert
