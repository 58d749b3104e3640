"""Where one training step's time goes: a ``torch.profiler`` trace of the step, summarised per phase.

:func:`profile_step` runs ``step(mark)`` once under the profiler, where ``mark(name)`` starts phase ``name``
(``"forward"``, ``"backward"``, ... as :func:`openk3.train.step.accumulate_gradients` marks them; a name met
again adds to the same phase; ``"end"`` ends the last one). At the end of every phase the device is
synchronised, so a phase's kernels run inside its wall-clock window and can be attributed to it; this costs
the step its overlap between phases, so the profiled step is a little slower than a timed one. Per phase
(:class:`PhaseProfile`):

* ``wall_s``: host wall time of the phase (device synchronised at both ends);
* ``busy_s``: time the device ran at least one kernel or copy in the window (union of their intervals);
  ``busy_s / wall_s`` far below 1 means the device waited on the host (launch overhead, host work, syncs);
* ``kernels``: device kernels run; ``launches``: CUDA runtime launch calls made by the host (kernels, copies,
  memsets, graph launches); ``syncs``: host waits on the device made by the step itself (stream, event and
  device synchronisations and blocking copies; the boundary synchronisations are not counted).

Over the whole step: the kernels that took most device time (:attr:`StepProfile.top_kernels`). On the CPU
there is no device activity: the outermost ``aten::`` operators (those not called by another one) stand in
for kernels and launches, and ``busy_s`` is their total time.

Legend: none (no tensors).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
        "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
    }
)  # fmt: skip
"""CUDA runtime/driver calls that put work on a stream."""
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemset"}
)
"""CUDA runtime calls that make the host wait for the device."""
BOUNDARY = "phase boundary (device synchronise)"


@dataclass
class PhaseProfile:
    """One phase of a profiled step (module docstring); times in seconds."""

    name: str
    wall_s: float = 0.0
    busy_s: float = 0.0
    kernels: int = 0
    launches: int = 0
    syncs: int = 0


@dataclass
class StepProfile:
    """A profiled step: its phases in order, and ``top_kernels`` as ``(name, count, seconds)``, most device
    time first; ``device`` is ``"cuda"`` or ``"cpu"``."""

    device: str
    phases: list[PhaseProfile]
    top_kernels: list[tuple[str, int, float]] = field(default_factory=list)

    def total(self) -> PhaseProfile:
        """The sums over the phases (name ``"step"``)."""
        out = PhaseProfile("step")
        for p in self.phases:
            for key in ("wall_s", "busy_s", "kernels", "launches", "syncs"):
                setattr(out, key, getattr(out, key) + getattr(p, key))
        return out

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "phases": [asdict(p) for p in self.phases],
            "top_kernels": [list(k) for k in self.top_kernels],
        }

    def markdown(self, top: int = 15) -> list[str]:
        """A phase table and a top-kernel table as Markdown lines."""
        kernel = "kernels" if self.device == "cuda" else "aten ops"
        lines = [
            f"| phase | wall ms | device busy ms | busy share | {kernel} | launches | host syncs |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in [*self.phases, self.total()]:
            share = p.busy_s / p.wall_s if p.wall_s else 0.0
            lines.append(
                f"| {p.name} | {p.wall_s * 1e3:,.1f} | {p.busy_s * 1e3:,.1f} | {share * 100:.0f}% | "
                f"{p.kernels:,} | {p.launches:,} | {p.syncs} |"
            )
        busy = sum(s for _, _, s in self.top_kernels) or 1.0
        lines += ["", f"| top {kernel} by device time | count | ms | share of listed |", "|---|---|---|---|"]
        for name, count, seconds in self.top_kernels[:top]:
            short = name if len(name) <= 90 else name[:87] + "..."
            lines.append(f"| `{short}` | {count:,} | {seconds * 1e3:,.2f} | {seconds / busy * 100:.1f}% |")
        return lines


class _Marks:
    """``mark(name)``: synchronise the device inside the open phase (so its kernels finish inside its window),
    close it, open phase ``name`` (``"end"`` opens none)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.open = None

    def __call__(self, name: str) -> None:
        self.finish()
        if name != "end":
            self.open = torch.profiler.record_function(f"phase:{name}")
            self.open.__enter__()

    def finish(self) -> None:
        with torch.profiler.record_function(BOUNDARY):
            if self.cuda:
                torch.cuda.synchronize()
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None


def profile_step(step: Callable[[Callable[[str], None]], object], device: torch.device) -> StepProfile:
    """Run ``step(mark)`` once under ``torch.profiler`` and summarise it (module docstring). ``step`` calls
    ``mark(name)`` when each phase starts; the last phase ends when ``step`` returns."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    marks = _Marks(device)
    with profile(activities=activities) as prof:
        step(marks)
        marks.finish()
    return summarize(prof.events(), cuda)


def _is_device(event) -> bool:
    return "CUDA" in str(getattr(event, "device_type", ""))


def annotation_names(events) -> set[str]:
    """Names of the host ranges the profiler mirrors on the device timeline.

    Every user annotation on the host (a ``record_function`` range: ``phase:*``, ``Optimizer.step#…``, a
    compiled region's marker) reappears as a "GPU user annotation" spanning the kernels launched inside it:
    a device event that is not a kernel. Host *operators* are not mirrored, and Inductor opens a host range
    named after each Triton kernel it launches (``triton_poi_fused_…``, an operator-kind range) whose kernel
    then carries the same name: matching device events against every host name, as this summary once did,
    dropped all of Inductor's kernels from the counts. So only the host events flagged as user annotations
    count; a torch whose events lack the flag falls back to every host name but Inductor's kernel ranges."""
    names = set()
    for e in events:
        if _is_device(e):
            continue
        flag = getattr(e, "is_user_annotation", None)
        if flag or (flag is None and not e.name.startswith("triton_")):
            names.add(e.name)
    return names


def is_device_annotation(event, mirrored: set[str]) -> bool:
    """Whether a device event is the mirror of a host range (:func:`annotation_names`), not a kernel or copy."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name in mirrored


def _under_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(events, cuda: bool) -> StepProfile:
    """A :class:`StepProfile` from the events of a trace made by :func:`profile_step`."""
    windows = [(e.name.removeprefix("phase:"), e.time_range.start, e.time_range.end)
               for e in events if e.name.startswith("phase:") and not _is_device(e)]  # fmt: skip
    boundaries = [(e.time_range.start, e.time_range.end) for e in events if e.name == BOUNDARY]
    phases: dict[str, PhaseProfile] = {}
    for name, start, end in windows:
        phases.setdefault(name, PhaseProfile(name)).wall_s += (end - start) / 1e6

    def phase_of(t: float) -> PhaseProfile | None:
        for name, start, end in windows:
            if start <= t <= end:
                return phases[name]
        return None

    busy: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    mirrored = annotation_names(events)
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if cuda and _is_device(e):
            if is_device_annotation(e, mirrored):
                continue
            kind = "kernel"
        elif not cuda and e.name.startswith("aten::") and not _under_aten(e):
            kind = "op"
        elif e.name in LAUNCH_CALLS or e.name in SYNC_CALLS:
            kind = "runtime"
        else:
            continue
        phase = phase_of(start)
        if phase is None:
            continue
        if kind == "runtime":
            if e.name in LAUNCH_CALLS:
                phase.launches += 1
            elif not any(a <= start <= b for a, b in boundaries):
                phase.syncs += 1
            continue
        phase.kernels += 1
        phase.launches += 0 if cuda else 1
        busy[phase.name].append((start, end))
        per_kernel[e.name].append((end - start) / 1e6)
    for name, intervals in busy.items():
        phases[name].busy_s = _union(intervals) / 1e6
    top = sorted(((n, len(d), sum(d)) for n, d in per_kernel.items()), key=lambda k: -k[2])
    return StepProfile("cuda" if cuda else "cpu", list(phases.values()), top)
