"""The decode step at static shapes, captured in CUDA graphs (as gpt-fast and vLLM do,
``docs/references.md#serving-at-the-speed-of-the-gpu``): a batch of decodes (or
of short chunks of ``T ≤ 16`` tokens each: a prefix hit's suffix) runs as one graph
replay, greedy tokens chosen on the device and read back once per step.

A step of ``n`` requests with ``T`` tokens each is padded to a **bucket** ``B`` (a power of two ≥ ``n``) and
its cached lengths to ``N`` blocks (a power of two covering the longest request, at least 2); each
``(B, T, N)`` gets its own :class:`StaticDecode`: fixed input buffers (token ids, cached lengths, a valid
flag, block tables), and one forward of the model on paged caches built from them inside the step, with no
host data and no host sync. The steps of one ``(B, T)`` share one packed int64 input buffer
(:func:`packed_inputs`), its tables sized for the longest request and placed last, so a step's inputs are
views at offsets that depend on ``B`` and ``T`` only:

* KDA: the states of the ``B`` slots are checked out into the storage's workspace
  (:meth:`~openk3.serve.cache_storage.CacheStorage.gather_states`), whose address is fixed for a given ``B``
  (the workspace is sized for the largest bucket once, and a graph is captured again should it move); padding
  rows use a scratch state slot outside the block pool;
* MLA: each layer reads the block pool in place through the block tables and the rows' cached lengths
  (:class:`~openk3.model.cache.PagedPool`, :func:`openk3.ops.mla.paged_latent_attention`: on CUDA a Triton
  kernel that stops at each row's length), the new latent of position ``p`` written at ``table[p // bs]``,
  offset ``p % bs``; a padding row (length 0) writes back the value it read at null block 0, so block 0 stays
  zero;
* the last position's logits' argmax (below ``sample_vocab_size``) lands in a fixed buffer; the host reads the
  ``n`` real rows once (``tolist``: one device→host copy, the step's only host wait), and not at all when no
  chunk samples (a prefill chunk before the prompt's end). The inputs go the other way from a persistent
  pageable host buffer with a non-blocking copy: CUDA stages the bytes before the call returns and waits for
  nothing, so the buffer may be rewritten for the next step at once.

On CUDA the step is compiled once per ``(B, T)``, captured once per ``(B, T, N)`` and replayed; elsewhere
:meth:`StaticDecode.forward` runs eagerly: the twin the CPU tests compare with the model and the engine's
other path. Captured eagerly, a step is thousands of tiny kernels (elementwise ops, casts, norms, copies)
whose launches, not their work, set its time; so what is captured is :meth:`StaticDecode.sample` (the step up
to the pool write) through ``torch.compile`` (Inductor, ``fullgraph``, no Inductor CUDA graphs of its own;
every size static but ``N``: :meth:`StaticDecode.compiled`), which fuses that glue (norms, gates, SiTU,
routing, the AttnRes mixes, casts) into a few hundred kernels around the matmuls and the KDA state-pool op (a
custom op, ``openk3::kda_pool_decode``, so the trace runs through it), then
:meth:`StaticDecode.store_latents`, the one ``index_put_`` of the new latents into the pool, eagerly in the
same graph. The compiled region only reads the pool: an in-place write through a view of a graph input can be
functionalised into a copy of the whole pool (gigabytes) and back. It mutates only the KDA states (in place,
through the custom op), the conv windows and :attr:`StaticDecode.next_B`. The first of two warm-up runs on a
side stream (all rows padding, so no request's state or latent changes) compiles, when no other ``N`` of the
same ``(B, T)`` did; its wall time goes to stderr. The step has no graph break: no host reads, no Python
branch on a tensor value, no data-dependent shape. A subclass changes the step through
:meth:`StaticDecode.sample` and is compiled the same way (the speculative step,
:mod:`openk3.serve.speculative_graph`).

Legend: ``n`` requests, ``B`` bucket rows, ``T`` new tokens per row, ``N`` blocks per row, ``S = N·bs`` cached tokens, ``V`` vocabulary,
``L`` MLA layers, ``W = C + r`` latent width.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from openk3.model.cache import KDAStateSlots, KimiCache, PagedPool
from openk3.model.mla import ABSORB_MAX_TOKENS
from openk3.serve.cache_storage import CacheStorage, StateBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Decode batch sizes with a graph of their own; a batch runs in the smallest bucket that holds it."""


class LatentRows(NamedTuple):
    """The new MLA latents of one step and where they go in the block pool (:meth:`StaticDecode.latent_rows`):
    row ``(b, t)`` goes to page ``page_BT[b, t]``, offset ``off_BT[b, t]`` of every MLA layer."""

    page_BT: torch.Tensor
    off_BT: torch.Tensor
    value_BTLW: torch.Tensor
    """``[B, T, L, W]`` in the pool's dtype."""


MIN_BLOCKS = 2
"""The fewest blocks per row in a step's table (``N``): dynamo specialises a size of 1, so a one-block table
would compile a graph of its own; the second block (null block 0) is past every row's length, so the Triton
kernel never reads it (the torch path gathers and masks it)."""

MAX_COMPILED_STEPS = 1024
"""Compiled step shapes ``(B, T)`` one process may hold (:func:`compile_settings`)."""


def bucket_of(n: int) -> int:
    """The smallest power of two ≥ ``n`` (``n ≥ 1``)."""
    return 1 << (n - 1).bit_length()


def packed_inputs(B: int, T: int, extra_inputs: int, max_blocks: int, device: torch.device) -> torch.Tensor:
    """The packed int64 input buffer shared by the steps of one ``(B, T)`` (:attr:`StaticDecode.inputs`):
    ``B·(T + 2 + extra_inputs + max_blocks)`` zeros, the block tables of every ``N ≤ max_blocks`` last."""
    return torch.zeros(B * (T + 2 + extra_inputs + max_blocks), dtype=torch.int64, device=device)


class StaticDecode:
    """One step for ``B`` rows of ``T`` new tokens over ``N`` blocks each, on fixed buffers (see the module
    docstring)."""

    def __init__(
        self,
        lm: nn.Module,
        storage: CacheStorage,
        inputs: torch.Tensor,
        B: int,
        T: int,
        N: int,
        sample_vocab_size: int | None,
        extra_inputs: int = 0,
    ) -> None:
        """``inputs``: the packed int64 input buffer of every step of this ``(B, T)`` (:func:`packed_inputs`),
        at least ``B·(T + 2 + extra_inputs + N)`` long; ``extra_inputs``: int64 inputs per row before the
        block tables (:attr:`extra_BE`), for a subclass. Raises ``ValueError`` when ``inputs`` is too short.
        The table's width ``N`` is marked symbolic for ``torch.compile`` (:meth:`compiled`)."""
        E = extra_inputs
        if inputs.numel() < B * (T + 2 + E + N):
            raise ValueError(
                f"the packed inputs hold {inputs.numel()} values; B={B}, T={T}, N={N} and {E} extra inputs "
                f"need {B * (T + 2 + E + N)}"
            )
        self.lm, self.storage, self.B, self.T, self.N = lm, storage, B, T, N
        self.sample_vocab_size = sample_vocab_size
        self.kinds = lm.config.layer_types
        self.inputs = inputs
        """Packed int64 inputs: ids ``[B, T]``, cached lengths ``[B]``, valid ``[B]`` (0/1),
        ``[B, extra_inputs]``, then the block tables ``[B, N]`` (the rest of the buffer unused)."""
        self.ids_BT = inputs[: B * T].view(B, T)
        self.lengths_B = inputs[B * T : B * (T + 1)]
        self.valid_B = inputs[B * (T + 1) : B * (T + 2)]
        self.extra_BE = inputs[B * (T + 2) : B * (T + 2 + E)].view(B, E)
        self.table_BN = inputs[B * (T + 2 + E) : B * (T + 2 + E + N)].view(B, N)
        torch._dynamo.mark_dynamic(self.table_BN, 1)  # one compiled graph for every N (compiled())
        self.next_B = torch.zeros(B, dtype=torch.int64, device=inputs.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.state_ptr: int | None = None
        """Address of the KDA states the graph was captured on (0 without KDA layers)."""
        self._sample: Callable[[StateBatch | None], LatentRows | None] | None = None
        """:meth:`sample` compiled (:meth:`compiled`), built on first use."""

    @torch.no_grad()
    def forward(self, states: StateBatch | None) -> None:
        """The step: reads the input buffers and ``states`` (updated in place), writes the greedy tokens to
        :attr:`next_B` and the new latents to the pool (:meth:`sample`, then :meth:`store_latents`)."""
        self.store_latents(self.sample(states))

    @torch.no_grad()
    def sample(self, states: StateBatch | None) -> LatentRows | None:
        """The step up to the pool write (what is compiled on CUDA): runs the model, writes the greedy tokens
        to :attr:`next_B` and returns the new latents' rows for :meth:`store_latents` (``None`` without MLA
        layers). The block pool is only read here."""
        h_BTD, _, mla, _ = self.run_model(states)
        logits_BV = self.lm.lm_head(h_BTD[:, -1])
        if self.sample_vocab_size is not None:
            logits_BV = logits_BV[:, : self.sample_vocab_size]
        self.next_B.copy_(logits_BV.argmax(-1))
        return self.latent_rows(mla)

    def run_model(
        self, states: StateBatch | None, verify: bool = False, feature_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[PagedPool], list[KDAStateSlots]]:
        """The model over :attr:`ids_BT` on the paged caches: ``(h_BTD, the features of feature_layers
        f_BTF or None, MLA caches holding the new latents, KDA caches)``
        (:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`); with ``verify`` the KDA caches
        keep the state after every token (their ``rollback`` then picks one)."""
        st = self.storage
        lo = st.layout
        kda: list[KDAStateSlots] = []
        mla: list[PagedPool] = []
        if states is not None:
            kda = [KDAStateSlots(r, c, verify=verify) for r, c in zip(states.recurrent, states.conv)]
        L = lo.num_mla_layers
        mla = [PagedPool(st.pages, self.table_BN, self.lengths_B, i, L, lo.block_size) for i in range(L)]
        kda_iter, mla_iter = iter(kda), iter(mla)
        caches = [next(kda_iter) if kind == "kda" else next(mla_iter) for kind in self.kinds]
        h_BTD, f_BTF = self.lm.model.forward_with_features(
            self.ids_BT, feature_layers, KimiCache(caches), check_inputs=False, two_phase_attn_res=True
        )
        return h_BTD, f_BTF, mla, kda

    def latent_rows(self, mla: list[PagedPool]) -> LatentRows | None:
        """Where and what the step writes into the pool, without writing: the ``T`` new latents of every
        row at ``table[p // bs]``, offset ``p % bs``; a padding row gets page 0, offset 0 and the value null
        block 0 holds there, so its write changes nothing (``None`` without MLA layers)."""
        if not mla:
            return None
        lo = self.storage.layout
        bs = lo.block_size
        view = self.storage.pages.view(-1, lo.num_mla_layers, bs, lo.latent_width)
        valid_B1 = self.valid_B.bool()[:, None]
        pos_BT = self.lengths_B[:, None] + torch.arange(self.ids_BT.shape[1], device=self.lengths_B.device)
        page_BT = torch.where(valid_B1, self.table_BN.gather(1, pos_BT // bs), 0)
        off_BT = torch.where(valid_B1, pos_BT % bs, 0)
        new_BTLW = torch.stack([c.new for c in mla], 2).to(lo.dtype)
        old_BTLW = view[page_BT, :, off_BT]
        return LatentRows(page_BT, off_BT, torch.where(valid_B1[..., None, None], new_BTLW, old_BTLW))

    def store_latents(self, rows: LatentRows | None) -> None:
        """Write :meth:`latent_rows`' values into the pool: one ``index_put_`` on a view of it, always run
        eagerly (on CUDA inside the same CUDA graph as the compiled :meth:`sample`): compiled, an in-place
        write through a view of a graph input may be functionalised into an ``index_put`` on a copy of the
        whole pool and a ``copy_`` back, which Inductor's reinplacing removes only in some torch versions."""
        if rows is None:
            return
        lo = self.storage.layout
        view = self.storage.pages.view(-1, lo.num_mla_layers, lo.block_size, lo.latent_width)
        view[rows.page_BT, :, rows.off_BT] = rows.value_BTLW

    def before_run(self) -> None:
        """Host-side updates of a subclass's other input buffers, made after any capture and right before
        each run (none here)."""

    def compiled(self) -> Callable[[StateBatch | None], None]:
        """What :meth:`capture` records: :meth:`sample` through ``torch.compile`` (Inductor, one graph,
        without Inductor's own CUDA graphs: this class captures the compiled kernels itself), built on first
        use, then :meth:`store_latents` eagerly. Every size is static but the block table's width ``N``
        (marked symbolic on :attr:`table_BN`; a subclass marks its own buffers of ``N``), and
        ``dynamic=False`` keeps dynamo's automatic dynamic shapes off, so a second ``B`` or ``T`` compiles a
        graph of its own rather than turning them symbolic: with every size symbolic (``dynamic=True``)
        Inductor's code gave other tokens than the eager step, with ``N`` alone the eager step's
        (``docs/LOG.md``). Dynamo keeps its graphs on :meth:`sample`'s code, guarded on the shapes and Python
        values the step reads, so the steps of one ``(B, T)`` (their packed inputs one buffer, the offsets of
        its views fixed) share one graph for every ``N ≥ 2`` (a size of 1 would be specialised:
        :data:`MIN_BLOCKS`): one compilation per ``(B, T)``, while each ``(B, T, N)`` is captured in a CUDA
        graph of its own. A subclass changes the step by overriding :meth:`sample` (the speculative step)."""
        if self._sample is None:
            self._sample = torch.compile(self.sample, fullgraph=True, dynamic=False)
        return self._compiled_step

    def _compiled_step(self, states: StateBatch | None) -> None:
        """:meth:`forward` with the compiled :meth:`sample` (see :meth:`compiled`)."""
        self.store_latents(self._sample(states))

    def capture(self, states: StateBatch | None) -> None:
        """Capture :meth:`compiled` in a CUDA graph (all rows padding: ``valid`` 0, lengths 0, the scratch
        states), after two warm-up runs on a side stream (on the first the compilation, unless another ``N``
        of this ``(B, T)`` compiled the graph, and lazy initialisation); the first's wall time goes to
        stderr."""
        self.inputs.zero_()
        run = self.compiled()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), compile_settings():
            start = time.perf_counter()
            run(states)
            torch.cuda.synchronize()
            print(
                f"{type(self).__name__} (B={self.B}, T={self.T}, N={self.N}): first warm-up run (with any "
                f"compilation) {time.perf_counter() - start:.1f} s",
                file=sys.stderr,
            )
            run(states)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), compile_settings():  # a private memory pool per graph
            run(states)
        self.state_ptr = states.recurrent.data_ptr() if states is not None else 0


def compile_settings():
    """``torch.compile`` settings for the calls of compiled steps (a context manager): dynamo's recompilation
    limits raised past its default of 8 per function (at which ``fullgraph`` raises), since every ``(B, T)``
    adds a compiled graph of :meth:`StaticDecode.sample`."""
    names = [n for n in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit") if hasattr(torch._dynamo.config, n)]  # fmt: skip
    return torch._dynamo.config.patch(
        {n: max(getattr(torch._dynamo.config, n), MAX_COMPILED_STEPS) for n in names}
    )


class DecodeGraphs:
    """Runs batches of short chunks (``T ≤ 16`` tokens each: decodes, a prefix hit's suffix), greedy where
    they sample, through :class:`StaticDecode` steps, one per ``(B, T, N)``, captured in CUDA graphs when
    ``capture`` (CUDA only), else eager.

    ``scratch_slot``: state pages outside the block pool for padding rows (``()`` without KDA layers).
    ``max_batch``: the most decodes of one step (the scheduler's ``max_num_seqs``). ``max_blocks``: the most
    blocks one request's table holds
    (:meth:`~openk3.serve.kv_manager.KVCacheManager.max_table_blocks`), which sizes the tables of the packed
    inputs (``bucket_of(max_blocks)`` columns)."""

    def __init__(
        self,
        lm: nn.Module,
        storage: CacheStorage,
        scratch_slot: tuple[int, ...],
        max_batch: int,
        max_blocks: int,
        sample_vocab_size: int | None,
        capture: bool,
    ) -> None:
        if capture and storage.pages.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {storage.pages.device}")
        if max_batch > BATCH_BUCKETS[-1]:
            raise ValueError(f"max_batch={max_batch} exceeds the largest decode bucket {BATCH_BUCKETS[-1]}")
        self.lm, self.storage, self.scratch_slot = lm, storage, scratch_slot
        self.sample_vocab_size, self.capture = sample_vocab_size, capture
        self.has_kda = "kda" in lm.config.layer_types
        self.max_bucket = bucket_of(max_batch)
        self.max_blocks = bucket_of(max(max_blocks, MIN_BLOCKS))
        self.steps: dict[tuple[int, int, int], StaticDecode] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        """The packed input buffer of each ``(B, T)`` (:func:`packed_inputs`), shared by its steps."""
        self._stage(self.max_bucket * 4)
        if self.has_kda:  # size the workspace for the largest bucket now, so its address never changes
            storage.gather_states([scratch_slot] * self.max_bucket)
            storage.flush_states()

    def _stage(self, numel: int) -> None:
        """A host buffer of ``numel`` int64 for the step's packed inputs, written in place through its numpy
        view (pageable: see the module docstring)."""
        self.host_inputs = torch.zeros(numel, dtype=torch.int64)
        self.host_inputs_np = self.host_inputs.numpy()

    def supports(self, chunks) -> bool:
        """Whether a step's chunks (of one length) can run here: at most ``ABSORB_MAX_TOKENS`` tokens each,
        greedy without logprobs where they sample."""
        return len(chunks) <= self.max_bucket and all(
            c.num_tokens <= ABSORB_MAX_TOKENS
            and not (
                c.samples
                and (
                    c.request.sampling_params.temperature != 0
                    or c.request.sampling_params.logprobs is not None
                )
            )
            for c in chunks
        )

    def run(self, chunks) -> list[int]:
        """Run the chunks (``ScheduledChunk``s of ``T`` tokens each); returns the greedy token after each, or
        ``[]`` (nothing read back) when none of them samples."""
        n, T = len(chunks), chunks[0].num_tokens
        step = self.step_for(bucket_of(n), T, self.blocks_for(chunks, T))
        self.launch(step, chunks, [t for c in chunks for t in c.token_ids])
        if not any(c.samples for c in chunks):
            return []
        return step.next_B[:n].tolist()  # the step's one host wait: one device→host copy of n tokens

    def step_for(self, B: int, T: int, N: int) -> StaticDecode:
        """The step of ``(B, T, N)`` in :attr:`steps`, built on first use (:meth:`new_step`)."""
        step = self.steps.get((B, T, N))
        if step is None:
            step = self.steps[(B, T, N)] = self.new_step(B, T, N)
        return step

    def new_step(self, B: int, T: int, N: int) -> StaticDecode:
        """A step of ``(B, T, N)`` on the packed inputs of ``(B, T)``."""
        return StaticDecode(self.lm, self.storage, self.packed_inputs(B, T), B, T, N, self.sample_vocab_size)

    def packed_inputs(self, B: int, T: int, extra_inputs: int = 0) -> torch.Tensor:
        """The packed input buffer of the steps of ``(B, T)`` (:func:`packed_inputs`), built on first use."""
        buf = self.inputs.get((B, T))
        if buf is None:
            buf = self.inputs[(B, T)] = packed_inputs(
                B, T, extra_inputs, self.max_blocks, self.storage.pages.device
            )
        return buf

    def blocks_for(self, chunks, T: int) -> int:
        """``N``: blocks per row covering ``T`` new tokens of every chunk (a power of two, at least
        :data:`MIN_BLOCKS`)."""
        bs = self.storage.layout.block_size
        return bucket_of(max(MIN_BLOCKS, *((c.start + T - 1) // bs + 1 for c in chunks)))

    def launch(self, step: StaticDecode, chunks, ids: list[int], extra: list[int] = ()) -> None:
        """Run ``step`` for ``chunks``: check their KDA states out (padding rows: the scratch slot), capture
        the step first on CUDA (or again when the states moved), stage the packed inputs (``ids``: the
        chunks' ``n·T`` token ids; ``extra``: ``n·E`` values of :attr:`StaticDecode.extra_BE`), call its
        :meth:`~StaticDecode.before_run` and replay it (or run it eagerly)."""
        n, B, T, N = len(chunks), step.B, step.T, step.N
        pad, E = B - n, step.extra_BE.shape[1]
        slots = [c.state_slot for c in chunks] + [self.scratch_slot] * pad
        states = self.storage.gather_states(slots) if self.has_kda else None
        moved = states is not None and states.recurrent.data_ptr() != step.state_ptr
        if self.capture and (step.graph is None or moved):
            scratch = self.storage.gather_states([self.scratch_slot] * B) if self.has_kda else None
            step.capture(scratch)
            states = self.storage.gather_states(slots) if self.has_kda else None
        values = (
            list(ids) + [0] * (pad * T)
            + [c.start for c in chunks] + [0] * pad
            + [1] * n + [0] * pad
            + list(extra) + [0] * (pad * E)
            + [b for c in chunks for b in (c.block_table + [0] * N)[:N]] + [0] * (pad * N)
        )  # fmt: skip
        if self.host_inputs.numel() < len(values):
            self._stage(len(values))
        self.host_inputs_np[: len(values)] = values  # no tensor built per step
        step.inputs[: len(values)].copy_(self.host_inputs[: len(values)], non_blocking=True)
        step.before_run()
        if step.graph is not None:
            step.graph.replay()
        else:
            step.forward(states)
