"""Lossless speculative decoding with a draft head (``docs/speculative.md``).

A step drafts a chain of ``k`` tokens ``d_1..d_k`` from the draft's distributions ``q_1..q_k``, then runs the
target once over ``[y, d_1, …, d_k]`` (``y`` the last emitted token), giving ``p_0..p_k``. The standard rule
(Leviathan et al. 2023, ``docs/references.md#speculative-decoding``), :func:`accept_drafts`:

* keep ``d_i`` with probability ``min(1, p_{i−1}(d_i) / q_i(d_i))``, in order;
* at the first rejection draw the next token from ``norm(max(0, p_{i−1} − q_i))`` and stop;
* when all ``k`` are kept, draw a bonus token from ``p_k``.

The emitted tokens then follow the target's distribution exactly; temperature and top-p shape ``p`` and ``q``
alike (:func:`~openk3.generate.sampling_probs`). Greedy (temperature 0) keeps drafts while they equal the
target's argmax, then emits the argmax (:func:`accept_greedy`): the output is the target's greedy output.

The target's caches roll back to the last kept token without recomputing anything
(:meth:`~openk3.model.cache.KimiCache.rollback`: a kept KDA state per verified token, MLA latents cut); the
draft's cache drops its chain and reads the verified tokens' target features (which the verification's
:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features` returns with its hidden states).

Legend: ``k`` drafted tokens, ``V`` vocabulary, ``P`` prompt tokens, ``F`` tapped features.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from openk3.generate import PREFILL_CHUNK, check_sampling, sampling_probs
from openk3.model.draft import EagleDraft

MAX_SPECULATIVE_TOKENS = 16
"""Most drafted tokens per step (the verify forward stays on the decode path of the target's layers)."""


def check_num_speculative_tokens(k) -> int:
    """``k`` if it is an int in ``[1, MAX_SPECULATIVE_TOKENS]``, else ``ValueError`` naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    return k


def accept_drafts(
    p_KV: torch.Tensor, q_KV: torch.Tensor, drafts: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """The speculative sampling rule. ``p_KV`` ``[k+1, V]``: target probabilities at the verified positions;
    ``q_KV`` ``[k, V]``: the draft's, from which ``drafts`` (``k`` ids) were drawn. Returns ``(n, token)``:
    drafts kept and the token that follows them. Draws ``k`` uniforms then one token from ``generator``."""
    k = len(drafts)
    if k:
        d_K = torch.tensor(drafts, device=p_KV.device)
        rows = torch.arange(k, device=p_KV.device)
        u_K = torch.rand(k, generator=generator, device=p_KV.device, dtype=p_KV.dtype)
        keep_K = u_K * q_KV[rows, d_K] < p_KV[rows, d_K]
        n = int(keep_K.long().cumprod(0).sum())
    else:
        n = 0
    if n == k:
        dist_V = p_KV[k]
    else:
        dist_V = (p_KV[n] - q_KV[n]).clamp_min(0)
        if not bool(dist_V.sum() > 0):  # p == q on the support: every draft would be kept; rounding only
            dist_V = p_KV[n]
    return n, int(torch.multinomial(dist_V, 1, generator=generator))


def accept_greedy(target_logits_KV: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """Greedy verification: drafts kept while they equal the target's argmax; ``(n, argmax after them)``."""
    best = target_logits_KV.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation."""

    steps: int = 0
    """Target verify forwards."""
    drafted: int = 0
    accepted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify forward (accepted drafts + the one from the target)."""
        return (self.accepted + self.steps) / max(self.steps, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


class TokenChooser:
    """Token choice and probabilities for one request's sampling settings."""

    def __init__(self, temperature: float, top_p: float, vocab_size: int | None, generator) -> None:
        self.temperature, self.top_p, self.vocab_size, self.generator = (
            temperature,
            top_p,
            vocab_size,
            generator,
        )

    def cut(self, logits_BV: torch.Tensor) -> torch.Tensor:
        return logits_BV if self.vocab_size is None else logits_BV[..., : self.vocab_size]

    def draft(self, logits_1V: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token and the distribution it came from (``None`` when greedy)."""
        logits_1V = self.cut(logits_1V)
        if self.temperature == 0:
            return int(logits_1V.argmax(-1)), None
        q_1V = sampling_probs(logits_1V, self.temperature, self.top_p)
        return int(torch.multinomial(q_1V, 1, generator=self.generator)), q_1V

    def verify(self, logits_KV: torch.Tensor, drafts: list[int], qs: list) -> tuple[int, int]:
        logits_KV = self.cut(logits_KV)
        if self.temperature == 0:
            return accept_greedy(logits_KV, drafts)
        p_KV = sampling_probs(logits_KV, self.temperature, self.top_p)
        q_KV = torch.cat(qs) if qs else p_KV[:0]
        return accept_drafts(p_KV, q_KV, drafts, self.generator)


@torch.no_grad()
def speculative_stream(
    model: nn.Module,
    draft: EagleDraft,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    num_speculative_tokens: int = 3,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: set[int] | None = None,
    vocab_size: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    stats: SpeculativeStats | None = None,
) -> Iterator[torch.Tensor]:
    """Yield new tokens ``[1, 1]`` one at a time, like :func:`openk3.generate.stream`, drafting
    ``num_speculative_tokens`` per target forward. One sequence (``input_ids`` ``[1, P]``). ``stats`` (if
    given) receives the counts. Raises ``ValueError`` for a batch of several rows or a bad argument."""
    check_sampling(temperature, top_p, max_new_tokens, seed)
    K = check_num_speculative_tokens(num_speculative_tokens)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative decoding takes one sequence [1, P], got {getattr(input_ids, 'shape', input_ids)}"
        )
    stats = stats if stats is not None else SpeculativeStats()
    lm = getattr(model, "language_model", model)
    embed, head = lm.model.embed_tokens, lm.lm_head
    taps_at = draft.draft_config.feature_layers
    generator = None if seed is None else torch.Generator(device=input_ids.device).manual_seed(seed)
    choose = TokenChooser(temperature, top_p, vocab_size, generator)
    stop = torch.tensor(sorted(stop_ids or ()), dtype=torch.long)
    cache, dcache = lm.new_cache(), draft.new_cache()
    taps = []  # the prompt's features [1, P, F], one piece per prefill chunk
    for piece in input_ids.split(prefill_chunk, dim=1):
        h_1TD, f_1TF = lm.model.forward_with_features(piece, taps_at, cache)
        taps.append(f_1TF)
    y = choose.verify(head(h_1TD)[:, -1], [], [])[1]
    yield torch.tensor([[y]], device=input_ids.device)
    produced = 1
    if y in stop.tolist():
        return
    g_11D, _ = draft(
        draft.fuse(torch.cat(taps, 1)),
        torch.cat([input_ids[:, 1:], _ids([y], input_ids)], 1),
        embed,
        cache=dcache,
    )
    g_11D = g_11D[:, -1:]
    room = lm.config.max_position_embeddings
    while produced < max_new_tokens:
        k = max(0, min(K, max_new_tokens - produced - 1, room - cache.seq_len - 1))
        drafts, qs = [], []
        for j in range(k):
            if j:
                g_11D, _ = draft(g_11D, _ids(drafts[-1:], input_ids), embed, cache=dcache)
            d, q = choose.draft(draft.logits(g_11D, head)[:, -1])
            drafts.append(d)
            qs.append(q)
        start = cache.seq_len
        cache.begin_verify()
        h_1TD, f_1TF = lm.model.forward_with_features(_ids([y, *drafts], input_ids), taps_at, cache)
        n, y = choose.verify(head(h_1TD)[0], drafts, qs)
        cache.rollback(n + 1)
        dcache.truncate(start)
        g_1TD, _ = draft(
            draft.fuse(f_1TF[:, : n + 1]), _ids([*drafts[:n], y], input_ids), embed, cache=dcache
        )
        g_11D = g_1TD[:, -1:]
        stats.steps += 1
        stats.drafted += k
        stats.accepted += n
        stats.accepted_per_step.append(n)
        for t in [*drafts[:n], y]:
            yield torch.tensor([[t]], device=input_ids.device)
            produced += 1
            if t in stop.tolist() or produced >= max_new_tokens:
                return


def _ids(tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=like.device)


def speculative_generate(
    model: nn.Module, draft: EagleDraft, input_ids: torch.Tensor, max_new_tokens: int, **kw
) -> torch.Tensor:
    """New tokens ``[1, max_new_tokens]`` (fewer when a stop id ends it); see :func:`speculative_stream`."""
    return torch.cat(list(speculative_stream(model, draft, input_ids, max_new_tokens, **kw)), dim=1)
