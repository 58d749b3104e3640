"""One long sequence on two streams: the backward's token-parallel prepare of the next segment beside the
sequential reverse state pass over the current one.

With a single sequence the state passes have one program per (value block, head): 128 at B1 T32768 H32 D128
on the H200's 132 multiprocessors, each walking 512 chunks (2048 tiles) one after another, so the pass is
bound by the latency of its dependency chain and leaves most of each multiprocessor idle, while the prepare
before it needs nothing from it. :func:`segments` cuts the sequence on the chunk (or tile) grid and
:func:`pipelined` launches segment ``j + 1``'s prepare on a side stream while a high-priority stream runs the
pass over segment ``j``, carrying the fp32 state from one segment's launch to the next (the pass's own
carry, so outputs and states are the same bits as in one launch; tested). Only the backward is cut
(:class:`~openk3.ops.kda.triton.config.PipelineLaunch`): only calls with one sequence (``B = 1``, or one
document in ``cu_seqlens``) on CUDA, since several sequences give the state pass one program per sequence
and head already.

Legend: ``T`` tokens of the sequence, ``size`` tokens per chunk or tile, ``n`` segments.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.ops.kda.triton.chunk_index import ChunkIndex, fixed_length_index
from openk3.ops.kda.triton.config import PipelineLaunch


def side_stream(device: torch.device, *, high_priority: bool = False) -> torch.cuda.Stream:
    """An extra CUDA stream per device (two: default priority, and the device's highest priority), created
    on first use and reused (streams are not freed)."""
    return _side_stream(_device_index(device), high_priority)


def _device_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _side_stream(index: int, high_priority: bool) -> torch.cuda.Stream:
    # CUDA maps a priority beyond the device's range to its highest (lowest number)
    return torch.cuda.Stream(device=index, priority=-100 if high_priority else 0)


def overlaps(device: torch.device, programs: int) -> bool:
    """Whether a state pass of ``programs`` programs on ``device`` leaves room to overlap: CUDA, and at most
    one program per multiprocessor. With more, the pass already shares the GPU among its own programs."""
    return torch.device(device).type == "cuda" and programs <= multiprocessors(device)


def multiprocessors(device: torch.device) -> int:
    """The multiprocessor count of a CUDA ``device``."""
    return _multiprocessors(_device_index(device))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class Segment(NamedTuple):
    """Tokens ``[start, stop)`` of the sequence, its chunks ``[chunk_start, chunk_stop)``, and the chunk
    tables of the segment as a sequence of its own."""

    start: int
    stop: int
    chunk_start: int
    chunk_stop: int
    index: ChunkIndex


def segments(
    index: ChunkIndex, size: int, device: torch.device, programs: int, launch: PipelineLaunch
) -> list[Segment] | None:
    """The segments of a call's single sequence, or None when the call is not cut.

    Args:
        index: the call's chunk tables, in chunks of ``size`` tokens. device: the tensors' device.
        programs: how many programs the state pass runs (one per value block and head).
        launch: the number of pieces and the shortest sequence cut.

    Returns:
        ``launch.segments`` segments (fewer when the chunks run out), each a whole number of chunks, the
        last possibly ending in a partial chunk; None for several sequences, devices without streams or passes
        with more programs than multiprocessors (:func:`overlaps`), a sequence shorter than
        ``launch.min_tokens``, or ``launch.segments < 2``.
    """
    n, T = launch.segments, index.num_tokens
    if n < 2 or index.num_seqs != 1 or T < max(launch.min_tokens, 2 * size) or not overlaps(device, programs):
        return None
    chunks = math.ceil(T / size)
    per = math.ceil(chunks / n)
    out = []
    for c0 in range(0, chunks, per):
        c1 = min(c0 + per, chunks)
        start, stop = c0 * size, min(c1 * size, T)
        out.append(Segment(start, stop, c0, c1, fixed_length_index(1, stop - start, device, size)))
    return out


def segment_of(tensors: NamedTuple, seg: Segment, per_chunk: tuple[str, ...] = ("gend",)) -> NamedTuple:
    """``tensors`` (a NamedTuple of ``[tokens, ...]`` tensors and, for the fields named in ``per_chunk``,
    ``[chunks, ...]`` ones; None fields stay None) restricted to ``seg``: views, no copies."""

    def cut(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t[seg.chunk_start : seg.chunk_stop] if name in per_chunk else t[seg.start : seg.stop]

    return tensors._replace(**{name: cut(name, t) for name, t in tensors._asdict().items()})


def carried_states(
    initial: torch.Tensor | None, count: int, output_final_state: bool, shape: tuple[int, ...], device
) -> list[torch.Tensor | None]:
    """The fp32 states between ``count`` segments, allocated on the current stream: ``initial`` (or None),
    then one uninitialised ``shape`` tensor after each segment (None after the last unless
    ``output_final_state``). Segment ``j`` reads entry ``j`` and writes entry ``j + 1``."""
    new = functools.partial(torch.empty, shape, dtype=torch.float32, device=device)
    return [initial, *(new() for _ in range(count - 1)), new() if output_final_state else None]


def pipelined(
    device: torch.device,
    count: int,
    produce: Callable[[int], None],
    consume: Callable[[int], None],
    side_tail: Callable[[], None] | None = None,
) -> None:
    """Run ``produce(0..count-1)`` in order on :func:`side_stream` and ``consume(0..count-1)`` in order on
    the high-priority one, ``consume(j)`` after ``produce(j)``, so that ``produce(j + 1)`` overlaps
    ``consume(j)``; then ``side_tail()``, if given, after the last ``produce``, beside the remaining
    ``consume`` calls.

    The priority matters: ``produce(j + 1)`` (a prepare of thousands of programs) is queued before
    ``consume(j)`` can start, and the block scheduler would otherwise hand the multiprocessors to its
    waiting programs first, so that ``consume(j)`` would start only as ``produce(j + 1)`` ended.

    ``produce``, ``consume`` and ``side_tail`` must only write tensors allocated before, on the current stream
    (the caching allocator then reuses their memory on that stream as usual, and no ``record_stream`` holds
    it until the end of a CUDA graph capture). Both streams wait for the current stream's work before their
    first launch, and the current stream for all of theirs before this returns. The work runs under
    ``device`` whatever the current device is. On other devices (Triton's interpreter) the same calls run
    one after another.
    """
    if torch.device(device).type != "cuda":  # no streams: the same launches one after another
        for j in range(count):
            produce(j)
            if j == count - 1 and side_tail is not None:
                side_tail()
            consume(j)
        return
    with torch.cuda.device(device):
        main = torch.cuda.current_stream()
        side = side_stream(torch.device(device))
        fast = side_stream(torch.device(device), high_priority=True)
        side.wait_stream(main)
        fast.wait_stream(main)
        ready = [torch.cuda.Event() for _ in range(count)]

        def launch(j: int) -> None:
            with torch.cuda.stream(side):
                produce(j)
                ready[j].record(side)
                if j == count - 1 and side_tail is not None:
                    side_tail()

        launch(0)
        for j in range(count):
            if j + 1 < count:
                launch(j + 1)
            fast.wait_event(ready[j])
            with torch.cuda.stream(fast):
                consume(j)
        main.wait_stream(side)
        main.wait_stream(fast)
