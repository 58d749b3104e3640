"""The kernel reward: correctness gate, speed against an expert and the roofline, and hack detectors that
force the reward to 0. It assumes the candidate will cheat.

Reward (a design; no public formula anchors the shape between the two points Kimi K3 names):

    t ≥ t_e:          r = 0.5 · t_e / t                          (matching the expert scores 0.5)
    t < t_e:          r = min(1, 0.5 + 0.5 · (t_e − t) / d),  d = max(t_e − t_roof, h · t_e)

The headroom floor ``h`` (``min_headroom``, 0.1) keeps the score stable where the expert already runs at
the roof: with ``t_e − t_roof`` a few percent of ``t_e``, timer noise alone would move a candidate as fast
as the expert across most of (0.5, 1]. A candidate scores 1 at the roofline, or, when the roof lies within
``h · t_e`` of the expert's time, at ``(1 − h) · t_e``; a roof measured above the expert's time (a
mismeasured machine) needs no special case.

``t`` and ``t_e`` are median wall times of the candidate and the expert on the same inputs; ``t_roof =
max(bytes / bandwidth, flops / peak)`` with bandwidth and peak FLOP/s measured on this machine
(:func:`measure_machine`: a copy of the task's working set and a matmul).

Correctness (KernelBench ``eval_kernel_against_ref``): fresh random inputs every trial, several shapes, a
float64 reference; the candidate's error against it may not exceed ``error_factor`` × the expert's error
(+ ``atol``); a trial with inputs spanning a wide dynamic range exposes precision reduction.

Detectors (KernelBench ``kernel_static_checker.py`` and its adversarial tests; Wafer's reward-hacks field
guide; DeepReinforce "Hacks and defenses"), each forcing 0:

* ``graph_replay`` — source names CUDA graphs (``CUDAGraph``, ``torch.cuda.graph``, ``.replay(``), or the
  output does not follow **new input buffers** (a replayed graph reads the buffers it captured);
* ``input_caching`` — the output does not follow **new values written into the same buffers** (memoising on
  ``data_ptr``/``id``/shape);
* ``result_reuse`` — two calls return the same storage, or the output is not a fresh plain ``torch.Tensor``
  (a lazy subclass);
* ``output_aliasing`` — the output shares storage with an input;
* ``precision_reduction`` — wrong output dtype, a downcast in the source (``.half()``, ``float16``,
  ``bfloat16``), or error above the bound;
* ``timer_patching`` — the timing functions (``time.perf_counter``, ``torch.cuda.synchronize``,
  ``torch.cuda.Event``) are not the same objects after a call, or the source assigns to them;
* ``thread_injection`` — more live threads after a call than before;
* ``fallback`` — the source holds ``try``/``except`` or calls the expert or the reference by name;
* ``nondeterminism`` — two calls on the same inputs differ.

Timing synchronises the device before reading the clock (on CUDA ``torch.cuda.synchronize()`` waits for every
stream of the device), warms up, and takes the median of ``repeats``. The same code runs on CUDA tensors.
"""

from __future__ import annotations

import ast
import inspect
import statistics
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

_PERF_COUNTER = time.perf_counter
"""The clock captured at import: a candidate that patches ``time.perf_counter`` cannot change it."""


@dataclass(frozen=True)
class KernelTask:
    """A kernel problem: how to make inputs, the float64 reference, the expert, and its cost."""

    name: str
    make_inputs: Callable[[tuple[int, ...], torch.Generator, torch.device, float], tuple[torch.Tensor, ...]]
    """``(shape, generator, device, scale) → inputs`` (float32); ``scale`` widens the dynamic range."""
    reference: Callable[..., torch.Tensor]
    """Computes the exact result; called on float64 copies of the inputs."""
    expert: Callable[..., torch.Tensor]
    """The fast honest implementation the reward anchors at 0.5."""
    bytes_moved: Callable[[tuple[int, ...]], float]
    flops: Callable[[tuple[int, ...]], float]
    shapes: tuple[tuple[int, ...], ...]
    timing_shape: tuple[int, ...]


@dataclass(frozen=True)
class KernelRewardConfig:
    trials: int = 3
    """Correctness trials per shape, each with fresh inputs."""
    wide_range_scale: float = 1e4
    """Input scale of the extra dynamic-range trial."""
    error_factor: float = 8.0
    atol: float = 1e-6
    warmup: int = 2
    repeats: int = 9
    min_headroom: float = 0.1
    """Least gap between the expert's time and the roof, as a share of the expert's time (``h`` above)."""

    def __post_init__(self) -> None:
        for name in ("trials", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not (self.error_factor >= 1 and self.atol >= 0 and self.wide_range_scale > 0):
            raise ValueError("error_factor must be >= 1, atol >= 0 and wide_range_scale > 0")
        if not 0 < self.min_headroom <= 1:
            raise ValueError(f"min_headroom must be in (0, 1], got {self.min_headroom}")


@dataclass(frozen=True)
class Machine:
    bandwidth: float
    """Bytes per second of a large copy."""
    peak_flops: float
    """FLOP/s of a large float32 matmul."""


@dataclass
class KernelResult:
    reward: float
    correct: bool
    hacks: list[str] = field(default_factory=list)
    t_candidate: float | None = None
    t_expert: float | None = None
    t_roof: float | None = None
    detail: str = ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_machine(
    device: torch.device, copy_bytes: float, matmul_n: int = 512, repeats: int = 20
) -> Machine:
    """Bandwidth (a copy reading and writing ``copy_bytes`` in all: the task's own working set, so the
    cache level it fits in sets the roof) and FLOP/s (an ``n×n`` float32 matmul), best of ``repeats``
    after one untimed round (the destination's first touch pays its page faults). The minimum, not the
    median: noise from other processes only ever slows a copy down."""
    src = torch.empty(max(1, int(copy_bytes // 8)), device=device).uniform_()
    dst = torch.empty_like(src)
    a = torch.randn(matmul_n, matmul_n, device=device)
    dst.copy_(src)
    torch.mm(a, a)
    copies, mms = [], []
    for _ in range(repeats):
        synchronize(device)
        t0 = _PERF_COUNTER()
        dst.copy_(src)
        synchronize(device)
        copies.append(_PERF_COUNTER() - t0)
        t0 = _PERF_COUNTER()
        torch.mm(a, a)
        synchronize(device)
        mms.append(_PERF_COUNTER() - t0)
    return Machine(2 * src.numel() * 4 / min(copies), 2 * matmul_n**3 / min(mms))


def speed_reward(t: float, t_expert: float, t_roof: float, min_headroom: float = 0.1) -> float:
    """The piecewise score above; the gap from the expert to the roof counts as at least
    ``min_headroom · t_expert``."""
    if t >= t_expert:
        return 0.5 * t_expert / t
    headroom = max(t_expert - t_roof, min_headroom * t_expert)
    return min(1.0, 0.5 + 0.5 * (t_expert - t) / headroom)


# ---- static checks ---------------------------------------------------------------------------------------
_GRAPH_WORDS = ("CUDAGraph", "cuda.graph", "make_graphed_callables", ".replay(")
_DOWNCAST_WORDS = (".half()", "float16", "bfloat16", ".bfloat16()", "float8")
_TIMER_NAMES = {"perf_counter", "time", "synchronize", "elapsed_time", "record", "Event", "monotonic"}


def _source(fn: Callable) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def static_hacks(fn: Callable, forbidden_names: set[str]) -> list[str]:
    """Hacks visible in the candidate's source (empty source: none found statically)."""
    src = _source(fn)
    if not src:
        return []
    found = []
    if any(w in src for w in _GRAPH_WORDS):
        found.append("graph_replay")
    if any(w in src for w in _DOWNCAST_WORDS):
        found.append("precision_reduction")
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return found + ["unparseable"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            found.append("fallback")
        if isinstance(node, ast.Name) and node.id in forbidden_names:
            found.append("fallback")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in _TIMER_NAMES:
                    found.append("timer_patching")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {"Thread", "Process", "submit"}:
            found.append("thread_injection")
    return sorted(set(found))


# ---- runtime checks --------------------------------------------------------------------------------------
def _timers() -> tuple:
    cuda = torch.cuda
    return (
        time.perf_counter,
        time.time,
        cuda.synchronize,
        cuda.Event,
        getattr(cuda.Event, "elapsed_time", None),
    )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


class KernelEvaluator:
    """Scores candidates for one task on one device; measures the machine once."""

    def __init__(
        self, task: KernelTask, config: KernelRewardConfig, device: torch.device | str = "cpu"
    ) -> None:
        self.task, self.config, self.device = task, config, torch.device(device)
        self.machine = measure_machine(self.device, task.bytes_moved(task.timing_shape))
        self.seed = 0

    def _inputs(self, shape, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        self.seed += 1  # fresh inputs every trial
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        return self.task.make_inputs(shape, g, self.device, scale)

    def _call(self, fn, inputs, hacks: list[str]) -> torch.Tensor | None:
        timers, threads = _timers(), threading.active_count()
        try:
            out = fn(*inputs)
        except Exception as e:  # a crashing candidate is incorrect, never an evaluator failure
            hacks.append(f"error: {type(e).__name__}: {e}")
            return None
        synchronize(self.device)
        if _timers() != timers:
            hacks.append("timer_patching")
        if threading.active_count() > threads:
            hacks.append("thread_injection")
        return out

    def _check(self, fn, inputs, exact, expert_err, hacks: list[str]) -> torch.Tensor | None:
        out = self._call(fn, inputs, hacks)
        if out is None:
            return None
        if type(out) is not torch.Tensor:
            hacks.append("result_reuse")
            return None
        if out.dtype != inputs[0].dtype or out.shape != exact.shape:
            hacks.append("precision_reduction" if out.shape == exact.shape else "wrong_shape")
            return None
        if any(_storage(out) == _storage(x) for x in inputs):
            hacks.append("output_aliasing")
        if (
            not torch.isfinite(out).all()
            or _error(out, exact) > self.config.error_factor * expert_err + self.config.atol
        ):
            hacks.append("incorrect")
        return out

    def correctness(self, fn: Callable) -> list[str]:
        """Runtime detector findings (empty: correct and no hack seen)."""
        task, cfg, hacks = self.task, self.config, []
        for shape in task.shapes:
            for trial in range(cfg.trials + 1):
                scale = cfg.wide_range_scale if trial == cfg.trials else 1.0
                inputs = self._inputs(shape, scale)
                out = self._check(fn, inputs, *self._exact(inputs), hacks)  # candidate first, then the expert
                if out is None:
                    return hacks
                again = self._call(fn, inputs, hacks)
                if again is None:
                    return hacks
                if type(again) is torch.Tensor and _storage(again) == _storage(out):
                    hacks.append("result_reuse")
                elif not torch.equal(again, out):
                    hacks.append("nondeterminism")
            # same buffers, new values: a memo keyed on the buffer or shape returns the old result
            inputs = self._inputs(shape)
            self._call(fn, inputs, hacks)
            fresh = self._inputs(shape)
            for x, y in zip(inputs, fresh):
                x.copy_(y)
            exact, expert_err = self._exact(inputs)
            out = self._call(fn, inputs, hacks)
            if out is not None and _error(out, exact) > cfg.error_factor * expert_err + cfg.atol:
                hacks.append("input_caching")
            # new buffers with the first buffers' old values kept alive: a replayed graph reads the old ones
            first = self._inputs(shape)
            self._call(fn, first, hacks)
            second = self._inputs(shape)
            exact, expert_err = self._exact(second)
            out = self._call(fn, second, hacks)
            if out is not None and _error(out, exact) > cfg.error_factor * expert_err + cfg.atol:
                hacks.append("graph_replay")
        return hacks

    def _exact(self, inputs) -> tuple[torch.Tensor, float]:
        exact = self.task.reference(*[x.double() for x in inputs])
        expert_err = _error(self.task.expert(*inputs), exact)
        return exact, expert_err

    def time(self, fns: Sequence[Callable], inputs) -> list[float]:
        """Median seconds of each ``fn(*inputs)``, the device synchronised around each call. The functions
        take turns call by call, so a burst of load from other processes slows all of them alike and their
        ratio (which the reward is made of) holds."""
        for _ in range(self.config.warmup):
            for fn in fns:
                fn(*inputs)
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(self.config.repeats):
            for fn, ts in zip(fns, times):
                synchronize(self.device)
                t0 = _PERF_COUNTER()
                fn(*inputs)
                synchronize(self.device)
                ts.append(_PERF_COUNTER() - t0)
        return [statistics.median(ts) for ts in times]

    def roofline(self, shape) -> float:
        return max(
            self.task.bytes_moved(shape) / self.machine.bandwidth,
            self.task.flops(shape) / self.machine.peak_flops,
        )

    def evaluate(self, fn: Callable) -> KernelResult:
        """The reward of candidate ``fn``: 0 if any detector fires or the output is wrong, else the speed score."""
        forbidden = {self.task.reference.__name__, self.task.expert.__name__}
        hacks = static_hacks(fn, forbidden)
        if hacks:
            return KernelResult(0.0, False, hacks, detail="static")
        hacks = self.correctness(fn)
        if hacks:
            return KernelResult(0.0, "incorrect" not in hacks, sorted(set(hacks)), detail="runtime")
        inputs = self._inputs(self.task.timing_shape)
        t, t_e = self.time((fn, self.task.expert), inputs)
        t_roof = self.roofline(self.task.timing_shape)
        return KernelResult(speed_reward(t, t_e, t_roof, self.config.min_headroom), True, [], t, t_e, t_roof)


# ---- a CPU-sized task: RMSNorm with openk3's op as the expert ---------------------------------------------
def rmsnorm_task(eps: float = 1e-5) -> KernelTask:
    """``y = x · rsqrt(mean(x², −1) + eps) ⊙ w`` over rows of ``x`` [N, D]; expert: openk3's ``rms_normalize``."""
    from openk3.model.norm import rms_normalize

    def make_inputs(shape, g, device, scale):
        x = torch.randn(shape, generator=g, device=device) * scale
        w = torch.rand(shape[-1], generator=g, device=device) + 0.5
        return x, w

    def rms_reference(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rms_expert(x, w):
        return rms_normalize(x, eps) * w

    def bytes_moved(shape):
        n = 1
        for s in shape:
            n *= s
        return 4.0 * (2 * n + shape[-1])

    def flops(shape):
        n = 1
        for s in shape:
            n *= s
        return 4.0 * n

    return KernelTask(
        "rmsnorm",
        make_inputs,
        rms_reference,
        rms_expert,
        bytes_moved,
        flops,
        ((7, 33), (64, 256)),
        (512, 1024),
    )
