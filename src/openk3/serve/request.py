"""A request inside the engine, its sampling parameters, and the output events it produces.

vLLM v1 names: a request has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (tokens
whose KDA state / MLA latents are in the cache); every step moves ``num_computed_tokens`` towards
``num_tokens``. There are no separate prefill and decode phases (a "decode" is a one-token step).
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field

import torch

from openk3.data.images import MediaInputs
from openk3.serve.prefix_cache import ROOT_HASH


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    REJECTED = "rejected"
    """Not admitted before ``queue_timeout_s`` (the API answers 429)."""

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (``openk3.generate.sample_next``): temperature 0 = greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    """Generating any of these ends the request (the token is not part of the text)."""
    logprobs: int | None = None
    """``None``: no log-probabilities; ``k`` >= 0: each sampled token's log-probability and the ``k`` most
    likely tokens' (:class:`TokenLogprobs`), from the model's raw logits (before temperature and top-p, as
    vLLM's default ``raw_logprobs``)."""
    num_speculative_tokens: int | None = None
    """Drafted tokens per step with an engine draft (``None``: the engine's default; 0: no speculation)."""

    def __post_init__(self) -> None:
        from openk3.generate import check_sampling
        from openk3.speculative import MAX_SPECULATIVE_TOKENS

        check_sampling(self.temperature, self.top_p, self.max_tokens)
        k = self.num_speculative_tokens
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(
                f"num_speculative_tokens must be None or an int in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


MAX_LOGPROBS = 20
"""Most alternatives per token (``top_logprobs``; OpenAI's and vLLM's default limit)."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log, fp32 ``log_softmax`` of the raw logits) at one sampled position."""

    token_id: int
    logprob: float
    """Of the sampled token."""
    top: tuple[tuple[int, float], ...]
    """The ``SamplingParams.logprobs`` most likely tokens, most likely first: ``(token id, logprob)``."""


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    """``"stop"``, ``"length"``, ``"abort"`` or ``"rejected"``."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    """One per ``new_token_ids`` entry when the request asked for ``logprobs``."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's full blocks (prompt, then output)."""
    checkpoint_positions: frozenset[int] = frozenset()
    """Prompt boundaries (token counts) where the KDA state is stored; set at admission."""
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    sampled_logprobs: TokenLogprobs | None = None
    """Log-probabilities of the token the runner sampled in this step (``logprobs`` requested), handed to
    the step's :class:`RequestOutput` by the scheduler."""
    media: MediaInputs | None = None
    """The prompt's images, for its media placeholder tokens (:mod:`openk3.data.images`)."""
    media_embeds: torch.Tensor | None = None
    """``[M, D]`` text-width embeddings of ``media``, computed by the runner at the first chunk that needs
    them and kept until the prompt is computed."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def hash_root(self) -> bytes:
        """Parent hash of the request's first cache block: the media's digest enters the chain, so blocks
        are shared only between prompts with the same tokens and the same images."""
        if self.media is None:
            return ROOT_HASH
        return hashlib.blake2b(ROOT_HASH + self.media.digest, digest_size=16).digest()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens the request can ever hold: prompt + ``max_tokens``."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a decode reads one token)."""
        P = self.num_prompt_tokens
        if start >= P:
            return self.output_token_ids[start - P : stop - P]
        if stop <= P:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - P]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
