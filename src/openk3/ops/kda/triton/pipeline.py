"""One long sequence on two streams: the token-parallel prepare of the next segment beside the sequential
state pass over the current one.

With a single sequence the state passes have one program per (value block, head): 128 at B1 T32768 H32 D128
on the H200's 132 multiprocessors, each walking 512 chunks (2048 tiles) one after another, so the pass is
bound by the latency of its dependency chain and leaves most of each multiprocessor idle, while the prepare
before it needs nothing from it. :func:`segments` cuts the sequence on the chunk (or tile) grid and
:func:`pipelined` launches segment ``j + 1``'s prepare on a side stream while a high-priority stream runs the
pass over segment ``j``, carrying the fp32 state from one segment's launch to the next (the pass's own
carry, so outputs and states are the same bits as in one launch; tested). By default only the training path
(64-token chunks, forward and backward) is cut (:data:`LAUNCH`).

Legend: ``T`` tokens of the sequence, ``size`` tokens per chunk or tile, ``n`` segments.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.ops.kda.triton.chunk_index import ChunkIndex, fixed_length_index
from openk3.ops.kda.triton.kernel_math import check_launch_entries

LAUNCH = {"segments": 4, "tile_segments": 0, "min_tokens": 16384}
"""``segments``: how many pieces a long single sequence is cut into on the training path (64-token chunks,
forward and backward; ``< 2``: never cut); ``tile_segments``: the same for the 16-token tile forward (calls
without a gradient; ``≥ 2`` also keeps such calls off the pairs of tiles, ``tile_pairs.use_pairs``, which are
never cut); ``min_tokens``: the shortest sequence that is cut. Only calls with one sequence
(``B = 1``, or one document in ``cu_seqlens``) on CUDA are cut; several sequences give the state pass one
program per sequence and head already.

Measured at B1 T32768 H32 D128 on the H200 (docs/LOG.md): forward+
backward 17.97–18.01 ms cut in 4 against 18.46–18.61 uncut (run 9, interleaved in one process after fla's
forward, as ``benchmarks/kda.py`` runs). The tile forward is not cut by default: in that setting it took
3.32–3.38 ms cut in 4 and 3.12–3.27 in 2 against 2.97–3.09 uncut (run 8), although without fla in the
process the cut measured 0.1–0.2 ms faster (runs 3 and 4); its pieces are short, each adds about 0.15 ms
of host time, and under a CUDA graph the cut saved at most 0.28 of 2.77 ms."""


def check_launch() -> None:
    """Raise ``ValueError`` unless :data:`LAUNCH` has exactly its keys (a misspelt one would otherwise be
    ignored) and they hold ints ≥ 0 (:func:`~openk3.ops.kda.triton.kernel_math.check_launch_entries`; checked
    before any work)."""
    check_launch_entries(
        "pipeline", LAUNCH, dict(segments="count", tile_segments="count", min_tokens="count")
    )


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
    one program per multiprocessor. With more, the pass already shares the GPU among its own programs and
    the cut measured slower on the H200 (tile forward at B1 T8192 H96 D128, 384 programs: 1.78–1.84 ms cut
    in 2 or 4 against 1.68–1.71 uncut; docs/LOG.md)."""
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
    index: ChunkIndex, size: int, device: torch.device, programs: int, key: str = "segments"
) -> list[Segment] | None:
    """The segments of a call's single sequence, or None when the call is not cut (:data:`LAUNCH`).

    Args:
        index: the call's chunk tables, in chunks of ``size`` tokens. device: the tensors' device.
        programs: how many programs the state pass runs (one per value block and head).
        key: the :data:`LAUNCH` entry that gives the number of pieces (``"segments"`` or
            ``"tile_segments"``).

    Returns:
        ``LAUNCH[key]`` segments (fewer when the chunks run out), each a whole number of chunks, the
        last possibly ending in a partial chunk; None for several sequences, devices without streams or passes
        with more programs than multiprocessors (:func:`overlaps`), a sequence shorter than
        ``LAUNCH["min_tokens"]``, or ``LAUNCH[key] < 2``.
    """
    check_launch()
    n, T = LAUNCH[key], index.num_tokens
    if (
        n < 2
        or index.num_seqs != 1
        or T < max(LAUNCH["min_tokens"], 2 * size)
        or not overlaps(device, programs)
    ):
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
    waiting programs first, so that ``consume(j)`` started only as ``produce(j + 1)`` ended (measured on the
    H200: no gain at all with ``consume`` on the current stream).

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


def forward_segments(
    segs: list[Segment],
    device: torch.device,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    state_shape: tuple[int, ...],
    prepare: Callable[[Segment], None],
    state_pass: Callable[[Segment, torch.Tensor | None, torch.Tensor | None], None],
) -> torch.Tensor | None:
    """A forward over ``segs`` in order: ``prepare(seg)`` on the side stream, ``state_pass(seg, h_in,
    h_out)`` after it on the high-priority one (:func:`pipelined`), reading the fp32 state ``h_in`` the
    segment before wrote (``initial_state`` for the first, None for zeros) and writing ``h_out`` (None after
    the last unless ``output_final_state``; :func:`carried_states`, ``state_shape``).

    Returns:
        the final state, or None without ``output_final_state``.
    """
    states = carried_states(initial_state, len(segs), output_final_state, state_shape, device)
    pipelined(
        device, len(segs), lambda j: prepare(segs[j]), lambda j: state_pass(segs[j], states[j], states[j + 1])
    )
    return states[-1]
