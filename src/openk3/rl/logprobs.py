"""Log-probs of realised response tokens under a model: one forward over prompt + response.

A causal LM's logits at position ``t`` predict token ``t + 1``, so the response token ``y_j`` (at position
``P + j`` after a ``P``-token prompt) is scored by the logits at position ``P + j − 1``; the last response
token is never fed. Rows are right-padded (a causal model never sees the padding of its own row).

Legend: ``B`` sequences, ``T`` response tokens (padded to the longest), ``S`` prompt + response − 1, ``V``
vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def response_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_BT, mask_BT)``: ``log softmax(logits / temperature)`` gathered at each realised response
    token, and 1.0 where a token exists. Gradient flows when called with grad enabled.

    ``vocab_size``: only ids below it take part in the softmax (the rollout engine's ``sample_vocab_size``).
    Raises ``ValueError`` for mismatched lists, an empty prompt or response, or temperature ≤ 0."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(
            f"need one response per prompt, got {len(prompts)} prompts and {len(responses)} responses"
        )
    if any(not p for p in prompts) or any(not r for r in responses):
        raise ValueError("every prompt and every response needs at least one token")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    device = next(model.parameters()).device
    seqs = [p + r[:-1] for p, r in zip(prompts, responses)]
    S = max(len(s) for s in seqs)
    T = max(len(r) for r in responses)
    ids_BS = torch.zeros(len(seqs), S, dtype=torch.long, device=device)
    for b, s in enumerate(seqs):
        ids_BS[b, : len(s)] = torch.tensor(s, device=device)
    logits_BSV = _logits(model(ids_BS)).float()
    if vocab_size is not None:
        logits_BSV = logits_BSV[..., :vocab_size]
    mask_BT = torch.zeros(len(seqs), T, device=device)
    rows = []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(r), device=device)
        tok = torch.tensor(r, device=device)
        lp = torch.log_softmax(logits_BSV[b, pos] / temperature, -1).gather(-1, tok[:, None])[:, 0]
        rows.append(lp)
        mask_BT[b, : len(r)] = 1.0
    logp_BT = torch.stack([torch.nn.functional.pad(lp, (0, T - lp.shape[0])) for lp in rows])
    return logp_BT, mask_BT
