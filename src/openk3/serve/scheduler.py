"""The scheduler: which requests run this step and with how many tokens, then the bookkeeping after.

``schedule()`` spends the per-step token budget (``max_num_batched_tokens``) on running requests first
(decodes, one token each, then unfinished prefills), then admits waiting requests in arrival order while
their blocks fit (:meth:`KVCacheManager.plan_admission`: free plus evictable) and a sequence slot is free.
Prompts are prefilled in chunks of at most ``long_prefill_token_threshold`` tokens, each cut to end at the
request's next KDA checkpoint boundary (vLLM "align" mode,
``docs/references.md#paged-pool-and-prefix-cache``), so a long prompt
never holds the whole budget and short requests keep being admitted.

``update()`` advances ``num_computed_tokens``, caches full blocks and checkpoints, appends sampled tokens
and finishes requests (stop token, ``max_tokens``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from openk3.serve.config import SchedulerConfig
from openk3.serve.kv_manager import KVCacheManager
from openk3.serve.request import Request, RequestOutput, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting`` (the API answers 429 with ``Retry-After``)."""


@dataclass
class ScheduledChunk:
    """One request's share of a step: tokens ``[start, start + num_tokens)`` of ``request.all_token_ids``."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    state_slot: tuple[int, ...]

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids_between(self.start, self.start + self.num_tokens)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    """Requests ended while scheduling (aborted, or rejected after ``queue_timeout_s``)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._to_abort: set[str] = set()
        self.num_rejected = 0

    # ---- requests in and out ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ``ValueError`` when it can never fit, :class:`QueueFullError` when the
        waiting queue is full."""
        if request.max_num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt + max_tokens = {request.max_num_tokens} tokens exceeds max_model_len="
                f"{self.config.max_model_len}"
            )
        self.kv.check_fits_pool(request)
        if len(self.waiting) >= self.config.max_waiting:
            self.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Mark a request for abortion; it is freed at the start of the next :meth:`schedule`."""
        self._to_abort.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._to_abort)

    def _finish(self, request: Request, status: RequestStatus) -> RequestOutput:
        request.status = status
        self.kv.free(request)
        if request in self.running:
            self.running.remove(request)
        return RequestOutput(
            request.request_id, [], True, status.value, request.num_prompt_tokens, request.num_cached_tokens
        )

    def schedule_aborts(self) -> list[RequestOutput]:
        """Apply pending aborts now (without scheduling a step)."""
        return self._process_aborts()

    def _process_aborts(self) -> list[RequestOutput]:
        out = []
        ids, self._to_abort = self._to_abort, set()
        for req in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(req)
            out.append(self._finish(req, RequestStatus.FINISHED_ABORTED))
        for req in [r for r in self.running if r.request_id in ids]:
            out.append(self._finish(req, RequestStatus.FINISHED_ABORTED))
        return out

    def _expire_waiting(self, now: float) -> list[RequestOutput]:
        """Reject requests that waited longer than ``queue_timeout_s`` (load shedding)."""
        expired = [r for r in self.waiting if now - r.arrival_time > self.config.queue_timeout_s]
        for request in expired:
            self.waiting.remove(request)
            self.num_rejected += 1
        return [self._finish(r, RequestStatus.REJECTED) for r in expired]

    # ---- schedule --------------------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to run for ``request`` within ``budget``: its decode token, or a prefill chunk capped by
        ``long_prefill_token_threshold`` and cut at the next checkpoint boundary."""
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, budget)
        if start < request.num_prompt_tokens:
            n = min(n, self.config.long_prefill_token_threshold)
            cuts = [p for p in request.checkpoint_positions if start < p < start + n]
            if cuts:
                n = min(cuts) - start
        return max(n, 0)

    def _schedule_chunk(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        n = self._num_new_tokens(request, budget)
        if n:
            self.kv.allocate_slots(request, n)
            rid = request.request_id
            out.chunks.append(
                ScheduledChunk(
                    request,
                    request.num_computed_tokens,
                    n,
                    self.kv.block_tables[rid],
                    self.kv.state_slots[rid],
                )
            )
        return n

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests in arrival order while blocks, sequence slots and budget last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            plan = self.kv.plan_admission(request)
            if plan is None:
                return  # the head of the queue waits for blocks; later arrivals do not overtake it
            self.waiting.popleft()
            self.kv.admit(request, plan)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= self._schedule_chunk(request, budget, out)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.finished += self._process_aborts()
        out.finished += self._expire_waiting(time.monotonic())
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in decoding + prefilling:
            if budget <= 0:
                break
            budget -= self._schedule_chunk(request, budget, out)
        self._admit_waiting(budget, out)
        return out

    # ---- update ----------------------------------------------------------------------------------------
    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if token in request.sampling_params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.sampling_params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[RequestOutput]:
        """Apply a step's results; ``sampled`` maps request id → token for chunks that sample (a list of
        tokens for a speculative decode: its kept drafts then the target's token; the cache holds the
        chunk's token and the kept drafts)."""
        outputs = list(out.finished)
        now = time.monotonic()
        for chunk in out.chunks:
            request = chunk.request
            tokens = sampled.get(request.request_id)
            tokens = [] if tokens is None else tokens if isinstance(tokens, list) else [tokens]
            emitted, status = [], None
            for token in tokens:  # appended first: the block hashes read them
                request.output_token_ids.append(token)
                emitted.append(token)
                status = self._stop_status(request, token)
                if status is not None:
                    break
            request.num_computed_tokens += chunk.num_tokens + max(len(emitted) - 1, 0)
            self.kv.cache_full_blocks(request)
            # a stop inside a speculative decode's tokens leaves the state further on: no checkpoint then
            if len(emitted) == len(tokens):
                if request.num_computed_tokens in request.checkpoint_positions:
                    self.kv.store_checkpoint(request)
                else:
                    self.kv.store_decode_checkpoint(request)
            if not tokens:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            if status is not None:
                request.status = status
                self.kv.free(request)
                self.running.remove(request)
            logprobs, request.sampled_logprobs = request.sampled_logprobs, None
            outputs.append(
                RequestOutput(
                    request.request_id,
                    emitted,
                    status is not None,
                    status.value if status else None,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    new_logprobs=None if logprobs is None else [logprobs],
                )
            )
        return outputs
